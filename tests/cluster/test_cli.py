"""The pdserve command line, run as a user would (a subprocess)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from pdserve.engine.config import EngineConfig


def pdserve(*args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cluster.cli", *args], input=stdin, text=True,
                          capture_output=True, timeout=timeout)


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_help_documents_every_engine_option(command):
    out = pdserve(command, "--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for f in dataclasses.fields(EngineConfig):
        assert "--" + f.name.replace("_", "-") in text
        assert " ".join(f.metadata["help"].split())[:40] in text


def test_generate_streams_an_answer():
    out = pdserve("generate", "--model", "random:tiny", "--prompt", "Hello", "--max-tokens", "5", "--temperature", "1",
                  "--num-kv-blocks", "64", "--no-load-progress", "-v")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip(), "no text"
    assert "5 tokens" in out.stderr


def test_chat_reads_turns_until_exit():
    out = pdserve("chat", "--model", "random:tiny", "--max-tokens", "3", "--num-kv-blocks", "64",
                  "--no-load-progress", stdin="hi\n/reset\nagain\n/exit\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("> ") >= 3


def test_bad_option_is_a_clear_error():
    out = pdserve("generate", "--model", "no-such-model", "--prompt", "x")
    assert out.returncode == 2
    assert "model: unknown model 'no-such-model'" in out.stderr
    assert "Traceback" not in out.stderr
