"""The manual and the lab notebook stay apart.

docs/ is the manual: what is true now. Benchmark results (JSON), the dated run log and the
cache's calibration record live under benchmarks/. These checks keep it so: no results or
run log back in docs/, the cache page short enough to be a manual page, the README's
diagram on its first screen, and every relative link of the manual and the notebook
pointing at a file (and a heading) that exists. The last test builds a regressed layout
and checks that each check reports it.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[3]

CACHE_PAGE_MAX_BYTES = 20_000
DIAGRAM_MAX_LINE = 40

_FENCE = re.compile(r"^\s{0,3}(```+|~~~+)(.*)$")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE_CODE = re.compile(r"(`+)((?:(?!\n[ \t]*\n).)+?)\1", re.DOTALL)
# [text](target) and ![alt](target); the text may hold one level of brackets and wrap onto
# the next line (not past a blank one).
_LINK = re.compile(
    r"!?\[(?:(?!\n[ \t]*\n)[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)"
)
_REF_DEF = re.compile(r"^[ ]{0,3}\[[^\]\n]+\]:[ \t]*<?(\S+?)>?(?:[ \t]+\"[^\"\n]*\")?[ \t]*$", re.M)
_BOX_DRAWING = re.compile(r"[\u2500-\u257f\u25b6\u25b2\u25bc\u25c0]")
_RUN_LOG_NAME = re.compile(r"(^|[-_.])(run-?)?log\.md$", re.IGNORECASE)


def _prose(text: str) -> str:
    """The text with fenced code blocks blanked (line numbers kept) and inline code removed
    (a code span may wrap onto the next line, never past a blank line)."""
    out: list[str] = []
    fence: str | None = None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * 3
            out.append("")
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            out.append("")
            continue
        out.append(line)
    return _INLINE_CODE.sub(lambda m: "\n" * m.group(0).count("\n"), "\n".join(out))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation but '-' dropped,
    spaces turned into '-' (links and emphasis count by their text)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts by its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fence: str | None = None
    for line in path.read_text(encoding="utf-8").splitlines():
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * 3
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            continue
        h = _HEADING.match(line)
        if not h:
            continue
        base = slug(h.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def linked_pages(root: Path) -> list[Path]:
    """The manual and the notebook: docs/*.md, README.md and benchmarks/*.md."""
    pages = sorted((root / "docs").glob("*.md")) + sorted((root / "benchmarks").glob("*.md"))
    readme = root / "README.md"
    return ([readme] if readme.exists() else []) + pages


def broken_links(root: Path) -> list[str]:
    """Relative links whose file, or whose #anchor in a markdown file, does not exist."""
    problems: list[str] = []
    cache: dict[Path, set[str]] = {}
    for page in linked_pages(root):
        prose = _prose(page.read_text(encoding="utf-8"))
        found = [(m.start(), m.group(1)) for m in _LINK.finditer(prose)]
        found += [(m.start(), m.group(1)) for m in _REF_DEF.finditer(prose)]
        for start, target in sorted(found):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, mailto:, ...
                continue
            file_part, _, anchor = target.partition("#")
            where = f"{page.relative_to(root)}:{prose.count(chr(10), 0, start) + 1}: {target}"
            dest = (page.parent / unquote(file_part)).resolve() if file_part else page
            if not dest.is_file():
                problems.append(f"{where} (no such file)")
                continue
            if anchor and dest.suffix == ".md":
                if dest not in cache:
                    cache[dest] = anchors(dest)
                if unquote(anchor).lower() not in cache[dest]:
                    problems.append(f"{where} (no such heading)")
    return problems


def notebook_files_in_docs(root: Path) -> list[str]:
    """Benchmark results (JSON) and run logs found under docs/."""
    docs = root / "docs"
    found = [p for p in docs.rglob("*") if p.is_file() and p.suffix.lower() == ".json"]
    found += [p for p in docs.rglob("*.md") if _RUN_LOG_NAME.search(p.name)]
    return sorted(str(p.relative_to(root)) for p in found)


def readme_diagram_line(root: Path) -> int | None:
    """Line of the fence that opens the README's diagram: the first fenced block drawn with
    box-drawing characters, or a mermaid block; None when there is none."""
    lines = (root / "README.md").read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group(1)[0] * 3, m.group(2).strip().lower()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        body = "\n".join(lines[i + 1 : end])
        if info == "mermaid" or _BOX_DRAWING.search(body):
            return i + 1
        i = end + 1
    return None


def test_docs_hold_no_results_and_no_run_log() -> None:
    found = notebook_files_in_docs(ROOT)
    assert not found, f"benchmark results or run logs in docs/ (move them to benchmarks/): {found}"
    assert (ROOT / "benchmarks" / "log.md").is_file()
    assert list((ROOT / "benchmarks" / "results").glob("*.json"))


def test_the_cache_page_is_a_manual_page() -> None:
    size = (ROOT / "docs" / "cache.md").stat().st_size
    assert size <= CACHE_PAGE_MAX_BYTES, (
        f"docs/cache.md is {size} bytes (at most {CACHE_PAGE_MAX_BYTES}): measurements and "
        "dated notes go to benchmarks/cache-calibration.md"
    )


def test_the_readme_diagram_is_on_the_first_screen() -> None:
    line = readme_diagram_line(ROOT)
    assert line is not None, "README.md has no diagram (a box-drawing or mermaid block)"
    assert line <= DIAGRAM_MAX_LINE, f"README.md's diagram starts at line {line}"


def test_every_relative_link_resolves() -> None:
    problems = broken_links(ROOT)
    assert not problems, "\n".join(problems)


def test_slugs_follow_github() -> None:
    assert slug(
        "Results (`splitvl bench --json --out /tmp/bf32`, 2026-11-30 16:14 UTC, 1,223 s)"
    ) == ("results-splitvl-bench---json---out-tmpbf32-2026-11-30-1614-utc-1223-s")
    assert slug("The `wide` scenario: `ttft_delta_ms_wide_conc1`") == (
        "the-wide-scenario-ttft_delta_ms_wide_conc1"
    )
    assert slug("The front's CPU and the [hit path](x.md)") == "the-fronts-cpu-and-the-hit-path"


def test_each_check_catches_a_regressed_layout(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    (docs / "img").mkdir(parents=True)
    (tmp_path / "benchmarks").mkdir()
    (docs / "bench-quick.json").write_text("{}")
    (docs / "img" / "run.json").write_text("{}")
    (docs / "benchmarks-log.md").write_text("# Log\n")
    (docs / "cache.md").write_text("x" * (CACHE_PAGE_MAX_BYTES + 1))
    (docs / "page.md").write_text(
        "# Page\n\n## A section\n\n"
        "[ok](#a-section) [ok](page.md#page) [gone](missing.md) [bad anchor](page.md#nope)\n"
        "[json](bench-quick.json) [up](../benchmarks/log.md)\n"
        "`[in code](missing-too.md)`\n\n```\n[in a fence](missing-three.md)\n```\n"
        "A link [that\nwraps](missing-four.md).\n"
    )
    (tmp_path / "benchmarks" / "notes.md").write_text("[back](../docs/page.md#a-section-1)\n")
    filler = "".join(f"line {i}\n" for i in range(45))
    (tmp_path / "README.md").write_text(
        f"# x\n{filler}```\nclient ──gRPC──▶ gateway\n```\n[r](docs/page.md#a-section)\n"
    )

    assert notebook_files_in_docs(tmp_path) == [
        "docs/bench-quick.json",
        "docs/benchmarks-log.md",
        "docs/img/run.json",
    ]
    assert (docs / "cache.md").stat().st_size > CACHE_PAGE_MAX_BYTES
    assert readme_diagram_line(tmp_path) == 47
    problems = broken_links(tmp_path)
    assert [p.split(" (")[0] for p in problems] == [
        "docs/page.md:5: missing.md",
        "docs/page.md:5: page.md#nope",
        "docs/page.md:6: ../benchmarks/log.md",
        "docs/page.md:12: missing-four.md",
        "benchmarks/notes.md:1: ../docs/page.md#a-section-1",
    ]
    # A repeated heading gets the next anchor.
    (docs / "page.md").write_text("# Page\n\n## A section\n\n## A section\n")
    assert broken_links(tmp_path) == []
    # A README without a diagram has none.
    (tmp_path / "README.md").write_text("# x\n\n```bash\nmake demo\n```\n")
    assert readme_diagram_line(tmp_path) is None
