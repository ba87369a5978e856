"""The tiling check: a tensor's boxes cover it exactly, with no gap and no overlap."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from ckpt._format.bounds import MAX_TILING_CORNERS, check


def check_tiling(key: str, shape: tuple[int, ...], items: list[Any]) -> None:
    """The boxes (chunks, or (offsets, shape) pairs) cover the tensor exactly: every element
    lies in exactly one. Raises Invalid naming ``key``.

    Linear in the number of chunks: the sum of the boxes' indicator functions equals the
    tensor's indicator iff their mixed finite differences are equal, and the difference of a
    box's indicator is +-1 at its 2^d corners (sign: -1 per upper bound) and 0 elsewhere. So
    the chunks tile the tensor iff their corner weights, summed per point, cancel everywhere
    except at the tensor's own corners. Dimensions no chunk splits are left out (each chunk
    spans them whole), which keeps d at the one to three dimensions real layouts split.
    """
    all_boxes = [c if isinstance(c, tuple) else (c.offsets, c.shape) for c in items]
    if len(all_boxes) == 1 and all_boxes[0][1] == shape and not any(all_boxes[0][0]):
        return  # one box that is the whole tensor (most tensors): it tiles it exactly
    total = math.prod(shape)
    covered = sum(math.prod(b) for _, b in all_boxes)
    check(covered == total, f"the chunks of {key!r} cover {covered} of {total} elements"
          + (" (some overlap)" if covered > total else " (a gap)"))
    boxes = [(o, b) for o, b in all_boxes if math.prod(b)]
    split = [d for d, size in enumerate(shape)
             if any(o[d] != 0 or b[d] != size for o, b in boxes)]
    check(len(boxes) << len(split) <= MAX_TILING_CORNERS,
          f"the chunks of {key!r} split {len(split)} dimensions into {len(boxes)} boxes, "
          "more than ckpt ever writes")
    weights: Counter = Counter()
    for offsets, box in boxes:
        corners = [((), 1)]
        for d in split:
            lo, hi = offsets[d], offsets[d] + box[d]
            corners = [(p + (lo,), w) for p, w in corners] + [(p + (hi,), -w) for p, w in corners]
        for point, w in corners:
            weights[point] += w
    expected = {}
    if boxes:
        corners = [((), 1)]
        for d in split:
            corners = [(p + (0,), w) for p, w in corners] + [(p + (shape[d],), -w)
                                                            for p, w in corners]
        expected = dict(corners)
    wrong = next((p for p, w in weights.items() if w != expected.get(p, 0)), None)
    check(wrong is None, f"chunks of {key!r} overlap near {_at(wrong, split, shape)} (and "
          "leave a gap elsewhere)")


def _at(point: tuple[int, ...] | None, split: list[int], shape: tuple[int, ...]) -> list[int]:
    full = [0] * len(shape)
    for d, v in zip(split, point or ()):
        full[d] = v
    return full
