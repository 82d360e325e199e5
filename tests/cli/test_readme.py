"""The README and docs point only at files that ship with the project (images, docs, scripts)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
# [text](target) and ![alt](target); the target ends at whitespace or ")" (an optional "title" may follow)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def local_targets(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # code blocks are not links
    out = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # a URL (https:, mailto:) or an anchor on the same page
        out.append(target.split("#", 1)[0])
    return out


def test_the_readme_shows_its_two_figures() -> None:
    targets = local_targets(REPO / "README.md")
    assert "docs/img/dualpipev_r4_m10.png" in targets and "docs/img/report.png" in targets


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_local_link_and_image_exists_and_is_not_ignored(page: Path) -> None:
    for target in local_targets(page):
        path = (page.parent / target).resolve()
        assert path.exists(), f"{page.relative_to(REPO)} links {target}, which is not in the project"
        assert REPO in path.parents or path == REPO, f"{page.relative_to(REPO)} links {target} outside the project"
        if shutil.which("git") and (REPO / ".git").exists():
            ignored = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", str(path)], check=False)
            assert ignored.returncode == 1, f"{target} (linked from {page.name}) is matched by .gitignore"
