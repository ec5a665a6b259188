"""The batched augmentation ops against ultralytics' own transforms on the same parameters:
RandomPerspective (image within interpolation tolerance, boxes within 1 px, the same boxes
dropped), RandomHSV (OpenCV's HSV exactly, the way back within one level), RandomFlip; and the
parameter distributions against ultralytics' over many draws."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

pytest.importorskip("ultralytics")
cv2 = pytest.importorskip("cv2")

from ultralytics.data.augment import RandomFlip, RandomHSV, RandomPerspective  # noqa: E402
from ultralytics.utils.instance import Instances  # noqa: E402

from trainfuse.ultralytics import augment  # noqa: E402
from trainfuse.ultralytics.augment.color import bgr_to_hsv, hsv_to_bgr  # noqa: E402
from trainfuse.ultralytics.augment.params import AffineParams  # noqa: E402


def _scene(seed: int, size: int = 96) -> tuple[np.ndarray, np.ndarray]:
    """A smooth image (bilinear weights matter less than on noise) with a few boxes, some near edges."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (size // 8, size // 8, 3), dtype=np.uint8)
    img = cv2.resize(small, (size, size), interpolation=cv2.INTER_CUBIC)
    xy = rng.uniform(0, size * 0.8, (6, 2))
    wh = rng.uniform(2, size * 0.4, (6, 2))
    boxes = np.concatenate((xy, np.minimum(xy + wh, size - 1)), 1).astype(np.float32)
    boxes[0] = (1, 1, 5, 40)  # thin: the filter drops it at most scales
    return img, boxes


def _stock(img, boxes, kwargs, out):
    rp = RandomPerspective(**kwargs, size=out)
    labels = {"img": img.copy(), "cls": np.arange(len(boxes), dtype=np.float32)[:, None],
              "instances": Instances(boxes.copy(), np.zeros((0, 1000, 2), np.float32), bbox_format="xyxy",
                                     normalized=False)}
    params = rp.get_params(labels)
    labels = rp.apply_image(labels, params)
    labels = rp.apply_instances(labels, params)
    return params, labels


@pytest.mark.parametrize("kwargs", [
    dict(degrees=0.0, translate=0.1, scale=0.5, shear=0.0, perspective=0.0),  # ultralytics' defaults
    dict(degrees=30.0, translate=0.2, scale=0.9, shear=10.0, perspective=0.0),
    dict(degrees=10.0, translate=0.1, scale=0.5, shear=2.0, perspective=0.0005),
], ids=["defaults", "rotate-shear", "perspective"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_warp_matches_random_perspective_on_its_parameters(kwargs, seed):
    random.seed(seed)
    img, boxes = _scene(seed)
    out = (64, 48)  # from a 96 x 96 "mosaic", as 1280 -> 640
    params, labels = _stock(img, boxes, kwargs, out)
    ours = AffineParams(torch.from_numpy(params["M"]).double()[None], torch.tensor([params["scale"]]), out,
                        bool(kwargs["perspective"]))
    image = torch.from_numpy(img).permute(2, 0, 1)[None].contiguous()
    warped = augment.warp_images(image, ours)[0].permute(1, 2, 0).numpy().astype(int)
    ref = labels["img"].astype(int)
    assert warped.shape == ref.shape
    diff = np.abs(warped - ref)
    assert diff.max() <= 3 and diff.mean() < 0.3, (diff.max(), diff.mean())  # OpenCV's fixed-point bilinear
    assert (diff <= 1).mean() > 0.99
    t = torch.from_numpy(boxes)
    index = torch.zeros(len(boxes), dtype=torch.long)
    moved = augment.warp_boxes(t, index, ours)
    keep = augment.box_candidates(t, moved, ours.scale[index])
    kept = torch.from_numpy(labels["cls"][:, 0]).long()
    assert torch.equal(kept, torch.nonzero(keep)[:, 0])  # the same boxes dropped
    torch.testing.assert_close(moved[keep], torch.from_numpy(labels["instances"].bboxes), atol=1e-3, rtol=0)


def test_a_batch_warps_each_image_with_its_own_matrix():
    imgs = [_scene(s)[0] for s in range(3)]
    batch = torch.stack([torch.from_numpy(i).permute(2, 0, 1) for i in imgs])
    params = augment.affine_params(3, (96, 96), (64, 64), degrees=20, shear=5,
                                   generator=torch.Generator().manual_seed(0))
    out = augment.warp_images(batch, params)
    for k in range(3):
        one = AffineParams(params.matrix[k:k + 1], params.scale[k:k + 1], params.size, False)
        assert torch.equal(out[k:k + 1], augment.warp_images(batch[k:k + 1], one))
    assert augment.warp_boxes(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), params).shape == (0, 4)
    with pytest.raises(ValueError, match="uint8"):
        augment.warp_images(batch.float(), params)
    with pytest.raises(ValueError, match="3 matrices for 2 images"):
        augment.warp_images(batch[:2], params)


def test_boxes_pushed_out_of_frame_are_clipped_then_dropped():
    params = AffineParams(torch.tensor([[[1.0, 0, 500], [0, 1, 0], [0, 0, 1]]], dtype=torch.float64),
                          torch.ones(1), (64, 64), False)
    boxes = torch.tensor([[0.0, 0, 10, 10], [-520, 5, -480, 30]])  # moved out; moved into the frame
    moved = augment.warp_boxes(boxes, torch.zeros(2, dtype=torch.long), params)
    assert moved[0].tolist() == [64, 0, 64, 10]  # clipped to the right edge: zero width
    assert moved[1].tolist() == [0, 5, 20, 30]
    keep = augment.box_candidates(boxes, moved, torch.ones(2))
    assert keep.tolist() == [False, True]  # zero width; half its area left (> 0.1)
    assert not augment.box_candidates(boxes, moved, torch.ones(2), area_thr=0.6)[1]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_hsv_jitter_matches_random_hsv_on_its_gains(seed, monkeypatch):
    img, _ = _scene(seed, 64)
    img[0, :8] = 255  # pure white stays grey (its value may move)
    img[1, :8] = 0
    gains = np.random.default_rng(seed).uniform(-1, 1, 3)
    monkeypatch.setattr(np.random, "uniform", lambda *a, **k: gains)
    hyp = (0.015, 0.7, 0.4)
    ref = RandomHSV(*hyp).apply_image({"img": img.copy()})["img"].astype(int)
    ours = augment.hsv_jitter(torch.from_numpy(img).permute(2, 0, 1)[None].contiguous(),
                              torch.from_numpy(gains * np.array(hyp))[None])
    ours = ours[0].permute(1, 2, 0).numpy().astype(int)
    diff = np.abs(ours - ref)
    assert diff.max() <= 1 and diff.mean() < 0.5, (diff.max(), diff.mean())  # the way back's rounding
    assert (ours[0, :8] == ours[0, :8, :1]).all() and (ours[0, :8] == ref[0, :8]).all()


def test_bgr_to_hsv_is_opencvs_exactly_and_back_within_one_level():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)
    img[0, :6] = [[0, 0, 0], [255, 255, 255], [7, 7, 7], [255, 0, 0], [0, 255, 0], [0, 0, 255]]
    hsv = bgr_to_hsv(torch.from_numpy(img).permute(2, 0, 1)[None])[0].permute(1, 2, 0).numpy()
    assert np.array_equal(hsv, cv2.cvtColor(img, cv2.COLOR_BGR2HSV))
    back = hsv_to_bgr(torch.from_numpy(hsv).permute(2, 0, 1)[None])[0].permute(1, 2, 0).numpy().astype(int)
    assert np.abs(back - cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR).astype(int)).max() <= 1
    with pytest.raises(ValueError, match="gains must be"):
        augment.hsv_jitter(torch.from_numpy(img).permute(2, 0, 1)[None], torch.zeros(2, 3))


@pytest.mark.parametrize("horizontal", [True, False])
def test_flip_matches_random_flip(horizontal):
    img, boxes = _scene(3, 32)
    rf = RandomFlip(p=1.0, direction="horizontal" if horizontal else "vertical")
    labels = {"img": img.copy(), "instances": Instances(boxes.copy(), bbox_format="xyxy", normalized=False)}
    ref = rf(labels)
    batch = torch.from_numpy(np.stack([img, img])).permute(0, 3, 1, 2)
    index = torch.tensor([0] * len(boxes) + [1] * len(boxes))
    out, moved = augment.flip(batch, torch.from_numpy(np.concatenate([boxes, boxes])), index,
                              torch.tensor([True, False]), horizontal=horizontal)
    assert np.array_equal(out[0].permute(1, 2, 0).numpy(), ref["img"])
    assert torch.equal(out[1], batch[1])  # not flipped
    ref_boxes = ref["instances"]
    ref_boxes.convert_bbox("xyxy")
    torch.testing.assert_close(moved[:len(boxes)], torch.from_numpy(ref_boxes.bboxes))
    torch.testing.assert_close(moved[len(boxes):], torch.from_numpy(boxes))


def _ks(a: np.ndarray, b: np.ndarray) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical CDFs."""
    grid = np.sort(np.concatenate((a, b)))
    fa = np.searchsorted(np.sort(a), grid, side="right") / len(a)
    fb = np.searchsorted(np.sort(b), grid, side="right") / len(b)
    return float(np.abs(fa - fb).max())


def test_parameter_distributions_match_ultralytics_over_many_draws():
    """Each entry of the warp matrix against RandomPerspective's own draws (fixed seeds), and the
    HSV gains' and flips' ranges and spreads."""
    n = 4000
    hyp = dict(degrees=20.0, translate=0.1, scale=0.5, shear=5.0, perspective=0.001)
    ours = augment.affine_params(n, (128, 96), (64, 48), **hyp, generator=torch.Generator().manual_seed(0))
    random.seed(0)
    rp = RandomPerspective(**hyp, size=(64, 48))
    img = np.zeros((96, 128, 3), np.uint8)
    theirs = np.stack([rp._compute_affine_matrix(img, (64, 48))[0] for _ in range(n)])
    mine = ours.matrix.numpy()
    for (i, j) in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]:
        assert _ks(mine[:, i, j], theirs[:, i, j]) < 0.05, (i, j)  # 2-sample KS; 0.043 is p = 0.001
    gains = augment.hsv_gains(n, 0.015, 0.7, 0.4, generator=torch.Generator().manual_seed(1)).numpy()
    assert (np.abs(gains) <= [0.015, 0.7, 0.4]).all()
    np.testing.assert_allclose(gains.std(0), np.array([0.015, 0.7, 0.4]) / np.sqrt(3), rtol=0.05)
    flips = augment.flip_params(n, 0.5, generator=torch.Generator().manual_seed(2)).double().mean()
    assert abs(float(flips) - 0.5) < 0.03
    with pytest.raises(ValueError, match="p must be"):
        augment.flip_params(3, 1.5)
