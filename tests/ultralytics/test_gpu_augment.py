"""The GPU augmentation path: its kernel against its torch reference (bit for bit) and against
OpenCV; a deferred dataset against ultralytics' own on the same seeds (pixels within a level, the
labels equal); the cases that keep the CPU path; and training runs of FusedDetectionTrainer with
and without it."""

from __future__ import annotations

import copy
import functools
import math
import random

import numpy as np
import pytest
import torch

pytest.importorskip("ultralytics")
cv2 = pytest.importorskip("cv2")

from ultralytics.cfg import get_cfg  # noqa: E402
from ultralytics.data.augment import RandomHSV  # noqa: E402
from ultralytics.data.build import build_yolo_dataset  # noqa: E402
from ultralytics.data.utils import check_det_dataset  # noqa: E402

from tests.ultralytics._augment import seeded_batch  # noqa: E402
from trainfuse.losses.detection.targets import PADDED_KEY, add_padded_targets  # noqa: E402
from trainfuse.ultralytics.augment import deferred  # noqa: E402
from trainfuse.ultralytics.augment import kernel as augment_kernel  # noqa: E402
from trainfuse.ultralytics.augment.batch import finish_batch, is_deferred  # noqa: E402
from trainfuse.ultralytics.augment.color import hsv_luts, opencv_vector_block  # noqa: E402
from trainfuse.ultralytics.augment.decode import JpegDecoder  # noqa: E402
from trainfuse.ultralytics.augment.kernel import (  # noqa: E402
    TABLE,
    augment_images,
    augment_images_reference,
    pack_crops,
    tile_table,
)
from trainfuse.ultralytics.loading import CPU_DEFAULT_REASON, RAM_CACHE_REASON, setting_keeps_cpu  # noqa: E402
from trainfuse.ultralytics.shapes import make_shapes_dataset  # noqa: E402


def _crops(dims, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g) for h, w in dims]


def _matrices(n, perspective):
    out = []
    for i in range(n):
        a, s = 0.4 * i - 0.3, 0.7 + 0.35 * i
        m = torch.tensor([[s * math.cos(a), s * math.sin(a), 3.0 - 2 * i],
                          [-s * math.sin(a), s * math.cos(a), -1.5],
                          [1e-3 * i if perspective else 0.0, -5e-4 if perspective else 0.0, 1.0]],
                         dtype=torch.float64)
        out.append(torch.linalg.inv(m).reshape(9))
    return torch.stack(out) if out else torch.zeros(0, 9, dtype=torch.float64)


@pytest.mark.parametrize("dims,size", [
    ([[20, 30], [0, 0], [9, 11]], (17, 13)),  # an image the warp never reads
    ([[1, 1]], (5, 3)),
    ([[33, 7], [7, 33]], (31, 1)),
    ([], (8, 8)),  # no images
    ([[4, 4]], (0, 6)),  # an empty output
])
@pytest.mark.parametrize("perspective", [False, True])
@pytest.mark.parametrize("hsv", [False, 0, 4, 32])  # no HSV; HSV with no, 4- and 32-column vector blocks
def test_kernel_equals_its_torch_reference(dims, size, perspective, hsv, kernels, device, monkeypatch):
    crops = _crops(dims)
    n = len(crops)
    g = torch.Generator().manual_seed(n)
    origins = torch.randint(0, 3, (n, 2), dtype=torch.int32, generator=g)
    flips = torch.rand(n, 2, generator=g) < 0.5
    packed, table = pack_crops(crops, _matrices(n, perspective), origins, flips, torch.arange(n) % 2 == 0)
    luts = hsv_luts(torch.rand(n, 3, dtype=torch.float64, generator=g) - 0.5) if hsv is not False else None
    block = hsv or 0
    packed, table = packed.to(device), table.to(device)
    luts = luts.to(device) if luts is not None else None
    out = augment_images(packed, table, luts, size, perspective, block)
    ref = augment_images_reference(packed, table, luts, size, perspective, block)
    assert out.shape == (n, 3, size[1], size[0]) and out.dtype == torch.uint8 and out.device == packed.device
    if device.type == "cpu":  # the interpreter: the reference's arithmetic, op for op
        assert torch.equal(out, ref)
        # in blocks of 64 pixels too (the interpreter's are whole images, the GPU's 256 pixels)
        monkeypatch.setattr(augment_kernel, "INTERPRETER_BLOCK", 64)
        assert torch.equal(augment_images(packed, table, luts, size, perspective, block), ref)
    else:  # compiled, the multiply-adds fuse: a channel rounded down may land a level lower
        diff = (out.int() - ref.int()).abs()
        assert not diff.numel() or (int(diff.max()) <= 1 and (diff == 0).float().mean() > 0.99)


@pytest.mark.parametrize("perspective", [False, True])
def test_tiles_read_as_the_canvas_they_paint(perspective, kernels, device):
    """Up to four tiles per image (two reading one source, overlapping ones: the later wins,
    one past the canvas the warp reads) equal the canvas painted from them, warped as one crop."""
    sources = _crops([[9, 12], [7, 5], [11, 11]], seed=3)
    tiles = [
        [(0, 0, 0, 12, 9, 0, 0), (1, 10, 2, 15, 9, 0, 0), (2, 3, 8, 12, 17, 2, 2), (0, 14, 14, 18, 16, 8, 7)],
        [(2, 0, 0, 11, 11, 0, 0), (2, 11, 0, 20, 11, 2, 0)],
        [(1, 4, 4, 8, 9, 1, 2)],
        [],  # all grey
    ]
    n = len(tiles)
    inverse = _matrices(n, perspective)
    flips = torch.tensor([[False, True], [True, False], [False, False], [True, True]])
    swaps = torch.tensor([True, False, True, False])
    table = tile_table([tuple(s.shape[:2]) for s in sources], tiles, inverse, flips, swaps)
    packed = torch.cat([s.reshape(-1) for s in sources])
    canvases = []
    for image_tiles in tiles:
        canvas = torch.full((20, 20, 3), 114, dtype=torch.uint8)
        for src, x1a, y1a, x2a, y2a, x1b, y1b in image_tiles:
            canvas[y1a:y2a, x1a:x2a] = sources[src][y1b:y1b + y2a - y1a, x1b:x1b + x2a - x1a]
        canvases.append(canvas)
    _, painted = pack_crops(canvases, inverse, torch.zeros(n, 2), flips, swaps)
    flat = torch.cat([c.reshape(-1) for c in canvases])
    luts = hsv_luts(torch.rand(n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) - 0.5)
    for lut in (None, luts.to(device)):
        out = augment_images(packed.to(device), table.to(device), lut, (15, 13), perspective, 4)
        want = augment_images(flat.to(device), painted.to(device), lut, (15, 13), perspective, 4)
        ref = augment_images_reference(packed, table, lut.cpu() if lut is not None else None, (15, 13),
                                       perspective, 4)
        assert torch.equal(out, want)  # the same canvas: the same arithmetic, bit for bit
        if device.type == "cpu":
            assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="tile 0 reads outside source 1"):
        tile_table([(9, 12), (7, 5)], [[(1, 0, 0, 6, 2, 0, 0)]], inverse[:1], flips[:1], swaps[:1])
    with pytest.raises(ValueError, match="at most 4"):
        tile_table([(9, 12)], [[(0, 0, 0, 1, 1, 0, 0)] * 5], inverse[:1], flips[:1], swaps[:1])


def _smooth(seed, h, w):
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (h // 6 + 1, w // 6 + 1, 3), dtype=np.uint8)
    return cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)


@pytest.mark.parametrize("perspective", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_matches_opencv_warp_and_random_hsv(perspective, seed, kernels, device, monkeypatch):
    img = _smooth(seed, 50, 60)
    img[:4, :4] = 255  # pure white stays white through RandomHSV
    tilt = (8e-4, -6e-4) if perspective else (0, 0)
    m = np.array([[1.1, 0.2, -4.0], [-0.15, 0.9, 3.0], [*tilt, 1]], dtype=np.float32)
    size = (40, 36)
    warp = cv2.warpPerspective if perspective else (lambda i, mm, s, **k: cv2.warpAffine(i, mm[:2], s, **k))
    warped = warp(img, m, size, borderValue=(114, 114, 114, 114))
    gains = np.random.default_rng(seed).uniform(-1, 1, 3)
    monkeypatch.setattr(np.random, "uniform", lambda *a, **k: gains)
    hyp = (0.015, 0.7, 0.4)
    ref = RandomHSV(*hyp).apply_image({"img": warped.copy()})["img"].astype(int)
    luts = hsv_luts(torch.from_numpy(gains * np.array(hyp))[None])
    inverse = torch.from_numpy(np.linalg.inv(m.astype(np.float64))).reshape(1, 9)
    packed, table = pack_crops([torch.from_numpy(img)], inverse, torch.zeros(1, 2), torch.zeros(1, 2),
                               torch.zeros(1))
    packed, table = packed.to(device), table.to(device)
    for lut, want in ((None, warped.astype(int)), (luts.to(device), ref)):
        out = augment_images(packed, table, lut, size, perspective, opencv_vector_block())
        diff = np.abs(out[0].permute(1, 2, 0).cpu().numpy().astype(int) - want)
        # OpenCV 5's bilinear and HSV arithmetic; a source point within float error of a pixel
        # boundary, or a value of a rounding tie, may fall the other way
        assert diff.max() <= 2 and (diff == 0).mean() > 0.995, (diff.max(), (diff == 0).mean())


def test_bad_arguments_are_refused_before_any_work():
    crops = _crops([[4, 4]])
    none = (torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1))  # origins, flips, swaps
    packed, table = pack_crops(crops, _matrices(1, False), *none)
    with pytest.raises(ValueError, match="packed must be uint8"):
        augment_images(packed.float(), table, None, (4, 4))
    with pytest.raises(ValueError, match=rf"table must be float64 \(N, {TABLE}\)"):
        augment_images(packed, table.float(), None, (4, 4))
    with pytest.raises(ValueError, match=r"luts must be uint8 \(1, 3, 256\)"):
        augment_images(packed, table, torch.zeros(1, 3, 256, dtype=torch.int32), (4, 4))
    with pytest.raises(ValueError, match=r"inverse must have shape \(1, 9\)"):
        pack_crops(crops, torch.zeros(2, 9), *none)
    with pytest.raises(ValueError, match=r"crops\[0\] must be uint8 \(h, w, 3\)"):
        pack_crops([crops[0][..., :2]], torch.zeros(1, 9), *none)


# ---- a deferred dataset against ultralytics' own -------------------------------------------------
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-augment")
    yaml = make_shapes_dataset(root, n_train=8, n_val=2, imgsz=96, photo=True)
    return check_det_dataset(str(yaml))


def _datasets(data, decode=False, **overrides):
    cfg = get_cfg(overrides={"imgsz": 96, **overrides})
    stock = build_yolo_dataset(copy.copy(cfg), data["train"], 4, data, mode="train")
    ours = build_yolo_dataset(copy.copy(cfg), data["train"], 4, data, mode="train")
    assert deferred.unsupported(ours, cfg) == ""
    deferred.install(ours, copy.copy(cfg), pad=True, decode=decode)
    return stock, ours


_batch = seeded_batch


def _finish_on(batch, device, decoder=None):
    """finish_batch where the tests' kernels run (the GPU, or the interpreter on the CPU)."""
    moved = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    out = finish_batch(moved, decoder)
    return {k: v.cpu() if torch.is_tensor(v) else v for k, v in out.items()}


def _assert_like_stock(stock, ours):
    for key in ("cls", "bboxes", "batch_idx", PADDED_KEY):  # ultralytics' own code moved the labels
        if key in ours:
            assert torch.equal(ours[key], stock[key]), key
    assert ours["img"].shape == stock["img"].shape and ours["img"].dtype == torch.uint8
    # OpenCV warps through source coordinates in fixed point (1/32 pixel), the kernel in float32:
    # on a shape's sharp edge the two may land a value 2 levels apart (an H200 batch of the
    # segmentation shapes under the full warp: 0.99989 of its values within 1)
    diff = (ours["img"].int() - stock["img"].int()).abs()
    same, close = (diff == 0).float().mean(), (diff <= 1).float().mean()
    assert same > 0.99 and close > 0.9995, (diff.max(), same, close)


DEFAULTS = {}  # ultralytics' defaults: mosaic, scale 0.5, translate 0.1, HSV, fliplr 0.5
WARPS = {"degrees": 20.0, "shear": 5.0, "perspective": 0.0005, "flipud": 0.5, "translate": 0.3}
NO_MOSAIC = {"mosaic": 0.0, "fliplr": 1.0, "scale": 0.9}  # close_mosaic's epochs: one letterboxed image
NO_HSV = {"hsv_h": 0.0, "hsv_s": 0.0, "hsv_v": 0.0, "bgr": 0.5}


# every setting with the workers decoding; the GPU decoder (the same pixels from other bytes) with
# ultralytics' defaults and the full warp
@pytest.mark.parametrize("overrides,decode", [
    (DEFAULTS, False), (WARPS, False), (NO_MOSAIC, False), (NO_HSV, False), (DEFAULTS, True), (WARPS, True),
], ids=["workers-decode-defaults", "workers-decode-warp-all", "workers-decode-no-mosaic",
        "workers-decode-no-hsv-bgr", "decoder-defaults", "decoder-warp-all"])
def test_deferred_batches_equal_stock_batches_on_the_same_seeds(data, overrides, decode, kernels, device,
                                                                stock_decodes_as_the_gpu):
    stock_decodes_as_the_gpu(decode and device.type == "cuda")
    stock, ours = _datasets(data, decode=decode, **overrides)
    decoder = JpegDecoder(capacity=4)
    for seed in range(2):
        out = _batch(ours, seed)
        assert is_deferred(out)
        if decode:  # the JPEGs' bytes: a few KB at 96 px
            assert out["aug_raw"].numel() == 0 and 0 < out["aug_jpeg"].tensor.numel() < 12 * 96 * 72
        else:
            assert out["aug_packed"].numel() < 3 * (2 * 96) ** 2 * 3  # crops, not mosaics
        out = _finish_on(out, device, decoder)
        assert not any(k.startswith("aug_") for k in out)
        want = _batch(stock, seed)
        add_padded_targets(want)
        _assert_like_stock(want, out)
    assert not decode or (decoder.decoded > 0 and decoder.reused > 0)


def test_deferred_transforms_draw_the_stock_parameters(data, monkeypatch):
    """Over many draws with rotation, shear, perspective and both flips on, the deferred chain
    draws the very warps and HSV gains stock draws (the same calls in the same order), so their
    distributions are ultralytics' by construction; and its random stream ends where stock's does."""
    from ultralytics.data.augment import RandomPerspective

    drawn = []
    compute = RandomPerspective._compute_affine_matrix
    uniform = np.random.uniform
    monkeypatch.setattr(RandomPerspective, "_compute_affine_matrix",
                        lambda self, *a: drawn.append(("warp", compute(self, *a))) or drawn[-1][1])
    monkeypatch.setattr(np.random, "uniform",
                        lambda *a, **k: drawn.append(("hsv", uniform(*a, **k))) or drawn[-1][1])
    stock, ours = _datasets(data, degrees=30.0, shear=10.0, perspective=0.001, flipud=0.5, fliplr=0.5)
    runs = {}
    for name, dataset in (("stock", stock), ("ours", ours)):
        drawn.clear()
        random.seed(5)
        np.random.seed(5)
        for i in range(40):
            dataset[i % len(dataset)]
        runs[name] = (list(drawn), random.random(), np.random.rand())
    (stock_draws, *stock_next), (our_draws, *our_next) = runs["stock"], runs["ours"]
    assert len(stock_draws) == len(our_draws) >= 80
    for (kind, a), (kind2, b) in zip(stock_draws, our_draws):
        assert kind == kind2
        if kind == "warp":
            assert np.array_equal(a[0], b[0]) and a[1] == b[1]
        else:
            assert np.array_equal(a, b)
    assert stock_next == our_next


def test_close_mosaic_rebuilds_deferred_transforms(data, device):
    stock, ours = _datasets(data)
    hyp = get_cfg(overrides={"imgsz": 96})
    stock.close_mosaic(copy.copy(hyp))
    ours.close_mosaic(copy.copy(hyp))
    _assert_like_stock(add_padded_targets(_batch(stock, 7)), _finish_on(_batch(ours, 7), device))


@pytest.mark.parametrize("overrides,reason", [
    ({"mixup": 0.1}, "mixup=0.1"), ({"cutmix": 0.2}, "cutmix=0.2"), ({"copy_paste": 0.1}, "copy_paste=0.1"),
    ({"rect": True}, "rect batches"),
])
def test_what_keeps_the_cpu_path_says_why(data, overrides, reason):
    cfg = get_cfg(overrides={"imgsz": 96, **overrides})
    dataset = build_yolo_dataset(copy.copy(cfg), data["train"], 4, data, mode="train")
    assert reason in deferred.unsupported(dataset, cfg)


def test_installed_albumentations_keep_the_cpu_path(data):
    from ultralytics.data.augment import Albumentations

    cfg = get_cfg(overrides={"imgsz": 96})
    dataset = build_yolo_dataset(copy.copy(cfg), data["train"], 4, data, mode="train")
    (albumentations,) = [t for t in dataset.transforms.transforms if isinstance(t, Albumentations)]
    assert albumentations.transform is None  # not installed here: nothing runs between warp and HSV
    albumentations.transform = lambda **kwargs: kwargs  # what an installed albumentations leaves
    assert "Albumentations" in deferred.unsupported(dataset, cfg)


def test_the_mosaic_painted_where_the_warp_reads_equals_the_stock_canvas(data):
    from ultralytics.data.augment import Mosaic

    cfg = get_cfg(overrides={"imgsz": 96})
    dataset = build_yolo_dataset(copy.copy(cfg), data["train"], 4, data, mode="train")
    for i in range(len(dataset)):  # fill the mosaic's buffer
        dataset.get_image_and_label(i)
    stock = Mosaic(dataset, imgsz=96, p=1.0)
    ours = deferred.DeferredMosaic(dataset, imgsz=96, p=1.0)
    for seed in range(4):
        random.seed(seed)
        labels = dataset.get_image_and_label(seed)
        labels["mix_labels"] = [dataset.get_image_and_label(j) for j in stock.get_indexes()]
        params = stock.get_params(labels)
        canvas = stock.apply_image(dict(labels), params)["img"]
        lazy = ours.apply_image(dict(labels), params)
        assert lazy["img"].shape == canvas.shape and lazy["img"].strides[:2] == (0, 0)  # no pixels yet
        rng = np.random.default_rng(seed)
        x0, y0 = (int(v) for v in rng.integers(0, 150, 2))
        for region in ((0, 0, 192, 192), (x0, y0, x0 + int(rng.integers(0, 42)), y0 + 40), (0, 0, 0, 0)):
            x0_, y0_, x1_, y1_ = region
            painted = deferred._paint(deferred._clip(lazy["mosaic_tiles"], region), region, 3)
            assert np.array_equal(painted, canvas[y0_:y1_, x0_:x1_])


@pytest.fixture(scope="module")
def task_data(tmp_path_factory):
    from trainfuse.ultralytics.task_shapes import make_task_dataset

    root = tmp_path_factory.mktemp("gpu-augment-tasks")
    return {task: check_det_dataset(str(make_task_dataset(root / task, task, n_train=8, n_val=2, imgsz=64)))
            for task in ("segment", "pose", "obb")}


@pytest.mark.parametrize("task,overrides", [
    ("segment", WARPS), ("pose", WARPS), ("obb", WARPS),  # rotations, shear, both flips
    ("segment", NO_MOSAIC),  # close_mosaic's letterboxed image
], ids=["segment-warp-all", "pose-warp-all", "obb-warp-all", "segment-no-mosaic"])
def test_segment_pose_and_obb_batches_equal_stock_batches_when_asked_for(task_data, task, overrides, kernels,
                                                                          device):
    """Their labels (polygons, masks, semantic masks, keypoints flipped by flip_idx, rotated boxes)
    are stock's bit for bit, the keypoints padded beside the boxes; the pixels as detection's."""
    data = task_data[task]
    cfg = get_cfg(overrides={"imgsz": 64, "task": task, **overrides})
    stock = build_yolo_dataset(copy.copy(cfg), data["train"], 4, data, mode="train")
    ours = build_yolo_dataset(copy.copy(cfg), data["train"], 4, data, mode="train")
    assert deferred.unsupported(ours, cfg) == deferred.TASKS_OPT_IN  # gpu_augment=None keeps the CPU
    assert deferred.unsupported(ours, cfg, tasks=True) == ""
    deferred.install(ours, copy.copy(cfg), pad=True)
    for seed in range(2):
        out = _finish_on(_batch(ours, seed), device)
        want = add_padded_targets(_batch(stock, seed))
        labels = [k for k in want if torch.is_tensor(want[k]) and k != "img"]
        assert {"masks", "keypoints", "padded_keypoints"} & set(labels) or task == "obb"
        for key in labels:
            assert torch.equal(out[key], want[key]), key
        _assert_like_stock(want, out)


def test_polygon_labels_keep_the_cpu_path(data):
    cfg = get_cfg(overrides={"imgsz": 96})
    dataset = build_yolo_dataset(copy.copy(cfg), data["train"], 4, data, mode="train")
    dataset.labels[0]["segments"] = [np.zeros((4, 2), np.float32)]
    assert "polygon labels" in deferred.unsupported(dataset, cfg)


# ---- training --------------------------------------------------------------------------------------
def _train(data_yaml, tmp_path, name, **kwargs):
    from ultralytics import YOLO

    from trainfuse.ultralytics import FusedDetectionTrainer

    model = YOLO("yolov5n.yaml")
    model.train(data=data_yaml, epochs=2, imgsz=64, batch=4, workers=0, device="cpu", seed=0,
                deterministic=True, plots=True, val=False, close_mosaic=1, project=str(tmp_path), name=name,
                exist_ok=True, verbose=False, trainer=functools.partial(FusedDetectionTrainer, **kwargs))
    return model.trainer


@pytest.mark.parametrize("gpu_augment,device,cache,keeps", [
    (False, "cuda", None, "gpu_augment=False"), (False, "cpu", "disk", "gpu_augment=False"),
    (True, "cpu", "ram", ""), (True, "cuda", "ram", ""), (True, "cuda", None, ""),
    (None, "cpu", None, CPU_DEFAULT_REASON), (None, "cpu", "ram", CPU_DEFAULT_REASON),
    (None, "cuda", "ram", RAM_CACHE_REASON), (None, "cuda", None, ""), (None, "cuda", "disk", ""),
])
def test_the_default_augments_on_the_gpu_where_images_come_from_disk(gpu_augment, device, cache, keeps):
    assert setting_keeps_cpu(gpu_augment, torch.device(device), cache) == keeps


@pytest.mark.cpu_training
@pytest.mark.gpu_augment_default
def test_training_with_gpu_augmentation_tracks_the_cpu_path(tmp_path):
    data_yaml = str(make_shapes_dataset(tmp_path / "data", n_train=8, n_val=2, imgsz=64))
    cpu = _train(data_yaml, tmp_path, "cpu")  # the default on a CPU device
    gpu = _train(data_yaml, tmp_path, "gpu", gpu_augment=True)
    assert cpu.augment_reason == CPU_DEFAULT_REASON and gpu.augment_reason == ""
    assert [r.action for r in gpu.report if r.kind == "augment"] == ["on"]
    assert [r.action for r in cpu.report if r.kind == "augment"] == ["off"]
    for key in ("box_loss", "cls_loss", "dfl_loss"):  # the same images within a level, the same labels
        torch.testing.assert_close(gpu.tloss[key], cpu.tloss[key], rtol=0.1, atol=1e-3)
    assert (tmp_path / "gpu" / "train_batch0.jpg").exists()


@pytest.mark.cpu_training
def test_a_pose_run_augments_on_the_gpu_path_when_asked_and_tracks_the_cpu_path(task_data, tmp_path):
    from ultralytics import YOLO

    from trainfuse.ultralytics import FusedPoseTrainer

    runs = {}
    for name, options in (("cpu", {}), ("gpu", {"gpu_augment": True})):
        model = YOLO("yolov8n-pose.yaml")
        model.train(data=task_data["pose"]["yaml_file"], epochs=2, imgsz=64, batch=4, workers=0, device="cpu",
                    seed=0, deterministic=True, plots=False, val=False, close_mosaic=1, project=str(tmp_path),
                    name=name, exist_ok=True, verbose=False,
                    trainer=functools.partial(FusedPoseTrainer, **options))
        runs[name] = model.trainer
    cpu, gpu = runs["cpu"], runs["gpu"]
    assert cpu.augment_reason == CPU_DEFAULT_REASON and gpu.augment_reason == ""
    assert [r.action for r in gpu.report if r.kind == "augment"] == ["on"]
    for key in ("box_loss", "pose_loss", "kobj_loss", "cls_loss", "dfl_loss"):
        torch.testing.assert_close(gpu.tloss[key], cpu.tloss[key], rtol=0.1, atol=1e-3)


@pytest.mark.gpu_augment_default
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the JPEGs are decoded on the GPU on CUDA only")
def test_training_on_cuda_decodes_on_the_gpu_and_tracks_the_cpu_path(tmp_path):
    """The default on CUDA: the GPU decodes and augments the JPEGs read every epoch, with the
    step's replays paced beside its thread; once every image is kept on the device, the workers
    send no JPEG bytes (the last epoch's batches are made after the first's were decoded); with
    the images cached in RAM the CPU path stays."""
    from ultralytics import YOLO

    from trainfuse.ultralytics import FusedDetectionTrainer

    data_yaml = str(make_shapes_dataset(tmp_path / "data", n_train=32, n_val=4, imgsz=96, photo=True))
    trainers, received, reloaded = {}, [], {}

    def reload(t):  # ultralytics' NaN recovery: the changes undone around a checkpoint load, made again
        before = (set(t.jpeg_decoder.resident), t.jpeg_decoder.budget)
        t.around_checkpoint_load(lambda: None)
        reloaded["kept"] = before == (set(t.jpeg_decoder.resident), t.jpeg_decoder.budget) and bool(before[0])

    for name, on, cache in (("cpu", False, False), ("gpu", None, False), ("ram", None, "ram")):
        model = YOLO("yolov5n.yaml")
        if name == "gpu":
            model.add_callback("on_train_epoch_end", lambda t: received.append(t.jpeg_decoder.received))
            model.add_callback("on_train_end", reload)
        trainer = functools.partial(FusedDetectionTrainer, gpu_augment=on)
        model.train(data=data_yaml, epochs=1 if cache else 3, imgsz=96, batch=8, workers=2, device=0, seed=0,
                    deterministic=True, plots=False, val=False, close_mosaic=1, project=str(tmp_path),
                    name=name, exist_ok=True, verbose=False, trainer=trainer, cache=cache)
        trainers[name] = model.trainer
    gpu, cpu = trainers["gpu"], trainers["cpu"]
    assert gpu.augment_reason == "" and trainers["ram"].augment_reason == RAM_CACHE_REASON
    assert trainers["ram"].jpeg_decoder is None
    assert "JPEG decoding" in next(r.detail for r in gpu.report if r.kind == "augment")
    assert "paced" in next(r.detail for r in gpu.report if r.kind == "graphs")
    assert "paced" not in next(r.detail for r in cpu.report if r.kind == "graphs")
    assert gpu.jpeg_decoder.decoded >= 32 and gpu.jpeg_decoder.reused > 0  # each image; the mosaic's kept
    assert len(received) == 3 and received[0] > 0 and received[2] == received[1], received
    assert reloaded["kept"]  # the decoded images stay around a checkpoint load
    cached = {t: {r.name: r.action for r in trainers[t].report if r.kind == "device cache"} for t in trainers}
    assert cached["gpu"]["decoded training images"] == "on"
    assert cached["cpu"]["decoded training images"] == "skipped"
    decoder = gpu.jpeg_decoder  # given back when training ended
    assert not decoder.kept and not decoder.resident and decoder.budget is None
    for key in ("box_loss", "cls_loss", "dfl_loss"):  # the same labels; pixels a decoder's levels apart
        torch.testing.assert_close(gpu.tloss[key], cpu.tloss[key], rtol=0.15, atol=1e-3)


def test_gpu_augment_must_be_a_bool_or_none():
    from trainfuse.ultralytics import FusedDetectionTrainer

    with pytest.raises(TypeError, match="gpu_augment must be True, False or None"):
        FusedDetectionTrainer(overrides={"data": "coco8.yaml"}, gpu_augment="yes")


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the prefetcher finishes batches on a CUDA side stream")
@pytest.mark.parametrize("decode", [False, True], ids=["workers-decode", "decoder"])
def test_prefetcher_finishes_deferred_batches_on_its_side_stream(data, decode, stock_decodes_as_the_gpu):
    stock_decodes_as_the_gpu(decode)
    from trainfuse.ultralytics.loading import _finish_deferred
    from trainfuse.ultralytics.prefetch import DevicePrefetcher

    stock, ours = _datasets(data, decode=decode)
    batches = [_batch(ours, s) for s in range(3)]
    finish = functools.partial(_finish_deferred, JpegDecoder(capacity=8) if decode else None)
    prefetched = list(DevicePrefetcher(batches, torch.device("cuda"), finish=finish))
    for seed, out in enumerate(prefetched):
        assert out["img"].is_cuda
        want = add_padded_targets(_batch(stock, seed))
        got = {k: v.cpu() if torch.is_tensor(v) else v for k, v in out.items()}
        _assert_like_stock(want, got)
