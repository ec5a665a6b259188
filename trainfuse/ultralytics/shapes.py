"""A synthetic detection dataset: shapes of several classes on textured backgrounds, YOLO labels.

Deterministic from its seed (numpy's PCG64 draws every choice, OpenCV only rasterizes) and offline:
nothing is downloaded. Photo-like images are drawn and encoded in worker processes, each image from
its own seed (its split, its index and the dataset's seed). The class is the shape; each class has
its own hue, jittered per object, so that a YOLOv5n trained from scratch learns it in a few epochs.
Layout::

    root/data.yaml
    root/images/{train,val}/00000.jpg ...
    root/labels/{train,val}/00000.txt      # "cls xc yc w h", normalized

A ``root/shapes.json`` records the arguments: calling again with the same ones reuses the files.
Needs OpenCV and numpy (both ultralytics dependencies), not torch.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

CLASSES = ("box", "ellipse", "triangle", "frame", "cross")
# BGR base colour of each class; each object's colour is this, jittered
_HUES = ((60, 60, 230), (60, 210, 60), (230, 90, 40), (40, 200, 230), (200, 60, 200))
_JITTER = 40  # per-channel colour jitter: the hue identifies the class, the shade varies
_SIZE = (0.06, 0.3)  # object width and height, as fractions of the image side


def _background(rng: np.random.Generator, w: int, h: int, photo: bool) -> np.ndarray:
    """A textured background: a smooth colour field, fine noise and a few dim random lines; with
    ``photo``, a busier field and stronger grain, which JPEG compresses about as badly as a photo."""
    import cv2

    coarse = rng.integers(0, 110, (12, 16, 3) if photo else (4, 4, 3), dtype=np.uint8)
    img = cv2.resize(coarse, (w, h), interpolation=cv2.INTER_CUBIC)
    grain = 30 if photo else 20
    noise = rng.integers(-grain, grain + 1, (h, w, 3), dtype=np.int16)
    img = np.clip(img.astype(np.int16) + noise, 0, 255).astype(np.uint8)
    for _ in range(int(rng.integers(2, 7))):
        if photo:
            p1 = (int(rng.integers(0, w)), int(rng.integers(0, h)))
            p2 = (int(rng.integers(0, w)), int(rng.integers(0, h)))
        else:  # square: the draws of the datasets made before photos existed
            p1 = tuple(int(v) for v in rng.integers(0, w, 2))
            p2 = tuple(int(v) for v in rng.integers(0, w, 2))
        shade = tuple(int(v) for v in rng.integers(40, 120, 3))
        cv2.line(img, p1, p2, shade, max(1, min(w, h) // 160))
    return img


def _draw(img: np.ndarray, cls: int, box: tuple[int, int, int, int], color: tuple[int, ...]) -> None:
    import cv2

    x1, y1, x2, y2 = box
    cx, cy, w, h = (x1 + x2) // 2, (y1 + y2) // 2, x2 - x1, y2 - y1
    thick = max(2, min(w, h) // 6)
    if CLASSES[cls] == "box":
        cv2.rectangle(img, (x1, y1), (x2, y2), color, -1)
    elif CLASSES[cls] == "ellipse":
        cv2.ellipse(img, (cx, cy), (max(w // 2, 1), max(h // 2, 1)), 0, 0, 360, color, -1)
    elif CLASSES[cls] == "triangle":
        pts = np.array([[cx, y1], [x2, y2], [x1, y2]], dtype=np.int32)
        cv2.fillPoly(img, [pts], color)
    elif CLASSES[cls] == "frame":
        half = thick // 2
        cv2.rectangle(img, (x1 + half, y1 + half), (x2 - half, y2 - half), color, thick)
    else:  # cross
        cv2.rectangle(img, (cx - thick // 2, y1), (cx + thick // 2, y2), color, -1)
        cv2.rectangle(img, (x1, cy - thick // 2), (x2, cy + thick // 2), color, -1)


def _image(rng: np.random.Generator, width: int, height: int, nc: int, max_objects: int,
           photo: bool = False) -> tuple[np.ndarray, list[str]]:
    img = _background(rng, width, height, photo)
    lines = []
    for _ in range(int(rng.integers(1, max_objects + 1))):
        cls = int(rng.integers(0, nc))
        w, h = rng.uniform(*_SIZE, 2)
        xc, yc = rng.uniform(w / 2, 1 - w / 2), rng.uniform(h / 2, 1 - h / 2)
        x1, y1 = math.floor((xc - w / 2) * width), math.floor((yc - h / 2) * height)
        x2, y2 = math.ceil((xc + w / 2) * width) - 1, math.ceil((yc + h / 2) * height) - 1
        jitter = rng.integers(-_JITTER, _JITTER + 1, 3)
        color = tuple(int(np.clip(c + j, 0, 255)) for c, j in zip(_HUES[cls], jitter))
        _draw(img, cls, (x1, y1, x2, y2), color)
        lines.append(f"{cls} {xc:.6f} {yc:.6f} {w:.6f} {h:.6f}")
    return img, lines


def _photo_job(job: tuple) -> None:
    """Draw and write one photo-like image and its labels, from the image's own seed."""
    import cv2

    images, labels, i, key, imgsz, nc, max_objects = job
    img, lines = _image(np.random.default_rng(list(map(int, key))), imgsz, imgsz * 3 // 4, nc, max_objects,
                        photo=True)
    cv2.imwrite(str(images / f"{i:05d}.jpg"), img, [cv2.IMWRITE_JPEG_QUALITY, 95])
    (labels / f"{i:05d}.txt").write_text("\n".join(lines) + "\n")


def make_shapes_dataset(root: str | Path, n_train: int = 512, n_val: int = 64, imgsz: int = 640,
                        seed: int = 0, nc: int = len(CLASSES), max_objects: int = 8,
                        photo: bool = False, distinct: int | None = None) -> Path:
    """Write the dataset under ``root`` (or reuse it when made with the same arguments).

    Args:
        root: the dataset folder (created).
        n_train: training images.
        n_val: validation images.
        imgsz: image side in pixels (square images); with ``photo``, the width (4:3 images).
        seed: every pixel and label follows from it.
        nc: number of classes, 1 to ``len(CLASSES)`` (the first ``nc`` shapes).
        max_objects: each image holds 1 to ``max_objects`` shapes (they may overlap).
        photo: 4:3 images whose grain makes JPEGs of a photo's size (about 190 KB at 640 x 480,
            COCO's size), for benchmarks of a loader that decodes every image every epoch.
        distinct: draw only this many training images; the rest are their copies (hard links),
            image ``i`` a copy of image ``i % distinct``: a large dataset to read and decode
            without the time to draw it. None: every image drawn.

    Returns:
        The path of ``data.yaml``, ready for ``YOLO(...).train(data=...)``.
    """
    import cv2

    if not 1 <= nc <= len(CLASSES):
        raise ValueError(f"make_shapes_dataset: nc={nc}; expected 1 to {len(CLASSES)}")
    if n_train < 1 or n_val < 1:
        raise ValueError(f"make_shapes_dataset: n_train={n_train}, n_val={n_val}; expected at least 1 each")
    if imgsz < 32 or max_objects < 1:
        raise ValueError(f"make_shapes_dataset: imgsz={imgsz}, max_objects={max_objects}; expected "
                         "imgsz >= 32 and max_objects >= 1")
    root = Path(root)
    if distinct is not None and distinct < 1:
        raise ValueError(f"make_shapes_dataset: distinct={distinct}; expected at least 1 or None")
    spec = {"n_train": n_train, "n_val": n_val, "imgsz": imgsz, "seed": seed, "nc": nc,
            "max_objects": max_objects, "version": 2 if photo else 1, **({"photo": True} if photo else {}),
            **({"distinct": distinct} if distinct is not None and distinct < n_train else {})}
    marker, yaml = root / "shapes.json", root / "data.yaml"
    if marker.exists() and yaml.exists() and json.loads(marker.read_text()) == spec:
        return yaml
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("val", n_val)):
        images, labels = root / "images" / split, root / "labels" / split
        for folder in (images, labels):
            folder.mkdir(parents=True, exist_ok=True)
            for old in folder.iterdir():  # a different earlier dataset must not leave files behind
                old.unlink()
        drawn = min(n, distinct) if split == "train" and distinct else n
        if photo:
            jobs = [(images, labels, i, (seed, split == "val", i), imgsz, nc, max_objects)
                    for i in range(drawn)]
            workers = min(os.cpu_count() or 1, max(1, drawn // 32), 16)
            if workers > 1:
                import multiprocessing

                context = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
                with context.Pool(workers) as pool:
                    pool.map(_photo_job, jobs, chunksize=8)
            else:
                for job in jobs:
                    _photo_job(job)
        for i in range(0 if photo else drawn):
            img, lines = _image(rng, imgsz, imgsz, nc, max_objects)
            cv2.imwrite(str(images / f"{i:05d}.jpg"), img, [cv2.IMWRITE_JPEG_QUALITY, 95])
            (labels / f"{i:05d}.txt").write_text("\n".join(lines) + "\n")
        for i in range(drawn, n):  # copies of the drawn images
            os.link(images / f"{i % drawn:05d}.jpg", images / f"{i:05d}.jpg")
            (labels / f"{i:05d}.txt").write_text((labels / f"{i % drawn:05d}.txt").read_text())
    for cache in root.glob("labels/*.cache"):  # ultralytics' label cache of an earlier dataset
        cache.unlink()
    names = "".join(f"  {k}: {CLASSES[k]}\n" for k in range(nc))
    yaml.write_text(f"path: {root.resolve()}\ntrain: images/train\nval: images/val\nnames:\n{names}")
    marker.write_text(json.dumps(spec))
    return yaml


__all__ = ["CLASSES", "make_shapes_dataset"]
