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
