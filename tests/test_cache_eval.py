"""``splitvl cache-eval`` on the reduced set (9 photos incl. the stereo pair, 6 text pairs
in 4 layouts): at the cache's default threshold no distinct pair hits and >= 95% of the
near duplicates do. The full set (25 photos, 12 text pairs) is in docs/cache.md."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from PIL import Image

from cache_service.settings import CacheSettings
from splitvl import cache_eval
from splitvl.cli import build_parser


@pytest.fixture(scope="module")
def report() -> dict:
    """What ``splitvl cache-eval --quick --json`` prints (about 20-40 s here)."""
    args = build_parser().parse_args(["cache-eval", "--quick", "--json"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert args.func(args) == 0
    return json.loads(out.getvalue())


def test_default_threshold_has_no_false_hits_and_high_recall(report: dict) -> None:
    assert report["threshold"] == CacheSettings().threshold == 0.85
    # 9 photos -> 36 pairs; 6 text pairs x 4 layouts x (PNG, JPEG of the other) -> 48.
    assert report["distinct_pairs"] == 36 + 48
    variants = cache_eval.near_duplicate_variants(Image.new("RGB", (64, 48)), "PNG")
    assert report["near_duplicate_pairs"] == 9 * len(variants)
    assert report["false_hits"] == 0
    assert report["near_duplicate_recall"] >= 0.95
    # The cache also needs equal grids: its recall can only be lower, and equals the
    # descriptor's recall over the pairs whose grids agree, times their share.
    assert report["hit_recall"] <= report["near_duplicate_recall"]
    share = report["near_duplicates_same_grid"] / report["near_duplicate_pairs"]
    assert report["hit_recall"] == pytest.approx(report["recall_same_grid"] * share)
    assert report["hit_recall"] >= 0.9


def test_table_is_monotone_over_thresholds(report: dict) -> None:
    table = report["table"]
    assert [r["threshold"] for r in table] == [round(0.80 + 0.01 * i, 2) for i in range(20)]
    default = next(r for r in table if r["threshold"] == report["threshold"])
    assert default["false_hits"] == report["false_hits"]
    assert default["descriptor_recall"] == report["near_duplicate_recall"]
    recalls = [r["descriptor_recall"] for r in table]
    false_hits = [r["false_hits"] for r in table]
    assert recalls == sorted(recalls, reverse=True)
    assert false_hits == sorted(false_hits, reverse=True)
    assert all(r["precision"] == 1.0 for r in table if r["false_hits"] == 0)


def test_stereo_pair_and_text_edits_are_distinct_and_documents_exact_only(report: dict) -> None:
    highest = dict(report["highest_distinct"])
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
