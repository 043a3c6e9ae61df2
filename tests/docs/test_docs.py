"""Issue 34: the docs site builds with ``mkdocs build --strict`` (broken links and anchors, pages missing from the
nav fail it), README.md stays a short front page, and every relative link in README.md and docs/ points at a file
that exists."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README_MAX_LINES = 150
# [text](target) and ![alt](target), target up to a space or ")"; reference-style links are not used here.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def relative_links(md: Path) -> list[str]:
    """The link targets in ``md`` that are not URLs, mail or in-page anchors; code is not searched."""
    text = CODE_SPAN.sub("", FENCE.sub("", md.read_text()))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)]


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def test_mkdocs_build_strict_passes(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for page in ("index.html", "quickstart/index.html", "reference/http-api/index.html",
                 "operations/sizing/index.html", "benchmarks/index.html", "architecture/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    assert (tmp_path / "site/img/goodput.png").is_file()


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; keep it to {README_MAX_LINES}"
    text = "\n".join(lines)
    assert "make serve" in text and "make test" in text and "docs/" in text


def test_every_relative_link_points_to_a_file() -> None:
    broken = []
    for md in markdown_files():
        for target in relative_links(md):
            path = target.split("#", 1)[0]
            if path and not (md.parent / path).resolve().exists():
                broken.append(f"{md.relative_to(ROOT)}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_the_link_finder_skips_code_urls_and_anchors(tmp_path: Path) -> None:
    md = tmp_path / "x.md"
    md.write_text("[a](b.md#c) ![i](img/p.png) [u](https://x.org) [h](#top) `[n](no.md)`\n"
                  "```\n[n](fenced.md)\n```\n")
    assert relative_links(md) == ["b.md#c", "img/p.png"]
