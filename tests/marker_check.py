"""A marker test of a family's pixel geometry (saliency maps in image coordinates): a white square
on a gray image changes some model pixels; moved back onto the image by the views' frames
(`mmjax.image.geometry`), that change must land on the square."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image


def marker_views(policy_views, frames, width: int, height: int, box: tuple[int, int, int, int]):
    """A white square (box: left, top, right, bottom) on a gray image: each view's change
    (|marked - plain| summed over channels, [views, H, W]) moved onto the image by its own frame
    -> [(frame, image map [height, width], the view's total change)]."""
    from mmjax.image.geometry import to_image

    plain = Image.new("RGB", (width, height), (128, 128, 128))
    marked = plain.copy()
    marked.paste((255, 255, 255), box)
    diff = np.abs(np.asarray(policy_views(marked), np.float64) - np.asarray(policy_views(plain), np.float64)).sum(-1)
    assert len(diff) == len(frames)
    return [(f, to_image(d[None], [((0,), f)], height, width), float(d.sum())) for f, d in zip(frames, diff)]


def check_marker(frame, image_map, total, box, where) -> None:
    """The view's change lands on the marker: >= 95% within the resampling kernels' reach (three
    view pixels, in image pixels, plus two); where the view shows the whole marker, the change's
    centroid on the marker's center within half a view pixel plus one image pixel; the total
    kept (no view pixel that changed shows padding)."""
    left, top, right, bottom = box
    assert image_map.sum() == pytest.approx(total, rel=1e-4), where
    sy, sx = frame.scale
    reach = 3 * max(sy, sx) + 2
    ys, xs = np.mgrid[:image_map.shape[0], :image_map.shape[1]] + 0.5
    near = (ys > top - reach) & (ys < bottom + reach) & (xs > left - reach) & (xs < right + reach)
    assert image_map[near].sum() >= 0.95 * image_map.sum(), where
    t, l, b, r = frame.source_box()
    if t <= top and l <= left and b >= bottom and r >= right:
        cy, cx = (image_map * ys).sum() / image_map.sum(), (image_map * xs).sum() / image_map.sum()
        assert abs(cy - (top + bottom) / 2) <= sy / 2 + 1 and abs(cx - (left + right) / 2) <= sx / 2 + 1, \
            (where, cy, cx)


def assert_family_views_find_markers(vlm, options=({},), cases=((600, 200, (420, 60, 470, 110)),
                                                                  (90, 230, (30, 150, 60, 175)))) -> int:
    """For each image-options dict and (width, height, marker box): the family's `pixel_views`
    of a prepared image put each view's change back on the marker (`check_marker`). Returns the
    number of views checked (views that show the marker)."""
    fam, checked = vlm.family, 0
    for opts in options:
        for w, h, box in cases:
            item = vlm.prepare_images([Image.new("RGB", (w, h))], opts)[0]
            views = fam.pixel_views(item, h, w)
            index = [i for i, _ in views]

            def pixels(img):
                x = np.asarray(fam.image_pixels(vlm.prepare_images([img], opts)[0]))
                return np.stack([x[i] for i in index])
            for k, (frame, image_map, total) in enumerate(marker_views(pixels, [f for _, f in views], w, h, box)):
                if total > 0:
                    check_marker(frame, image_map, total, box, (fam.name, opts, w, h, k))
                    checked += 1
    return checked
