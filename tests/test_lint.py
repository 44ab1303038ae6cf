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


# The packages' layering (DESIGN.md, "Added in the second round"): what both worker roles share lives
# in worker/, below both; the roles meet only through kvtransfer and the protocol; the state store
# and the metric buckets sit below the workers, the router and the control plane. Each entry: a
# package (or module) of pdserve, and either the packages it must never import or the only ones it
# may (its own included). Lazy imports inside functions count too.
WORKER_ROLES_AND_ABOVE = {"decode_worker", "prefill_worker", "router", "cluster", "bench"}
NEVER = {
    "decode_worker": {"prefill_worker", "router", "cluster", "bench"},
    "prefill_worker": {"decode_worker", "router", "cluster", "bench"},
    "worker": WORKER_ROLES_AND_ABOVE,
    "kvtransfer": WORKER_ROLES_AND_ABOVE | {"worker"},
}
ONLY = {
    # the router runs no model: protocol, tokenizer and sampling types, the state store, the buckets
    "router": {"router", "configs", "buckets", "state", "proto", "prefix_hash", "cluster_token", "compute_id",
               "engine.tokenizer", "engine.sampling_params", "engine.logprobs"},
    "state": {"state", "configs"},
    "buckets": set(),
    "prefix_hash": set(),  # the block-hash scheme the engine and the router share: standard library only
    "cluster_token": set(),  # the workers' gRPC secret, for the router, the workers and kvtransfer: grpc only
    "compute_id": set(),  # which workers share compute, for the router and the servicer: standard library only
}


def pdserve_imports(source: str, module: str) -> set[str]:
    """The pdserve modules ``source`` (the module ``module``, dotted) imports, relative ones resolved,
    without the ``pdserve.`` prefix; ``from pkg import name`` gives both ``pkg`` and ``pkg.name``."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[:-node.level]
                base = ".".join(parent + ([base] if base else []))
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return {name.removeprefix("pdserve.") for name in found if name.startswith("pdserve.")}


def under(name: str, packages: set[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def layering_offences() -> list[str]:
    offences = []
    for path in sorted((ROOT / "pdserve").rglob("*.py")):
        rel = path.relative_to(ROOT / "pdserve").with_suffix("")
        top = rel.parts[0]
        imports = pdserve_imports(path.read_text(), "pdserve." + ".".join(rel.parts))
        if top in NEVER:
            offences += [f"{path.relative_to(ROOT)} imports pdserve.{name}" for name in sorted(imports)
                         if under(name, NEVER[top])]
        if top in ONLY:
            offences += [f"{path.relative_to(ROOT)} imports pdserve.{name}" for name in sorted(imports)
                         if not under(name, ONLY[top])
                         and not any(p.startswith(name + ".") for p in ONLY[top])]  # pdserve.engine itself
    return offences


def test_the_packages_depend_downward_only():
    """decode_worker and prefill_worker never import each other (nor the router or the control plane);
    worker/ imports neither role; the router imports no worker, engine internals or cluster module;
    state/ and buckets import nothing above them."""
    assert not layering_offences()


def test_the_layering_scan_sees_lazy_relative_and_from_imports():
    source = ("import pdserve.router.app\n"
              "from . import convert\n"
              "from ..cluster.config import X\n"
              "def f():\n    from pdserve.decode_worker import server\n")
    assert pdserve_imports(source, "pdserve.worker.server") == {
        "router.app", "worker", "worker.convert", "cluster.config", "cluster.config.X", "decode_worker",
        "decode_worker.server"}
