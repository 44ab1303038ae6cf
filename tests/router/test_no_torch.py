"""The router never runs a model: its process must not import torch (seconds of start-up and
hundreds of MB for nothing), nor must the CLI before a command needs it. Checked in fresh
interpreters and a real router process, since the test session has torch."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

CHECK = """
heavy = sorted(m for m in ("torch", "triton", "ray") if m in sys.modules)
assert not heavy, heavy
"""

ROUTER = """
import sys
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.router.app import Router, RouterConfig
from pdserve.router.discovery import StoreDiscovery
from pdserve.router.pool import WorkerPool

from pdserve.router.models import ServedModel

model = "smollm2-135m-instruct"
router = Router(RouterConfig(), WorkerPool([]), [ServedModel(model, load_tokenizer(model))])
router.create_app()
""" + CHECK

CLI_HELP = """
import contextlib, io, sys
from pdserve.cluster import cli
for argv in (["--help"], ["serve", "--help"], ["router", "--help"], ["worker", "decode", "--help"],
             ["worker", "prefill", "--help"], ["bench", "--help"], ["generate", "--help"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        cli.main(argv)
""" + CHECK


@pytest.mark.parametrize("code", [ROUTER, CLI_HELP], ids=["router-app", "pdserve-help"])
def test_no_torch_in_a_fresh_interpreter(code):
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.integration
def test_a_running_pdserve_router_has_not_loaded_torch():
    from tests.integration.conftest import free_port, start_router

    router, url = start_router([f"127.0.0.1:{free_port()}"], "smollm2-135m-instruct", ready=False)
    try:
        with open(f"/proc/{router.pid}/maps") as f:
            libraries = {line.split()[-1] for line in f if "/" in line}
        assert not [lib for lib in libraries if "/torch/" in lib], "the router process loaded torch"
    finally:
        router.send_signal(signal.SIGTERM)
        router.wait(30)
