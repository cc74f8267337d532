"""The grid-change bound (vlcommon.grid_reuse): which stored grids a similarity hit may
serve for an image, at Qwen3-VL's budget and at the tiny checkpoint's."""

from __future__ import annotations

from splitvl_tools.cache_eval import default_spec
from vlcommon.grid_reuse import reusable_grids
from vlcommon.imaging import plan_resize

QWEN = default_spec(65536, 16777216)
TINY = default_spec()


def grids(h: int, w: int, spec=QWEN, bound: float = 0.10) -> list[tuple[int, int, int]]:
    return reusable_grids(
        h, w, spec, min_pixels=spec.min_pixels, max_pixels=spec.max_pixels, bound=bound
    )


def test_own_grid_first_and_resizes_within_ten_percent_only() -> None:
    g = grids(512, 512)
    assert g[0] == (1, 32, 32)
    # 0.90x..1.10x of 512 plans to 448..576 px: grids 28..36 (even, square).
    assert sorted(g) == [(1, n, n) for n in (28, 30, 32, 34, 36)]
    # A 4% smaller copy (492 -> 480 px) may be served the 512's grid; half size may not.
    assert (1, 32, 32) in grids(492, 492)
    assert (1, 32, 32) not in grids(256, 256)
    # Another aspect ratio is another class.
    assert all(h == w for _, h, w in g)
    assert (1, 32, 32) not in grids(512, 600)


def test_every_grid_is_a_plan_of_a_resized_copy_and_bound_zero_is_equal_only() -> None:
    for h, w in ((300, 451), (3024, 4032), (1200, 1600)):
        own = plan_resize(h, w, QWEN, index=0).grid
        assert grids(h, w, bound=0) == [own]
        pixels = own[1] * own[2]
        for _, gh, gw in grids(h, w):
            # Within -19%..+21% of the pixels (10% per side, plus 32 px rounding).
            assert 0.70 * pixels <= gh * gw <= 1.35 * pixels, (h, w, gh, gw)


def test_tiny_budget_keeps_one_grid_for_large_images() -> None:
    # The budget binds: scaling the image is scaling the budget, the plan stays put.
    assert grids(3024, 4032, TINY) == [plan_resize(3024, 4032, TINY, index=0).grid]


def test_images_at_the_aspect_ratio_limit_skip_scales_without_a_plan() -> None:
    # 5x1000 is ratio 200 (allowed); 0.9x rounds to 4x900, ratio 225, which has no plan.
    g = grids(5, 1000)
    assert g[0] == plan_resize(5, 1000, QWEN, index=0).grid
