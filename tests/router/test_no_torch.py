"""The router never runs a model: its process must not import torch (seconds of start-up and
hundreds of MB for nothing). Checked in a fresh interpreter, since the test session has torch."""

from __future__ import annotations

import subprocess
import sys

ROUTER = """
import sys
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.router.app import Router, RouterConfig
from pdserve.router.discovery import StoreDiscovery
from pdserve.router.pool import WorkerPool

router = Router(RouterConfig(), WorkerPool([]), load_tokenizer("smollm2-135m-instruct"), "smollm2-135m-instruct")
router.create_app()
heavy = sorted(m for m in ("torch", "triton", "ray") if m in sys.modules)
assert not heavy, heavy
"""


def test_the_router_does_not_import_torch():
    done = subprocess.run([sys.executable, "-c", ROUTER], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
