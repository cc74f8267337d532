"""``splitvl cache-eval`` on the reduced set (9 photos incl. the stereo pair, 6 text pairs
in 4 layouts, 17 adversarial pairs: receipts, charts, screenshots, photographed pages and
invoices one character apart, spreadsheets one cell apart, random pixels, the poisoning
construction): at the cache's default threshold no distinct pair hits (descriptor, a
servable grid and the verification, as the cache decides) and >= 95% of the near
duplicates other than crops do (a crop loses border content the verification cannot
check: a miss, never a wrong hit), at the tiny budget and at Qwen3-VL's, where most resizes
change the grid. The full set is in benchmarks/cache-calibration.md."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from PIL import Image

from cache_service.settings import CacheSettings
from splitvl.cli import build_parser
from splitvl_tools import cache_eval
from vlcommon.verification import VERIFY_TOLERANCE


def _run(*argv: str) -> dict:
    args = build_parser().parse_args(["cache-eval", "--quick", "--json", *argv])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert args.func(args) == 0
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def report() -> dict:
    """What ``splitvl cache-eval --quick --json`` prints (about 30-80 s here)."""
    return _run()


@pytest.fixture(scope="module")
def qwen_report() -> dict:
    """The same at Qwen3-VL's own pixel budget."""
    return _run("--min-pixels", "65536", "--max-pixels", "16777216")


def _check_targets(report: dict) -> None:
    assert report["threshold"] == CacheSettings().threshold == 0.85
    # 9 photos -> 36 pairs; 6 text pairs x 4 layouts x (PNG, JPEG of the other) -> 48;
    # 18 adversarial pairs x (PNG, Pillow's and ffmpeg's JPEG of the other) -> 54.
    assert len(cache_eval.adversarial_pairs(quick=True)) == 18
    assert report["distinct_pairs"] == 36 + 48 + 54
    variants = cache_eval.near_duplicate_variants(Image.new("RGB", (64, 48)), "PNG")
    assert report["near_duplicate_pairs"] == 9 * len(variants)
    assert report["crop_pairs"] == 9 * sum("crop" in name for name, _ in variants)
    # No distinct pair hits, the small-text pages included.
    assert report["false_hits"] == 0 and report["false_hit_pairs"] == []
    kinds = report["by_distinct_kind"]
    for kind in (
        "page-photo-12px",
        "screen-dark-11px",
        "invoice-photo",
        "receipt-gradient",
        "spreadsheet-banded-one-cell",
        "watermark-one-digit",
    ):
        # The descriptor and the grid rule let them through; the verification refuses.
        assert kinds[f"adversarial-{kind}"]["over_threshold"] == 3, kind
        assert kinds[f"adversarial-{kind}"]["lowest_residual"] > report["verify_tolerance"]
    assert kinds["adversarial-random-pixels"]["false_hits"] == 0
    assert report["false_hits_descriptor_only"] >= 16
    # Recall: all kinds, without crops (the target), crops apart.
    assert report["near_duplicate_recall"] <= report["descriptor_recall"]
    assert report["recall_without_crops"] >= 0.95
    n, c = report["near_duplicate_pairs"], report["crop_pairs"]
    assert report["near_duplicate_recall"] == pytest.approx(
        (report["recall_without_crops"] * (n - c) + report["crop_recall"] * c) / n
    )
    groups = report["by_transform"]
    for name in ("jpeg", "brightness", "contrast", "resize-0.95", "resize-1.05"):
        assert groups[name]["hit_recall"] == 1.0, name


def test_default_threshold_has_no_false_hits_and_high_recall(report: dict) -> None:
    _check_targets(report)
    # At the tiny budget almost every copy keeps its grid.
    assert report["grid_changed_hits"] <= 2


def test_coefficient_cost_times_a_passing_copy_and_a_refused_edit(report: dict) -> None:
    # The two rows benchmarks/cache-calibration.md quotes: one pass (an ffmpeg JPEG of the
    # picture passes at once) and the full first-generation search (an edited picture's JPEG is
    # refused); were either score on the other side of the tolerance, the row would time
    # another path than it names.
    costs = report["coefficient_cost_by_size"]
    assert sorted(costs) == ["1024x1024", "1448x1448", "448x448"]
    for row in costs.values():
        assert row["copy_score"] <= VERIFY_TOLERANCE < row["edit_score"]
        assert row["one_pass_ms"] > 0 and row["search_ms"] > 0


def test_qwen3_vl_budget_serves_resizes_with_the_stored_grid(qwen_report: dict) -> None:
    """At Qwen3-VL's budget images keep their native size, so a 5% resize changes the
    grid: those copies are served with the stored grid (the grid-change bound)."""
    _check_targets(qwen_report)
    assert qwen_report["pixel_budget"] == [65536, 16777216]
    groups = qwen_report["by_transform"]
    assert groups["resize-0.95"]["grid_changed_hits"] == groups["resize-0.95"]["pairs"]
    assert qwen_report["grid_changed_hits"] >= 30
    assert qwen_report["near_duplicates_same_grid"] < qwen_report["near_duplicate_pairs"] * 0.8


def test_table_is_monotone_over_thresholds(report: dict) -> None:
    table = report["table"]
    assert [r["threshold"] for r in table] == [round(0.80 + 0.01 * i, 2) for i in range(20)]
    default = next(r for r in table if r["threshold"] == report["threshold"])
    assert default["false_hits"] == report["false_hits"]
    assert default["near_duplicate_recall"] == report["near_duplicate_recall"]
    assert default["recall_without_crops"] == report["recall_without_crops"]
    assert default["descriptor_recall"] == report["descriptor_recall"]
    recalls = [r["near_duplicate_recall"] for r in table]
    false_hits = [r["false_hits"] for r in table]
    assert recalls == sorted(recalls, reverse=True)
    assert false_hits == sorted(false_hits, reverse=True)
    assert all(r["precision"] == 1.0 for r in table if r["false_hits"] == 0)


def test_stereo_pair_and_text_edits_are_distinct_and_documents_exact_only(report: dict) -> None:
    highest = dict(report["highest_distinct_photos"])
    stereo = highest.get("motorcycle_left.png ~ motorcycle_right.png")
    # The same scene from two viewpoints is the most similar distinct pair, still a miss.
    assert stereo is not None and stereo < report["threshold"]
    # Every rendered text image (one digit or one word apart) gets no descriptor; no
    # photo does.
    docs = report["document_like"]
    assert docs["text_images"] == docs["text_images_total"] == 6 * 4 * 3
    assert docs["photos"] == []
    # The lowest near duplicates are real (positive) correlations, not zero descriptors.
    assert all(score > 0 for _, score in report["lowest_near_duplicates"])


def test_text_pairs_differ_in_one_digit_or_one_word() -> None:
    for a, b in cache_eval.TEXT_PAIRS:
        wa, wb = a.split(), b.split()
        if len(wa) == len(wb):
            changed = [(x, y) for x, y in zip(wa, wb, strict=True) if x != y]
            assert len(changed) == 1, (a, b)
        else:  # one word inserted or dropped
            assert abs(len(wa) - len(wb)) == 1, (a, b)


def test_one_character_pairs_differ_in_one_character() -> None:
    for a, b in (*cache_eval.ONE_CHARACTER, *cache_eval.INVOICE_TOTALS):
        assert len(a) == len(b) and sum(x != y for x, y in zip(a, b, strict=True)) == 1, (a, b)
    for _, a, b in cache_eval.SPREADSHEET_EDITS:
        assert len(a) == len(b) and sum(x != y for x, y in zip(a, b, strict=True)) == 1, (a, b)
