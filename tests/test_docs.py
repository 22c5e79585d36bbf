"""The documentation holds: the README stays short and its commands run, its links lead somewhere,
docs/configuration.md is what the schema generates, and the MkDocs site builds with --strict (a
broken link, a missing anchor or page, or a README section the home page includes that has gone,
fails). Seconds, no training."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from asyncvla.common.config import describe
from tests.support.paths import REPO

README = REPO / "README.md"
CONFIG_PAGE = REPO / "docs" / "configuration.md"
REGENERATE = "asyncvla config --describe --markdown > docs/configuration.md"
README_MAX_LINES = 150
GUIDE_MAX_LINES = {"pipeline.md": 300}        # guides; the runs' history is docs/history.md
BIN = Path(sys.executable).parent          # the venv's bin: asyncvla, mkdocs


def _env() -> dict:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "NO_MKDOCS_2_WARNING": "1"}


def _shell_lines(markdown: str) -> list[str]:
    """The lines of the fenced bash/sh/shell blocks, backslash continuations joined."""
    lines, block = [], None
    for line in markdown.splitlines():
        fence = re.match(r"\s*```(\w*)", line)
        if fence and block is None:
            block = fence.group(1) in ("bash", "sh", "shell", "console")
            continue
        if fence:
            block = None
            continue
        if block:
            if lines and lines[-1].endswith("\\"):
                lines[-1] = lines[-1][:-1] + " " + line.strip()
            else:
                lines.append(line.strip())
    return lines


def _safe_commands(markdown: str) -> list[list[str]]:
    """The README's commands that start nothing: `asyncvla ... --help` and `asyncvla config ...`."""
    out = []
    for line in _shell_lines(markdown):
        words = shlex.split(line, comments=True)
        if not words or words[0] != "asyncvla":
            continue
        if "--help" in words or (len(words) > 1 and words[1] == "config" and "train" not in words):
            out.append(words)
    return out


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, (f"README.md has {n} lines, at most {README_MAX_LINES}: move detail to a "
                                   "page under docs/ and link to it")


def test_guides_stay_short():
    for name, limit in GUIDE_MAX_LINES.items():
        n = len((REPO / "docs" / name).read_text().splitlines())
        assert n <= limit, f"docs/{name} has {n} lines, at most {limit}: move run reports to docs/history.md"


def test_readme_results_quote_the_run_history():
    """The README's Results table is copied from the run reports, never made up: each figure with its
    interval ("95.1 % [92.4, 97.9]") appears in docs/history.md, where every run behind it is."""
    text = README.read_text()
    section = text.split("## Results", 1)[1].split("\n## ", 1)[0]
    figures = re.findall(r"\d+(?:\.\d+)? % \[\d+(?:\.\d+)?, \d+(?:\.\d+)?\]", section)
    history = (REPO / "docs" / "history.md").read_text()
    assert len(figures) >= 4, f"the README's Results table should give figures with intervals; found {figures}"
    for figure in figures:
        assert figure in history, f"README figure {figure!r} is not in docs/history.md"


def test_readme_commands_run():
    commands = _safe_commands(README.read_text())
    assert any("--help" in c for c in commands) and any(c[1:2] == ["config"] for c in commands), \
        f"the README should show `asyncvla --help` and `asyncvla config ...`; found {commands}"
    for words in commands:
        proc = subprocess.run(words, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"README command `{shlex.join(words)}` exited {proc.returncode}:\n{proc.stderr}"


def test_configuration_page_is_generated_from_the_schema():
    expected = describe(markdown=True)
    assert CONFIG_PAGE.read_text() == expected, \
        f"docs/configuration.md differs from the schema (common/config/); regenerate it: {REGENERATE}"
    proc = subprocess.run(["asyncvla", "config", "--describe", "--markdown"], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == expected, proc.stderr


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
                           "-d", str(out)], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def test_docs_site_builds_strict(site):
    assert (site / "index.html").is_file() and (site / "configuration" / "index.html").is_file()


def _slug(heading: str) -> str:
    """GitHub's and MkDocs' anchor of a heading (for the headings used here)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return re.sub(r"\s+", "-", text)


def test_readme_links_lead_somewhere(site):
    text = README.read_text()
    own_anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        if not path:
            assert anchor in own_anchors, f"README link {target}: no such heading in README.md"
            continue
        assert (REPO / path).exists(), f"README link {target}: {path} does not exist"
        if anchor:
            assert path.startswith("docs/") and path.endswith(".md"), target
            page = site / Path(path).relative_to("docs").with_suffix("") / "index.html"
            assert f'id="{anchor}"' in page.read_text(), f"README link {target}: no such anchor in {path}"
