"""Regenerate the Python stubs from the .proto sources: ``python -m pdserve.proto.generate``.

Run from anywhere; the stubs land next to their sources and import each other as
``pdserve.proto.v1...`` (the ``-I`` root is the repository root), so they cannot clash with
other packages' generated code. ``--check`` fails if the committed stubs differ (but for the
generator's version line: ``same_stub``).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(Path(__file__).parent.glob("v*/*.proto"))


def generate(out: Path) -> list[Path]:
    rel = [str(p.relative_to(ROOT)) for p in SOURCES]
    cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT}", f"--python_out={out}", f"--pyi_out={out}",
           f"--grpc_python_out={out}", *rel]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return sorted(p for p in out.rglob("*_pb2*.py*"))


# The generator's own version, written into the gRPC stubs (grpcio refuses them at import below it). A
# newer grpcio-tools of the pinned series writes its own: not a difference of the .proto sources, so the
# check leaves it out, and the committed stubs keep the older, looser minimum.
_GENERATOR_VERSION = re.compile(rb"^GRPC_GENERATED_VERSION = .*$", re.M)


def same_stub(committed: bytes, fresh: bytes) -> bool:
    """Whether a committed stub is what its source generates, but for the generator's own version."""
    return _GENERATOR_VERSION.sub(b"", committed) == _GENERATOR_VERSION.sub(b"", fresh)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare with the committed stubs, write nothing")
    args = parser.parse_args()
    if not args.check:
        generate(ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [p.relative_to(tmp) for p in fresh if not same_stub((ROOT / p.relative_to(tmp)).read_bytes(),
                                                                     p.read_bytes())]
    if stale:
        print("stubs differ from their .proto sources: " + ", ".join(map(str, stale)), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
