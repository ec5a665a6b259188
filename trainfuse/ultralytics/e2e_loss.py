"""FusedE2ELoss: ultralytics' ``E2ELoss`` (YOLOv10, YOLO26) on two fused branch losses
(FusedDetectionLoss; FusedPose26Loss for YOLO26's pose head, ``E2ELoss(model, PoseLoss26)``).

An end-to-end head trains two heads on the same features: one-to-many (the assigner's ``k = 10``)
and one-to-one (``k = 7``, then each ground truth keeps only its best anchor: ``k2 = 1``). The
loss is their weighted sum, the items are the one-to-one branch's::

    loss  = o2m * loss_one2many + o2o * loss_one2one      (each: terms * batch_size)
    o2m   = max(1 - updates / max(epochs - 1, 1), 0) * (0.8 - 0.1) + 0.1
    o2o   = max(1 - o2m, 0)

``updates`` counts :meth:`FusedE2ELoss.update` calls: ultralytics' trainer makes one at the end of
every epoch (``criterion.update()``), and on resume it sets ``updates = start_epoch - 1`` and
calls it once more. YOLOv10's head has DFL (``reg_max = 16``); YOLO26's has none (``reg_max = 1``),
its third term being ``l1_loss``.

What the branches share: the padded labels (one ``targets`` call, so a batch without
``padded_targets`` costs its one host sync once, not twice) and the anchor grid (cached per
shape). Their predictions differ, so each runs its own assignment and loss kernels. The weights
``o2m`` and ``o2o`` live in one device tensor that :meth:`update` fills in place: a CUDA graph
captured with the loss reads the new weights on every replay, and nothing syncs with the host.
"""

from __future__ import annotations

from typing import Any

import torch

from trainfuse.ultralytics.loss import FusedDetectionLoss


def takes_fused_e2e_loss(model: torch.nn.Module) -> bool:
    """Whether :class:`FusedE2ELoss` implements ``model``'s loss: a plain ultralytics
    ``DetectionModel`` whose ``Detect`` head (``v10Detect`` included) has both its one-to-many and
    one-to-one branches, which ``DetectionModel.init_criterion`` trains with ``E2ELoss``."""
    from ultralytics.nn.modules.head import Detect
    from ultralytics.nn.tasks import DetectionModel

    if type(model) is not DetectionModel:  # segment, pose, obb, world, ...: other losses
        return False
    head = model.model[-1]
    return (isinstance(head, Detect) and getattr(head, "cv2", None) is not None
            and getattr(head, "one2one_cv2", None) is not None)


class FusedE2ELoss:
    """Drop-in for ultralytics' ``E2ELoss`` over ``v8DetectionLoss`` (see the module docstring).

    Args:
        model: the de-paralleled ``DetectionModel`` with an end-to-end head
            (:func:`takes_fused_e2e_loss`); read as :class:`FusedDetectionLoss` reads it, and
            ``model.args.epochs`` for the schedule.
        branch: the loss of each branch (``E2ELoss``'s ``loss_fn``): FusedDetectionLoss, or
            :class:`~trainfuse.ultralytics.pose26_loss.FusedPose26Loss` for YOLO26's pose head.

    Attributes:
        one2many, one2one: the branches, FusedDetectionLoss with ``tal_topk=10`` and with
            ``tal_topk=7, tal_topk2=1``.
        o2m, o2o: the branches' weights (floats; setting one also sets the device copy the loss
            multiplies by).
        updates: :meth:`update` calls so far; ``o2m_copy``, ``final_o2m``, ``total``: the
            schedule's start, end and sum, as in ``E2ELoss``.
        loss_names: the items' names, the one-to-one branch's.
        graph_keys: the batch keys besides ``"img"`` a training step reads (the branch's).

    Example:
        >>> model.criterion = FusedE2ELoss(model)                                # doctest: +SKIP
        >>> loss, items = model.loss(batch)                                      # doctest: +SKIP
        >>> model.criterion.update()  # at each epoch's end, as ultralytics' trainer does  # doctest: +SKIP
    """

    def __init__(self, model: torch.nn.Module, branch: type = FusedDetectionLoss) -> None:
        self.one2many = branch(model, tal_topk=10)
        self.one2one = branch(model, tal_topk=7, tal_topk2=1)
        self.graph_keys = self.one2one.graph_keys
        self.loss_names = self.one2one.loss_names
        self.weights = torch.empty(2, dtype=torch.float32, device=self.one2one.device)
        self.updates = 0
        self.total = 1.0
        self.o2m = 0.8
        self.o2o = self.total - self.o2m
        self.o2m_copy = self.o2m
        self.final_o2m = 0.1

    @property
    def o2m(self) -> float:
        return self._o2m

    @o2m.setter
    def o2m(self, value: float) -> None:
        self._o2m = value
        self.weights[0].fill_(value)  # a fill launch: no copy from the host, so no sync

    @property
    def o2o(self) -> float:
        return self._o2o

    @o2o.setter
    def o2o(self, value: float) -> None:
        self._o2o = value
        self.weights[1].fill_(value)

    def parse_output(self, preds: dict | tuple) -> dict[str, Any]:
        """The training outputs dict, ``{"one2many": ..., "one2one": ...}`` (the second element of
        an ``(inference, dict)`` tuple)."""
        return self.one2many.parse_output(preds)

    def __call__(self, preds: dict | tuple, batch: dict[str, torch.Tensor]
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(o2m * loss_one2many + o2o * loss_one2one, one-to-one items)``, as ``E2ELoss``."""
        preds = self.parse_output(preds)
        one2many, one2one = preds["one2many"], preds["one2one"]
        scores = one2one["scores"]
        gt = self.one2one.targets(batch, scores.shape[0], scores.device)
        loss_one2many, _ = self.one2many.loss(one2many, batch, gt)
        loss_one2one, items = self.one2one.loss(one2one, batch, gt)
        w = self.weights
        return loss_one2many * w[0] + loss_one2one * w[1], items

    def update(self) -> None:
        """One step of the schedule (ultralytics' trainer calls it at each epoch's end)."""
        self.updates += 1
        self.o2m = self.decay(self.updates)
        self.o2o = max(self.total - self.o2m, 0)

    def decay(self, x: float) -> float:
        """The one-to-many weight after ``x`` updates: linear from ``o2m_copy`` to ``final_o2m``
        over ``epochs - 1`` updates, then constant."""
        span = max(self.one2one.hyp.epochs - 1, 1)
        return max(1 - x / span, 0) * (self.o2m_copy - self.final_o2m) + self.final_o2m

    def copy_schedule(self, other: Any) -> None:
        """Take the schedule's state (``updates``, ``o2m``, ``o2o``) of ``other``, an ``E2ELoss``
        or FusedE2ELoss: what a trainer does when this loss replaces the one ultralytics set up on
        resume (``updates = start_epoch - 1``, then one ``update()``)."""
        self.updates, self.o2m, self.o2o = other.updates, other.o2m, other.o2o


__all__ = ["FusedE2ELoss", "takes_fused_e2e_loss"]
