"""Ground truth padded to a fixed per-image capacity, and the anchor grid, without host syncs.

ultralytics' ``v8DetectionLoss.preprocess`` pads the labels to ``(B, max_targets, 5)`` with the
maximum count read from the GPU (a host sync every step, and a new shape whenever the maximum
changes). Here the capacity comes from the labels while they are still on the CPU
(:func:`target_capacity`, bucketed to a power of two so that shapes repeat), and the padding is a
few device ops whose shapes depend on that capacity only (:func:`pad_targets`).

Padding rows are all zeros: their boxes have a zero coordinate sum, which is ultralytics' own
test for a padding row (``mask_gt = gt_bboxes.sum(2) > 0``), so capacity beyond the maximum
count changes no result.
"""

from __future__ import annotations

import torch

PADDED_KEY = "padded_targets"
PADDED_KEYPOINTS_KEY = "padded_keypoints"  # pose batches: (B, capacity, K, 3), the rows of PADDED_KEY


def target_capacity(batch_idx: torch.Tensor, batch_size: int, *, bucket: bool = True) -> int:
    """The most labels any image of the batch has, rounded up to a power of two (at least 1).

    Args:
        batch_idx: image index of every label, shape ``(n,)`` or ``(n, 1)``. On the CPU this
            costs no sync; on a GPU it is one host sync (the fallback of
            :class:`~trainfuse.ultralytics.FusedDetectionLoss`).
        batch_size: images in the batch.
        bucket: round up to a power of two (shapes repeat across steps).

    Returns:
        The capacity, a Python int >= 1.

    Example:
        >>> target_capacity(torch.tensor([0.0, 0.0, 0.0, 2.0]), 3)
        4
    """
    if batch_idx.numel() == 0:
        return 1
    counts = torch.bincount(batch_idx.reshape(-1).long(), minlength=batch_size)
    n = max(int(counts.max()), 1)
    return 1 << (n - 1).bit_length() if bucket else n


def pad_targets(batch_idx: torch.Tensor, cls: torch.Tensor, bboxes: torch.Tensor, batch_size: int,
                capacity: int) -> torch.Tensor:
    """Labels as a ``(batch_size, capacity, 5)`` float32 tensor of ``(class, x, y, w, h)`` rows
    (boxes normalized, as in the batch; rotated boxes add their angle: 6 columns), each image's
    labels first in their batch order, zeros after. Sync-free on any device.

    Args:
        batch_idx: image index of every label, ``(n,)`` or ``(n, 1)``.
        cls: class of every label, ``(n,)`` or ``(n, 1)``.
        bboxes: normalized ``xywh`` boxes, ``(n, 4)``, or ``xywhr`` rotated ones, ``(n, 5)``.
        batch_size: images in the batch.
        capacity: rows per image, at least the largest count (see :func:`target_capacity`).

    Returns:
        The padded labels on the labels' device.

    Example:
        >>> pad_targets(torch.tensor([1.0]), torch.tensor([2.0]), torch.ones(1, 4), 2, 1)[:, 0, 0]
        tensor([0., 2.])
    """
    n = batch_idx.numel()
    if cls.numel() != n or bboxes.dim() != 2 or bboxes.shape[0] != n or bboxes.shape[1] not in (4, 5):
        raise ValueError(f"pad_targets: batch_idx has {n} labels, so cls must have {n} values and bboxes "
                         f"shape ({n}, 4) (or ({n}, 5): rotated boxes); got cls {tuple(cls.shape)}, bboxes "
                         f"{tuple(bboxes.shape)}")
    rows = torch.cat((cls.reshape(-1, 1).float(), bboxes.float()), 1)
    return pad_rows(batch_idx, rows, batch_size, capacity)


def pad_rows(batch_idx: torch.Tensor, rows: torch.Tensor, batch_size: int, capacity: int) -> torch.Tensor:
    """Per-label ``rows`` (``(n, ...)``) as a ``(batch_size, capacity, ...)`` float32 tensor, each
    image's rows first in their batch order, zeros after (:func:`pad_targets`' layout, so the
    same label has the same slot in both). Sync-free on any device.

    Example:
        >>> pad_rows(torch.tensor([1, 1]), torch.tensor([[1.0], [2.0]]), 2, 2)[..., 0]
        tensor([[0., 0.],
                [1., 2.]])
    """
    n = batch_idx.numel()
    if rows.shape[0] != n:
        raise ValueError(f"pad_rows: batch_idx has {n} labels, rows {rows.shape[0]}")
    device, tail = rows.device, tuple(rows.shape[1:])
    out = torch.zeros(batch_size * capacity, *tail, dtype=torch.float32, device=device)
    if n == 0:
        return out.view(batch_size, capacity, *tail)
    img = batch_idx.reshape(-1).long().to(device)
    # rank of each label within its image: position in a stable sort by image, minus the image's start
    order = torch.sort(img, stable=True).indices
    starts = torch.zeros(batch_size + 1, dtype=torch.long, device=device)
    starts.scatter_add_(0, img + 1, torch.ones_like(img))
    starts = starts.cumsum(0)
    rank = torch.empty_like(img)
    rank[order] = torch.arange(n, device=device) - starts[img[order]]
    # a label past the capacity would land in the next image: send it nowhere instead
    slot = torch.where(rank < capacity, img * capacity + rank, batch_size * capacity)
    out = torch.cat((out, out.new_zeros(1, *tail)))
    out.index_copy_(0, slot, rows.float())
    return out[:-1].view(batch_size, capacity, *tail)


def add_padded_targets(batch: dict, capacity: int | None = None, batch_size: int | None = None) -> dict:
    """Put the padded labels in ``batch[PADDED_KEY]`` while the batch is still on the CPU, so
    that the loss takes its capacity without a host sync: what a trainer calls before moving the
    batch to the GPU. Returns ``batch`` (changed in place).

    Args:
        batch: an ultralytics batch with ``img``, ``batch_idx``, ``cls`` and ``bboxes``.
        capacity: rows per image; default :func:`target_capacity` of the batch.
        batch_size: images in the batch; default ``len(batch["img"])`` (a batch whose images come
            later, as the GPU augmentation's, says it here).
    """
    size = batch["img"].shape[0] if batch_size is None else batch_size
    if capacity is None:
        capacity = target_capacity(batch["batch_idx"], size)
    batch[PADDED_KEY] = pad_targets(batch["batch_idx"], batch["cls"], batch["bboxes"], size, capacity)
    if "keypoints" in batch:  # a pose batch: its keypoints in the same slots
        batch[PADDED_KEYPOINTS_KEY] = pad_rows(batch["batch_idx"], batch["keypoints"], size, capacity)
    return batch


def device_values(like: torch.Tensor, values: tuple[float, ...]) -> torch.Tensor:
    """``values`` as a 1-D tensor of ``like``'s dtype on its device, written by fill launches: a
    Python number stored by indexing (``t[0] = w``) reaches a CUDA tensor as a copy from the host,
    which syncs (and has no place in a CUDA graph)."""
    out = like.new_empty(len(values))
    for i, v in enumerate(values):
        out[i:i + 1].fill_(v)
    return out


def label_pixels(padded: torch.Tensor, imgsz: tuple[float, float]) -> torch.Tensor:
    """The ``(B, M, 4)`` pixel ``xyxy`` boxes of padded labels (ultralytics' ``preprocess``
    scaling and ``xywh2xyxy``, op for op) for an image of ``imgsz = (h, w)`` pixels."""
    h, w = imgsz
    scale = device_values(padded, (w, h))
    xy = padded[..., 1:3] * scale
    half = padded[..., 3:5] * scale / 2
    return torch.cat((xy - half, xy + half), -1)


_anchor_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def anchor_grid(sizes: tuple[tuple[int, int], ...], strides: tuple[float, ...], device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """ultralytics' ``make_anchors(feats, strides, 0.5)`` in float32 from the levels' ``(h, w)``:
    cell centres ``(A, 2)`` in grid units and each anchor's stride ``(A, 1)``, kept per shape (the
    grid of a training run never changes)."""
    key = (sizes, strides, device)
    hit = _anchor_cache.get(key)
    if hit is None:
        points, stride = [], []
        for (h, w), s in zip(sizes, strides):
            # made on the device (a copy from the host would sync, and stop a CUDA-graph capture)
            sy, sx = torch.meshgrid(torch.arange(h, dtype=torch.float32, device=device) + 0.5,
                                    torch.arange(w, dtype=torch.float32, device=device) + 0.5, indexing="ij")
            points.append(torch.stack((sx, sy), -1).view(-1, 2))
            stride.append(torch.full((h * w, 1), float(s), device=device))
        hit = _anchor_cache[key] = (torch.cat(points), torch.cat(stride))
    return hit


class PadTargets:
    """A dataset's ``collate_fn`` followed by :func:`~trainfuse.ultralytics.add_padded_targets`:
    the labels padded to a capacity read from the CPU-side counts, in the loader's workers, off
    the training loop's thread (~0.1 ms a batch)."""

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, samples: list[dict]) -> dict:
        return add_padded_targets(self.collate(samples))


__all__ = ["PADDED_KEY", "PADDED_KEYPOINTS_KEY", "PadTargets", "add_padded_targets", "anchor_grid",
           "device_values", "label_pixels", "pad_rows", "pad_targets", "target_capacity"]
