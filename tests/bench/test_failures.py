"""The harness against an unreachable or failing server: a clear error, partial results kept."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from tests.integration.conftest import free_port


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cluster.cli", "bench", "--no-progress", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_unreachable_server_is_a_clear_error(tmp_path):
    out = bench("--base-url", f"http://127.0.0.1:{free_port()}", "--result-dir", str(tmp_path))
    assert out.returncode == 1
    assert "cannot reach the server" in out.stderr
    assert "Traceback" not in out.stderr


def test_bad_option_is_a_clear_error(tmp_path):
    out = bench("--base-url", "ftp://x", "--result-dir", str(tmp_path))
    assert out.returncode == 2 and "--base-url: must start with http://" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.fixture
def mock_server():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.bench.mock_server", "--port", str(port),
                             "--tokens-per-s", "50"])
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: completed(url) is not None, 60, "the mock server to answer")
    yield proc, url
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def completed(url: str) -> int | None:
    """Streams the mock server has answered to the end (None: it does not answer yet)."""
    try:
        return httpx.get(url + "/stats", timeout=1).json()["completed"]
    except httpx.HTTPError:
        return None


def wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds} s waiting for {what}")
        time.sleep(0.05)


def test_server_dying_mid_run_keeps_partial_results(tmp_path, mock_server):
    proc, url = mock_server
    run = subprocess.Popen([sys.executable, "-m", "pdserve.cluster.cli", "bench", "--no-progress", "--base-url", url,
                            "--num-prompts", "40", "--request-rate", "10", "--random-output-len", "5",
                            "--random-input-len", "8", "--result-dir", str(tmp_path), "--label", "partial"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Mid-run is an event, not a time: however long the CLI takes to start, the server dies once it
    # has answered a few of the run's requests (40 arrive over ~4 s: most are still to come).
    wait_for(lambda: (completed(url) or 0) >= 3 or run.poll() is not None, 120, "the run's first answers")
    proc.kill()  # the server dies; the remaining requests find nobody
    stdout, stderr = run.communicate(timeout=120)
    assert run.returncode == 3, stderr
    assert "Traceback" not in stderr
    data = json.loads((tmp_path / "partial.json").read_text())
    records = data["runs"][0]["records"]
    assert len(records) == 40
    ok = [r for r in records if r["ok"]]
    failed = [r for r in records if not r["ok"]]
    assert ok and failed
    assert {r["error"] for r in failed} <= {"connection_refused", "connection"}
    assert "Failed requests:" in stdout and "connection" in stdout
