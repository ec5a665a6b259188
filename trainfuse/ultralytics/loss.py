"""FusedDetectionLoss: ultralytics' ``v8DetectionLoss`` without host syncs, fused.

Same constructor (``model, tal_topk=10, tal_topk2=None``), same call (``preds, batch``), same
result: ``(loss * batch_size, {"box_loss", "cls_loss", "dfl_loss"})`` with ``loss`` the three
gain-scaled terms (``hyp.box``, ``hyp.cls``, ``hyp.dfl``; ``model.class_weights`` if set)::

    box = sum_fg t (1 - CIoU(pred, target)) / tss       (see box_loss.py)
    dfl = sum_fg t DFL(logits, target) / tss
    cls = sum_{b, a, c} w_c BCE(score, t one_hot(label)) / tss   (see cls_loss.py)

with the TaskAlignedAssigner's ``t``, labels and ``tss = max(sum t, 1)`` (see assigner.py). A
head without DFL (``reg_max = 1``: YOLO26) predicts the distances themselves, and its third term
is ultralytics' ``l1_loss`` (the L1 distance of the ltrb distances over the image size, same
weights, ``hyp.dfl`` gain), named so in the items.

No ``.nonzero()``, boolean indexing or ``.item()`` inside, and every shape depends only on the
batch size, the anchors and the ground-truth capacity, so a step can be captured in a CUDA graph.
The capacity comes from ``batch["padded_targets"]`` when the trainer has put it there on the CPU
(:func:`~trainfuse.losses.detection.targets.add_padded_targets`); a batch without it costs one host
sync (the largest label count, read from ``batch_idx``) when ``batch_idx`` is on the GPU.

On CUDA tensors (or ``TRAINFUSE_BACKEND=triton``) the work is 6 launches forward (the assigner's
metric, top-k, resolve and target scores; box+DFL or box+L1; BCE; a second k adds the assigner's
``topk2``) and 2 backward, nothing else; elsewhere the same math runs as dense torch operations
(there float64 predictions stay float64; so they do on a GPU, and a reg_max that is not a power
of two takes that path too: YOLOv8 to YOLO11 and YOLOv10 have 16, YOLO26 has 1).
The kernels compute in float32 whatever the predictions' dtype (ultralytics runs parts of the
loss in float16 under AMP); grads come back in the predictions' dtypes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from trainfuse._runtime.backend import use_triton
from trainfuse.losses.detection import (
    PADDED_KEY,
    AssignConfig,
    Assignment,
    LossConstants,
    anchor_grid,
    apply_detection_loss,
    assign_kernels,
    assign_torch,
    loss_terms_torch,
    pad_targets,
    target_capacity,
)


class FusedDetectionLoss:
    """Drop-in for ultralytics' ``v8DetectionLoss`` (see the module docstring).

    Args:
        model: the de-paralleled ``DetectionModel``: reads ``model.args`` (the ``box``, ``cls``,
            ``dfl`` gains), ``model.model[-1]`` (``nc``, ``reg_max``, ``stride``), the device of
            its parameters and ``model.class_weights`` if set.
        tal_topk: the assigner's k.
        tal_topk2: its second k (None: ``tal_topk``): of the anchors each ground truth keeps,
            only its ``tal_topk2`` best stay positive (one more assigner launch).

    Attributes:
        graph_keys: the batch keys besides ``"img"`` a training step reads (the padded labels):
            the inputs of the step's CUDA graphs.

    Example:
        >>> from ultralytics.nn.tasks import DetectionModel                      # doctest: +SKIP
        >>> model.criterion = FusedDetectionLoss(model)                          # doctest: +SKIP
        >>> loss, items = model.loss(batch)                                      # doctest: +SKIP
    """

    graph_keys: tuple[str, ...] | None = (PADDED_KEY,)

    def __init__(self, model: torch.nn.Module, tal_topk: int = 10, tal_topk2: int | None = None) -> None:
        device = next(model.parameters()).device
        head = model.model[-1]
        self.hyp = model.args
        self.stride = head.stride
        self.nc = head.nc
        self.no = head.nc + head.reg_max * 4
        self.reg_max = head.reg_max
        self.device = device
        self.use_dfl = head.reg_max > 1
        self.loss_names = "box_loss", "cls_loss", "dfl_loss" if self.use_dfl else "l1_loss"
        cw = getattr(model, "class_weights", None)
        self.class_weights = None if cw is None else cw.to(device=device, dtype=torch.float32).reshape(-1)
        strides = [float(s) for s in self.stride.tolist()]
        self.assign_config = AssignConfig(topk=tal_topk, topk2=tal_topk2 or tal_topk, alpha=0.5, beta=6.0,
                                          stride_val=strides[1] if len(strides) > 1 else strides[0])
        self._strides = tuple(strides)

    def parse_output(self, preds: dict | tuple) -> dict[str, Any]:
        """The training outputs dict (the second element of an ``(inference, dict)`` tuple)."""
        return preds[1] if isinstance(preds, tuple) else preds

    def __call__(self, preds: dict | tuple, batch: dict[str, torch.Tensor]
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss * batch_size, {name: detached term})``, as ``v8DetectionLoss``."""
        return self.loss(self.parse_output(preds), batch)

    def targets(self, batch: dict[str, torch.Tensor], batch_size: int, device: torch.device) -> torch.Tensor:
        """The padded labels ``(B, M, 5)``: class and normalized ``xywh``, float32, zero rows as
        padding (``batch[PADDED_KEY]`` if the trainer put them there)."""
        padded = batch.get(PADDED_KEY)
        if padded is None:
            # fallback for a batch the trainer did not prepare: one host sync for the capacity
            # when batch_idx is on the GPU (none on the CPU)
            cap = target_capacity(batch["batch_idx"], batch_size)
            padded = pad_targets(batch["batch_idx"], batch["cls"], batch["bboxes"], batch_size, cap)
        if padded.dim() != 3 or padded.shape[0] != batch_size or padded.shape[-1] != 5:
            raise ValueError(f"FusedDetectionLoss: batch[{PADDED_KEY!r}] must have shape ({batch_size}, "
                             f"capacity, 5), got {tuple(padded.shape)}")
        return padded.to(device=device, dtype=torch.float32, non_blocking=True).contiguous()

    def loss(self, preds: dict[str, Any], batch: dict[str, torch.Tensor], gt: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of ``preds`` (``boxes (B, 4 reg_max, A)``, ``scores (B, nc, A)``, ``feats``);
        ``gt``: the padded labels :meth:`targets` gives for ``batch``, where the caller has them."""
        out, items, _ = self.detection(preds, batch, gt)
        return out, dict(zip(self.loss_names, items))

    def detection(self, preds: dict[str, Any], batch: dict[str, torch.Tensor], gt: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, Assigned]:
        """The three terms as :meth:`loss` weighs them: ``(out, items, assigned)``, ``out`` the
        gain-scaled terms times the batch size (differentiable), ``items`` the gain-scaled terms
        (detached), and what the assigner decided, for the losses built on this one."""
        boxes, scores, feats = preds["boxes"], preds["scores"], preds["feats"]
        B, _, A = scores.shape
        if boxes.shape != (B, 4 * self.reg_max, A) or scores.shape[1] != self.nc:
            raise ValueError(f"{type(self).__name__}: preds['boxes'] must be ({B}, {4 * self.reg_max}, {A}) "
                             f"and preds['scores'] ({B}, {self.nc}, {A}); got {tuple(boxes.shape)}, "
                             f"{tuple(scores.shape)}")
        dev = scores.device
        sizes = tuple((int(f.shape[2]), int(f.shape[3])) for f in feats)
        anchors, stride_col = anchor_grid(sizes, self._strides, dev)
        strides = stride_col.view(-1)
        imgsz = (sizes[0][0] * self._strides[0], sizes[0][1] * self._strides[0])
        if gt is None:
            gt = self.targets(batch, B, dev)
        gains = (float(self.hyp.box), float(self.hyp.cls), float(self.hyp.dfl))
        boxes, scores = boxes.contiguous(), scores.contiguous()
        # the kernels compute in float32: float64 predictions stay float64 on the torch path
        fused = (use_triton(dev) and boxes.dtype != torch.float64 and scores.dtype != torch.float64
                 and self.reg_max & (self.reg_max - 1) == 0)
        with torch.autocast(dev.type, enabled=False):
            asg = self.assign(boxes.detach(), scores.detach(), gt, imgsz, anchors, strides, preds, batch,
                              fused=fused)
            if fused:
                k = LossConstants(float(imgsz[0]), float(imgsz[1]), gains, float(B), self.reg_max - 1 - 0.01)
                out, items = apply_detection_loss(boxes, scores, asg, gt, anchors, strides,
                                                         self.class_weights, k)
            else:
                items = loss_terms_torch(boxes, scores, asg, gt, imgsz, anchors, strides, self.class_weights)
                items = items * items.new_tensor(gains)
                out = items * B
                items = items.detach()
        return out, items, Assigned(asg, gt, anchors, stride_col, imgsz)

    def assign(self, boxes: torch.Tensor, scores: torch.Tensor, gt: torch.Tensor, imgsz: tuple[float, float],
               anchors: torch.Tensor, strides: torch.Tensor, preds: dict[str, Any],
               batch: dict[str, torch.Tensor], *, fused: bool) -> Assignment:
        """The task-aligned assignment of the (detached) predictions to the padded labels ``gt``:
        the detection kernels' (``fused``) or the dense torch path's. Losses whose assigner reads
        more of the predictions or labels (``preds``, ``batch``) override it."""
        assign = assign_kernels if fused else assign_torch
        return assign(boxes, scores, gt, imgsz, anchors, strides, self.assign_config)


class Assigned(NamedTuple):
    """What :meth:`FusedDetectionLoss.detection` decided, for the losses built on it: the
    assignment (``gidx``: each anchor's row of ``gt``, -1 on background), the padded labels
    ``gt (B, M, 5)``, the anchor centres ``(A, 2)`` in grid units, their strides ``(A, 1)`` and
    the image size ``(h, w)`` in pixels."""

    assignment: Assignment
    gt: torch.Tensor
    anchors: torch.Tensor
    strides: torch.Tensor
    imgsz: tuple[float, float]


__all__ = ["Assigned", "FusedDetectionLoss"]
