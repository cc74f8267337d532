"""Which stored grids a similarity hit may serve for an image: the grid-change bound.

A similarity hit may answer with the stored entry's embeddings and grid when that grid is
not the request's own (docs/cache.md): the request is then answered as if it had sent the
stored image. That is allowed only within one *aspect class*: the stored plan must be a
plan that the request's image itself would get, under the same pixel budget, had it been
sent resized by at most :data:`DEFAULT_GRID_REUSE_SCALE` per side (10%: a pixel count
within about -19%/+21%). When the budget binds (the image is larger than ``max_pixels``)
that is the same as the plan of the image under a budget scaled by 1/s^2, i.e. a pixel
budget that differs by that much; when the image keeps its native size it is the plan of
a copy 10% smaller or larger. A half-size copy, a crop to another aspect ratio or a
rotated image is never in the class.
"""

from __future__ import annotations

from vlcommon.errors import ServiceError
from vlcommon.imaging import plan_resize
from vlcommon.model_info import VisionSpec

DEFAULT_GRID_REUSE_SCALE = 0.10
# Scales tried in [1 - bound, 1 + bound]: grids change in steps of spec.factor (32 px) per
# side, so a step of 1/400 of the size (0.25%) finds every plan in the range for images up
# to 12,800 px on a side.
_STEPS = 80


def reusable_grids(
    height: int,
    width: int,
    spec: VisionSpec,
    *,
    min_pixels: int,
    max_pixels: int,
    bound: float = DEFAULT_GRID_REUSE_SCALE,
) -> list[tuple[int, int, int]]:
    """The grids (t, h, w) a similarity hit may serve for a decoded ``height x width``
    image planned under ``[min_pixels, max_pixels]``, its own grid first.

    Args:
        bound: Largest relative resize per side (0.10 = 10%); 0 gives only the image's own
            grid (no grid change).

    Returns:
        Distinct grids: ``plan_resize`` of ``round(height * s) x round(width * s)`` for
        ``s`` in ``[1 - bound, 1 + bound]`` (scales whose rounded size has no plan, past
        the aspect-ratio limit, are skipped), the image's own plan first.

    Raises:
        ServiceError: as ``plan_resize`` for the image's own size (which the gateway has
            already planned, so it does not happen there).
    """
    own = plan_resize(height, width, spec, index=0, min_pixels=min_pixels, max_pixels=max_pixels)
    grids = [own.grid]
    if bound <= 0:
        return grids
    for i in range(_STEPS + 1):
        s = 1 - bound + 2 * bound * i / _STEPS
        h, w = max(1, round(height * s)), max(1, round(width * s))
        try:
            plan = plan_resize(h, w, spec, index=0, min_pixels=min_pixels, max_pixels=max_pixels)
        except ServiceError:
            # Rounding a 5x1000 image (ratio 200, the limit) to 4x900 exceeds the ratio
            # limit: that scale has no plan, so it adds no grid (the request is still fine).
            continue
        if plan.grid not in grids:
            grids.append(plan.grid)
    return grids
