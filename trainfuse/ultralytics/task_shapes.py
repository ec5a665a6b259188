"""Synthetic datasets for ultralytics' other tasks, made offline like
:func:`~trainfuse.ultralytics.shapes.make_shapes_dataset`: polygons with their masks (``segment``),
figures with keypoints (``pose``), rotated rectangles (``obb``) and class folders (``classify``).

Every object is a filled polygon on the same textured background as the detection shapes, drawn
from the polygon its label gives, so the labels are exact: a segment's polygon is its mask's
outline, a pose figure's keypoints are its corners, an oriented box is the rectangle drawn. The
class is the shape (and its hue). Deterministic from the seed (numpy's PCG64; OpenCV only
rasterizes). Layouts are ultralytics' own::

    segment, pose, obb: root/data.yaml, root/images/{train,val}/00000.jpg, root/labels/{train,val}/00000.txt
    classify:           root/{train,val}/<class>/00000.jpg  (``data=root``)

A ``root/shapes.json`` records the arguments: calling again with the same ones reuses the files.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from trainfuse.ultralytics.shapes import _HUES, _JITTER, _background

TASKS = ("segment", "pose", "obb", "classify")
# the classes of each task: polygons whose outline is the whole object (no holes)
CLASSES = {
    "segment": ("box", "ellipse", "triangle", "cross"),
    "pose": ("figure",),
    "obb": ("plate", "bar", "tile"),
    "classify": ("box", "ellipse", "triangle", "cross"),
}
KPT_SHAPE = (4, 3)  # pose: each figure's four corners, x y visibility
FLIP_IDX = (1, 0, 3, 2)  # corners top-left, top-right, bottom-right, bottom-left: a left-right flip swaps
_OBB_ASPECT = {"plate": (1.0, 1.6), "bar": (3.0, 5.0), "tile": (1.0, 1.1)}  # long side / short side


def _polygon(rng: np.random.Generator, name: str, cx: float, cy: float, w: float, h: float) -> np.ndarray:
    """The outline (n x 2, pixels) of a shape of class ``name`` in the box centred at (cx, cy)."""
    x1, y1, x2, y2 = cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2
    if name == "box":
        return np.array([[x1, y1], [x2, y1], [x2, y2], [x1, y2]])
    if name == "ellipse":
        t = np.linspace(0, 2 * math.pi, 24, endpoint=False)
        return np.stack([cx + w / 2 * np.cos(t), cy + h / 2 * np.sin(t)], 1)
    if name == "triangle":
        return np.array([[cx, y1], [x2, y2], [x1, y2]])
    # cross: two bars of a third of the box, as one 12-corner outline
    a, b = w / 6, h / 6
    return np.array([[cx - a, y1], [cx + a, y1], [cx + a, cy - b], [x2, cy - b], [x2, cy + b],
                     [cx + a, cy + b], [cx + a, y2], [cx - a, y2], [cx - a, cy + b], [x1, cy + b],
                     [x1, cy - b], [cx - a, cy - b]])


def _rotated(cx: float, cy: float, w: float, h: float, angle: float) -> np.ndarray:
    """The corners of a w x h rectangle centred at (cx, cy), turned by ``angle`` (radians), in the
    order top-left, top-right, bottom-right, bottom-left of the unturned rectangle."""
    c, s = math.cos(angle), math.sin(angle)
    local = np.array([[-w / 2, -h / 2], [w / 2, -h / 2], [w / 2, h / 2], [-w / 2, h / 2]])
    return local @ np.array([[c, s], [-s, c]]) + [cx, cy]


def _color(rng: np.random.Generator, cls: int) -> tuple[int, ...]:
    jitter = rng.integers(-_JITTER, _JITTER + 1, 3)
    return tuple(int(np.clip(c + j, 0, 255)) for c, j in zip(_HUES[cls % len(_HUES)], jitter))


def _fill(img: np.ndarray, points: np.ndarray, color: tuple[int, ...]) -> None:
    import cv2

    cv2.fillPoly(img, [np.round(points).astype(np.int32)], color, lineType=cv2.LINE_AA)


def _label(task: str, cls: int, points: np.ndarray, size: int, visible: np.ndarray | None = None) -> str:
    """One label line: ``cls`` then the task's coordinates, normalized by the image ``size``."""
    p = np.clip(points / size, 0.0, 1.0)
    if task == "pose":
        x1, y1 = p.min(0)
        x2, y2 = p.max(0)
        kpts = " ".join(f"{x:.6f} {y:.6f} {v:d}" for (x, y), v in zip(p, visible))
        return f"{cls} {(x1 + x2) / 2:.6f} {(y1 + y2) / 2:.6f} {x2 - x1:.6f} {y2 - y1:.6f} {kpts}"
    return f"{cls} " + " ".join(f"{x:.6f} {y:.6f}" for x, y in p)


def _objects(rng: np.random.Generator, task: str, size: int, nc: int, count: int):
    """``count`` objects of ``task``: (class, outline in pixels, keypoint visibility or None)."""
    names = CLASSES[task]
    for _ in range(count):
        cls = int(rng.integers(0, nc))
        if task == "obb":
            short = rng.uniform(0.05, 0.15) * size
            long = short * rng.uniform(*_OBB_ASPECT[names[cls]])
            reach = math.hypot(short, long) / 2
            cx, cy = rng.uniform(reach, size - reach, 2)
            yield cls, _rotated(cx, cy, long, short, rng.uniform(0, math.pi)), None
        elif task == "pose":
            w, h = rng.uniform(0.1, 0.3, 2) * size
            reach = math.hypot(w, h) / 2
            cx, cy = rng.uniform(reach, size - reach, 2)
            corners = _rotated(cx, cy, w, h, rng.uniform(-0.6, 0.6))
            corners += rng.uniform(-0.08, 0.08, (4, 2)) * [w, h]  # a quadrilateral, not a rectangle
            # some corners labelled as occluded (ultralytics' visibility 1): in the image, not seen
            yield cls, corners, np.where(rng.random(4) < 0.15, 1, 2)
        else:
            w, h = rng.uniform(0.1, 0.35, 2) * size
            cx, cy = rng.uniform(w / 2, size - w / 2), rng.uniform(h / 2, size - h / 2)
            yield cls, _polygon(rng, names[cls], cx, cy, w, h), None


def _image(rng: np.random.Generator, task: str, size: int, nc: int, max_objects: int):
    img = _background(rng, size, size, False)
    lines = []
    count = 1 if task == "classify" else int(rng.integers(1, max_objects + 1))
    for cls, points, visible in _objects(rng, task, size, nc, count):
        _fill(img, points, _color(rng, cls))
        lines.append(_label(task, cls, points, size, visible))
    return img, lines


def make_task_dataset(root: str | Path, task: str, n_train: int = 256, n_val: int = 64, imgsz: int = 640,
                      seed: int = 0, nc: int | None = None, max_objects: int = 6) -> Path:
    """Write the ``task``'s dataset under ``root`` (or reuse it when made with the same arguments).

    Args:
        root: the dataset folder (created).
        task: ``"segment"``, ``"pose"``, ``"obb"`` or ``"classify"``.
        n_train: training images (for ``classify``, in all, spread over the classes).
        n_val: validation images.
        imgsz: image side in pixels (square images).
        seed: every pixel and label follows from it.
        nc: number of classes, 1 to ``len(CLASSES[task])`` (None: all of them).
        max_objects: each image holds 1 to ``max_objects`` objects (``classify``: one).

    Returns:
        What ``YOLO(...).train(data=...)`` takes: the path of ``data.yaml``, or for ``classify``
        the dataset folder.
    """
    import cv2

    if task not in TASKS:
        raise ValueError(f"make_task_dataset: task={task!r}; expected one of {', '.join(map(repr, TASKS))}")
    names = CLASSES[task]
    nc = len(names) if nc is None else nc
    if not 1 <= nc <= len(names):
        raise ValueError(f"make_task_dataset: nc={nc} for task {task!r}; expected 1 to {len(names)}")
    if n_train < 1 or n_val < 1 or imgsz < 32 or max_objects < 1:
        raise ValueError(f"make_task_dataset: n_train={n_train}, n_val={n_val}, imgsz={imgsz}, max_objects="
                         f"{max_objects}; expected n_train, n_val, max_objects >= 1 and imgsz >= 32")
    root = Path(root)
    spec = {"task": task, "n_train": n_train, "n_val": n_val, "imgsz": imgsz, "seed": seed, "nc": nc,
            "max_objects": max_objects, "version": 1}
    marker = root / "shapes.json"
    target = root if task == "classify" else root / "data.yaml"
    if marker.exists() and target.exists() and json.loads(marker.read_text()) == spec:
        return target
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("val", n_val)):
        folders = ([root / split / names[c] for c in range(nc)] if task == "classify"
                   else [root / "images" / split, root / "labels" / split])
        for folder in folders:
            folder.mkdir(parents=True, exist_ok=True)
            for old in folder.iterdir():  # a different earlier dataset must not leave files behind
                old.unlink()
        for i in range(n):
            img, lines = _image(rng, task, imgsz, nc, max_objects)
            if task == "classify":
                cls = int(lines[0].split()[0])
                path = root / split / names[cls] / f"{i:05d}.jpg"
                cv2.imwrite(str(path), img, [cv2.IMWRITE_JPEG_QUALITY, 95])
                continue
            cv2.imwrite(str(root / "images" / split / f"{i:05d}.jpg"), img, [cv2.IMWRITE_JPEG_QUALITY, 95])
            (root / "labels" / split / f"{i:05d}.txt").write_text("\n".join(lines) + "\n")
    for cache in root.glob("labels/*.cache"):  # ultralytics' label cache of an earlier dataset
        cache.unlink()
    if task != "classify":
        listed = "".join(f"  {k}: {names[k]}\n" for k in range(nc))
        extra = f"kpt_shape: {list(KPT_SHAPE)}\nflip_idx: {list(FLIP_IDX)}\n" if task == "pose" else ""
        target.write_text(f"path: {root.resolve()}\ntrain: images/train\nval: images/val\n{extra}"
                          f"names:\n{listed}")
    marker.write_text(json.dumps(spec))
    return target


__all__ = ["CLASSES", "FLIP_IDX", "KPT_SHAPE", "TASKS", "make_task_dataset"]
