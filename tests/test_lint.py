"""The code passes the project's linter (ruff, configured in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_passes():
    if shutil.which("ruff") is None and subprocess.run([sys.executable, "-m", "ruff", "--version"],
                                                       capture_output=True).returncode:
        pytest.skip("ruff is not installed (it comes with the test extras)")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "pdserve", "tests", "benchmarks"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_ray_stays_in_the_control_plane():
    """DESIGN.md: Ray is the control plane; only cluster/ray_app.py and cluster/ray_launcher.py import it,
    so workers and the router run as plain processes without it."""
    import re

    allowed = {ROOT / "pdserve" / "cluster" / "ray_app.py", ROOT / "pdserve" / "cluster" / "ray_launcher.py"}
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "pdserve").rglob("*.py")
                 if p not in allowed and re.search(r"^\s*(import ray\b|from ray\b)", p.read_text(), re.M)]
    assert not offenders, offenders
