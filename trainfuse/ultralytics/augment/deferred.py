"""The loader's side of GPU augmentation: ultralytics' own training transforms, with the per-pixel
work of four of them deferred to the GPU (:mod:`trainfuse.ultralytics.augment.batch`).

:func:`install` swaps, in a training dataset's transform chain (and again whenever ultralytics
rebuilds it, as ``close_mosaic`` does), each of these for a subclass that draws its random numbers
with the very calls and in the very order the stock transform makes, records what it drew and
leaves the pixels alone:

- ``Mosaic`` (of 4): draws the layout and moves the labels with ultralytics' own code, and keeps
  the four tiles and where they go instead of painting the canvas (a stand-in of its shape takes
  the image's place);
- ``RandomPerspective``: draws the matrix and transforms and filters the labels with
  ultralytics' own code; of the mosaic, only the part the warp reads (plus one pixel for the
  bilinear neighbours) is painted, and any other image is cropped to it;
- ``RandomHSV``: draws the gains and builds the three lookup tables as ultralytics builds them;
- ``RandomFlip``: draws the flip and flips the labels (ultralytics' code, the output's size);
- ``Format``: formats the labels as ultralytics does, draws its BGR/RGB choice and hands the crop
  over as HWC uint8.

So the labels are the stock run's, bit for bit; only the pixels wait for the GPU.

Every other transform (the mosaic of 9, ``LetterBox``, ``CopyPaste``, ``MixUp`` and ``CutMix`` at
probability 0, ``Albumentations``) runs as it is, so a worker's random stream, and with it every
parameter of every image, is the stock run's. The workers then decode, paste the part of the
mosaic the warp reads and move the labels; :class:`DeferredCollate` packs a batch's crops into
one flat uint8 tensor, with one float64 table of what the kernel needs per image and one of the
HSV lookup tables.

:func:`unsupported` says why a dataset or its hyperparameters keep the CPU path: ``mixup`` and
``cutmix`` (they blend two warped images), ``copy_paste``, the Albumentations transforms
(installed, they filter the warped image), polygon labels of detection datasets (ultralytics
computes the warped boxes from the polygons), ``rect`` batches; and segment, pose and OBB datasets
unless asked for (``tasks``: their labels, polygons, masks and keypoints move as stock's, by
ultralytics' own code, and only the pixels wait for the GPU).
"""

from __future__ import annotations

import functools
import random

import numpy as np
import torch
from typing_extensions import override
from ultralytics.data.augment import (
    Albumentations,
    Compose,
    Format,
    Mosaic,
    RandomFlip,
    RandomHSV,
    RandomPerspective,
)
from ultralytics.data.dataset import YOLODataset

from trainfuse.losses.detection.targets import add_padded_targets
from trainfuse.ultralytics import compat
from trainfuse.ultralytics.augment import decode as decoding
from trainfuse.ultralytics.augment.color import opencv_vector_block
from trainfuse.ultralytics.augment.decode import Encoded
from trainfuse.ultralytics.augment.kernel import tile_table

KEYS = ("aug_packed", "aug_sources", "aug_raw", "aug_jpeg", "aug_table", "aug_luts", "aug_size",
        "aug_perspective", "aug_vector_block")


TASKS_OPT_IN = ("the masks, keypoints and oriented boxes of segment, pose and OBB datasets augment on the "
                "CPU unless gpu_augment=True")


def unsupported(dataset, hyp, *, tasks: bool = False) -> str:
    """Why ``dataset`` (a training ``YOLODataset``) with ``hyp`` keeps ultralytics' CPU
    augmentation ("" when the GPU path covers it). ``tasks``: segment, pose and OBB datasets too
    (their labels move by ultralytics' own code as detection's do, masks rasterized from the moved
    polygons; asked for with ``gpu_augment=True``)."""
    if type(dataset) is not YOLODataset:
        return f"the dataset is a {type(dataset).__name__}, not a plain YOLODataset"
    if not dataset.augment or dataset.rect:
        return "rect batches" if dataset.rect else "the dataset does not augment"
    task_labels = dataset.use_segments or dataset.use_keypoints or dataset.use_obb
    if task_labels and not tasks:
        return TASKS_OPT_IN
    for name in ("mixup", "cutmix", "copy_paste"):
        if getattr(hyp, name, 0.0):
            return f"{name}={getattr(hyp, name)} blends or pastes images after the warp, on the CPU"
    if getattr(hyp, "augmentations", None):
        return "custom Albumentations transforms"
    if any(isinstance(t, Albumentations) and t.transform is not None for t in _walk(dataset.transforms)):
        return "the Albumentations transforms (albumentations is installed) filter the warped image"
    if not (dataset.use_segments or dataset.use_obb) and any(len(label.get("segments", ()))
                                                             for label in dataset.labels):
        return "polygon labels of a detection dataset (ultralytics derives the warped boxes from them)"
    if getattr(dataset, "channels", 3) != 3:
        return f"{dataset.channels}-channel images"
    return ""


def _region(matrix: np.ndarray, image_hw: tuple[int, int], size: tuple[int, int], perspective: bool
            ) -> tuple[int, int, int, int]:
    """``(x0, y0, x1, y1)``: the pixels of an image of ``image_hw`` the warp to ``size`` (w, h) reads."""
    h, w = image_hw
    inverse = np.linalg.inv(matrix.astype(np.float64))
    corners = np.array([[0, size[0] - 1, 0, size[0] - 1], [0, 0, size[1] - 1, size[1] - 1], [1, 1, 1, 1]],
                       dtype=np.float64)
    src = inverse @ corners
    if perspective:
        if (src[2] <= 0).any():  # the horizon crosses the output: read everything
            return 0, 0, w, h
        src = src[:2] / src[2]
    x0 = int(np.clip(np.floor(src[0].min()) - 1, 0, w))
    y0 = int(np.clip(np.floor(src[1].min()) - 1, 0, h))
    x1 = int(np.clip(np.floor(src[0].max()) + 2, x0, w))
    y1 = int(np.clip(np.floor(src[1].max()) + 2, y0, h))
    return x0, y0, x1, y1


def _walk(transforms):
    """Every transform of a ``Compose``, nested ones and the mix transforms' ``pre_transform``
    included, each once."""
    seen, stack = set(), [transforms]
    while stack:
        compose = stack.pop()
        if id(compose) in seen or not isinstance(compose, Compose):
            continue
        seen.add(id(compose))
        for t in compose.transforms:
            yield t
            stack.append(t)
            stack.append(getattr(t, "pre_transform", None))


def _stand_in(h: int, w: int, c: int) -> np.ndarray:
    """A zero-cost, read-only (h, w, c) uint8 image: the shape the stock transforms read."""
    return np.broadcast_to(np.zeros((1, 1, c), np.uint8), (h, w, c))


def _clip(tiles: list, region: tuple[int, int, int, int]) -> list:
    """The parts of ``tiles`` inside ``region`` (x0, y0, x1, y1) of the canvas, as tiles. Each tile:
    ``(image, x1a, y1a, x2a, y2a, x1b, y1b)``, its ``image[y1b:, x1b:]`` shown on the canvas's
    ``[y1a:y2a, x1a:x2a]`` (ultralytics' mosaic layout)."""
    x0, y0, x1, y1 = region
    out = []
    for img, x1a, y1a, x2a, y2a, x1b, y1b in tiles:
        ix0, iy0, ix1, iy1 = max(x1a, x0), max(y1a, y0), min(x2a, x1), min(y2a, y1)
        if ix0 < ix1 and iy0 < iy1:
            out.append((img, ix0, iy0, ix1, iy1, x1b + ix0 - x1a, y1b + iy0 - y1a))
    return out


def _own_tile(img, x1a, y1a, x2a, y2a, x1b, y1b) -> tuple:
    """A tile's pixels as an image of their own (a tile reading it from its corner)."""
    return np.ascontiguousarray(img[y1b:y1b + y2a - y1a, x1b:x1b + x2a - x1a]), x1a, y1a, x2a, y2a, 0, 0


def _paint(tiles: list, region: tuple[int, int, int, int], c: int) -> np.ndarray:
    """The ``region`` (x0, y0, x1, y1) of a canvas filled with 114 and ``tiles`` (inside the region,
    :func:`_clip`) pasted in order, as ultralytics paints the whole mosaic."""
    x0, y0, x1, y1 = region
    crop = np.full((y1 - y0, x1 - x0, c), 114, dtype=np.uint8)
    for img, x1a, y1a, x2a, y2a, x1b, y1b in tiles:
        crop[y1a - y0:y2a - y0, x1a - x0:x2a - x0] = img[y1b:y1b + y2a - y1a, x1b:x1b + x2a - x1a]
    return crop


class DeferredMosaic(Mosaic):
    """``Mosaic`` that draws its layout and moves the labels, and keeps the tiles (``mosaic_tiles``)
    for :class:`DeferredPerspective` to paint what the warp reads. The mosaic of 9 paints as stock."""

    @override
    def apply_image(self, labels, params=None):
        if self.n != 4:
            return super().apply_image(labels, params)
        c = labels["img"].shape[2]
        labels["mosaic_tiles"] = compat.mosaic_tiles(params)
        labels["img"] = _stand_in(self.imgsz * 2, self.imgsz * 2, c)
        return labels


class DeferredPerspective(RandomPerspective):
    """``RandomPerspective`` that draws its matrix and moves the labels, and keeps (``tiles``) the
    parts of the canvas the warp reads: one crop painted from the pixels at hand, or, where images
    wait for the GPU's decoder (:class:`~trainfuse.ultralytics.augment.decode.Encoded`), their tiles
    as they are. ``img`` is then a stand-in of the warped image's shape."""

    @override
    def apply_image(self, labels, params=None):
        img = labels["img"]
        h, w, c = img.shape
        tiles = labels.pop("mosaic_tiles", None) or [(img, 0, 0, w, h, 0, 0)]
        size = compat.perspective_size(params)
        matrix = compat.perspective_matrix(params)
        region = _region(matrix, (h, w), size, bool(self.perspective))
        tiles = _clip(tiles, region)
        if any(isinstance(t[0], Encoded) for t in tiles):  # the pixels at hand: as small tiles of their own
            tiles = [t if isinstance(t[0], Encoded) else _own_tile(*t) for t in tiles]
        else:
            x0, y0, x1, y1 = region
            tiles = [(_paint(tiles, region, c), x0, y0, x1, y1, 0, 0)]
        labels["tiles"] = tiles
        labels["warp"] = {"inverse": np.linalg.inv(matrix.astype(np.float64)), "size": size,
                          "perspective": bool(self.perspective)}
        labels["img"] = _stand_in(size[1], size[0], c)
        labels["resized_shape"] = size[::-1]
        return labels


class DeferredHSV(RandomHSV):
    """``RandomHSV`` that draws its gains and keeps the lookup tables (``hsv_lut``, 3 x 256)."""

    @override
    def apply_image(self, labels, params=None):
        if labels["img"].shape[-1] != 3 or not (self.hgain or self.sgain or self.vgain):
            return labels
        r = np.random.uniform(-1, 1, 3) * [self.hgain, self.sgain, self.vgain]  # the stock draw
        x = np.arange(0, 256, dtype=r.dtype)
        hue = ((x + r[0] * 180) % 180).astype(np.uint8)
        sat = np.clip(x * (r[1] + 1), 0, 255).astype(np.uint8)
        val = np.clip(x * (r[2] + 1), 0, 255).astype(np.uint8)
        sat[0] = 0  # as ultralytics: pure white stays white
        labels["hsv_lut"] = np.stack((hue, sat, val))
        return labels


class DeferredFlip(RandomFlip):
    """``RandomFlip`` that draws its flip, flips the labels and keeps the flip (``flips``: vertical,
    horizontal) for the image."""

    @override
    def apply_image(self, labels, params=None):
        flips = labels.setdefault("flips", [False, False])
        vertical, flipped = compat.flip_of(params)
        flips[0 if vertical else 1] |= flipped
        return labels


class DeferredFormat(Format):
    """``Format`` of the labels, with the BGR-to-RGB choice drawn (the image is the tiles)."""

    @override
    def apply_image(self, labels, params=None):
        img = labels.pop("img")
        labels["rgb"] = random.uniform(0, 1) > self.bgr and img.shape[-1] == 3  # the stock draw
        return labels


_DEFERRED = {Mosaic: DeferredMosaic, RandomPerspective: DeferredPerspective, RandomHSV: DeferredHSV,
             RandomFlip: DeferredFlip, Format: DeferredFormat}


def defer(transforms: Compose) -> Compose:
    """``transforms`` with the five transforms above swapped for their deferred subclasses, in
    place (nested ``Compose`` and the mix transforms' ``pre_transform`` included); returns it."""
    seen = set()

    def walk(compose):
        if id(compose) in seen:
            return
        seen.add(id(compose))
        for i, t in enumerate(compose.transforms):
            if type(t) in _DEFERRED:
                compose.transforms[i] = compat.retyped(t, _DEFERRED[type(t)])
            elif isinstance(t, Compose):
                walk(t)
            elif isinstance(getattr(t, "pre_transform", None), Compose):
                walk(t.pre_transform)

    walk(transforms)
    if not any(isinstance(t, DeferredFormat) for t in transforms.transforms):
        raise ValueError("defer: the transforms end without ultralytics' Format")
    return transforms


class _DeferredBuild:
    """A dataset's ``build_transforms`` whose result is deferred (``close_mosaic`` rebuilds)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __call__(self, hyp):
        return defer(type(self.dataset).build_transforms(self.dataset, hyp))


def install(dataset, hyp, *, pad: bool, decode: bool = False, resident=None) -> None:
    """Defer ``dataset``'s augmentation to the GPU: its transforms (now and when rebuilt) and its
    ``collate_fn`` (:class:`DeferredCollate`; ``pad``: followed by the padded labels); with
    ``decode``, its plain JPEGs' decoding too (:func:`trainfuse.ultralytics.augment.decode.install`,
    ``resident`` its :class:`~trainfuse.ultralytics.augment.decode.ResidentIndex`)."""
    dataset.build_transforms = _DeferredBuild(dataset)
    dataset.transforms = dataset.build_transforms(hyp)
    dataset.collate_fn = DeferredCollate(pad, resident if decode else None)
    if decode:
        decoding.install(dataset, resident)


@functools.cache
def _vector_block() -> int:
    return opencv_vector_block()


class DeferredCollate:
    """Collate the deferred samples: ultralytics' collate for the labels (final, as stock), and for
    the images, under the ``aug_`` keys (:data:`KEYS`) that
    :func:`~trainfuse.ultralytics.augment.batch.finish_batch` reads: the batch's sources (each
    image once) and the per-image table of their tiles
    (:func:`~trainfuse.ultralytics.augment.kernel.tile_table`), the HSV lookup tables (or None), the
    output size, the warp's kind and OpenCV's vector block; with ``pad``, the labels padded as
    :class:`~trainfuse.losses.detection.targets.PadTargets` pads them.

    The sources are the painted crops packed into one flat uint8 tensor (``aug_packed``); where
    images wait for the GPU's decoder, :func:`~trainfuse.ultralytics.augment.decode.pack_sources`'
    three tensors instead (``aug_sources`` and ``aug_jpeg`` stay on the host, in
    :class:`~trainfuse.ultralytics.augment.decode.HostTensor`)."""

    def __init__(self, pad: bool = False, resident=None) -> None:
        self.pad = pad
        self.resident = resident  # the decoder's ResidentIndex: the bytes of what it keeps stay home

    def __call__(self, samples: list[dict]) -> dict:
        tiles = [s.pop("tiles") for s in samples]
        warps = [s.pop("warp") for s in samples]
        luts = [s.pop("hsv_lut", None) for s in samples]
        flips = [s.pop("flips", [False, False]) for s in samples]
        swaps = [s.pop("rgb") for s in samples]
        batch = YOLODataset.collate_fn(samples)
        n = len(tiles)
        sources, slot, rows = [], {}, []
        for image_tiles in tiles:
            rows.append([])
            for img, *rect in image_tiles:
                key = ("jpeg", img.source[0]) if isinstance(img, Encoded) else ("raw", id(img))
                if key not in slot:
                    slot[key] = len(sources)
                    sources.append(img)
                rows[-1].append((slot[key], *rect))
        inverse = (torch.from_numpy(np.stack([w["inverse"] for w in warps]).reshape(n, 9)) if n
                   else torch.zeros(0, 9, dtype=torch.float64))
        batch["aug_table"] = tile_table([s.shape[:2] for s in sources], rows, inverse,
                                        torch.tensor(flips).reshape(n, 2), torch.tensor(swaps).reshape(n))
        if any(isinstance(s, Encoded) for s in sources):
            batch["aug_sources"], batch["aug_raw"], batch["aug_jpeg"] = decoding.pack_sources(sources,
                                                                                               self.resident)
        else:
            batch["aug_packed"] = (torch.cat([torch.from_numpy(s).reshape(-1) for s in sources]) if sources
                                   else torch.zeros(0, dtype=torch.uint8))
        batch["aug_luts"] = (None if all(lut is None for lut in luts) else torch.from_numpy(np.stack(
            [np.stack([np.arange(256, dtype=np.uint8)] * 3) if lut is None else lut for lut in luts])))
        batch["aug_size"] = warps[0]["size"] if n else (0, 0)
        batch["aug_perspective"] = bool(n and warps[0]["perspective"])
        batch["aug_vector_block"] = _vector_block()
        if self.pad:  # the labels are final: padded as PadTargets pads them (keypoints included)
            add_padded_targets(batch, batch_size=n)
        return batch


__all__ = ["DeferredCollate", "DeferredFlip", "DeferredFormat", "DeferredHSV", "DeferredMosaic",
           "DeferredPerspective", "KEYS", "defer", "install", "unsupported"]
