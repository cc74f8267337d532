"""tests/suite.toml lists every test file with its measured seconds (tests/suite_times.py)."""

from __future__ import annotations

from tests.suite_times import ROOT, SUITE, read_suite, render_suite


def test_every_test_file_is_listed_with_its_seconds() -> None:
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")}
    listed = read_suite()
    assert sorted(files - set(listed)) == [], "add them: python -m tests.suite_times --write"
    assert sorted(set(listed) - files) == [], "listed but gone"
    assert all(float(t["seconds"]) >= 0 and t["kind"] in ("e2e", "unit") for t in listed.values())


def test_the_suite_file_is_what_the_writer_renders() -> None:
    listed = read_suite()
    times = {p: {"seconds": t["seconds"], "e2e": t["kind"] == "e2e"} for p, t in listed.items()}
    assert render_suite(times) == SUITE.read_text()


#: tests/unit/<package>/: the unit tests of one package (tools: splitvl_tools and scripts;
#: deploy: deploy/; project: the repository-wide checks).
UNIT_PACKAGES = {
    "gateway",
    "cache_service",
    "encoder_service",
    "decoder_service",
    "vlcommon",
    "splitvl",
    "tools",
    "deploy",
    "project",
}


def test_a_file_lives_where_its_kind_says() -> None:
    """A file with a test that starts services (kind e2e in the last full run) lives under
    tests/e2e/, every other one under tests/unit/<package>/ (docs/install.md, "The tests")."""
    misplaced = []
    for path, t in read_suite().items():
        parts = path.split("/")
        if t["kind"] == "e2e":
            ok = parts[1] == "e2e"
        else:
            ok = len(parts) == 4 and parts[1] == "unit" and parts[2] in UNIT_PACKAGES
        if not ok:
            misplaced.append(f"{path} ({t['kind']})")
    assert misplaced == []
    assert {p.name for p in (ROOT / "tests" / "unit").iterdir() if p.is_dir()} - {
        "__pycache__"
    } == UNIT_PACKAGES
