"""The documentation points only at what a clone holds: every relative link (or path in a code span)
of a tracked Markdown file resolves to a file or folder inside the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
PATH_SPAN = re.compile(r"`(\.\.?/[^`\s]+)`")  # `../somewhere/file.md`, `./x`


def markdown_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / p for p in out.stdout.split()]


def targets(text: str) -> list[str]:
    found = LINK.findall(text) + PATH_SPAN.findall(text)
    return [t.split("#")[0] for t in found if not re.match(r"[a-z]+:|#", t)]


def test_relative_links_stay_inside_the_repository():
    bad = []
    for md in markdown_files():
        for target in targets(md.read_text()):
            if not target:
                continue
            path = (md.parent / target).resolve()
            if not path.is_relative_to(ROOT) or not path.exists():
                bad.append(f"{md.relative_to(ROOT)}: {target}")
    assert not bad, bad


def test_the_checker_sees_a_link_out_of_the_repository():
    assert targets("see [design](../shared/DESIGN.md#x) and `../shared/DEPENDENCIES.md`, not "
                   "[web](https://x.org) or [here](#anchor)") == ["../shared/DESIGN.md", "../shared/DEPENDENCIES.md"]
