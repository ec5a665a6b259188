"""The per-epoch validation's forward replayed from CUDA graphs, and its loss fused.

In ultralytics' validation loop each batch's forward is a few hundred kernel launches from Python,
and ``Profile`` synchronizes the host with the GPU around it, so the GPU waits for every launch.
:class:`GraphedEval` stands in for the EMA model the trainer's validator runs, and for the model
``model.val`` runs: an inference call (eval mode, no grad, CUDA input, no ``augment``) is replayed
from a CUDA graph, one per input shape, dtype and autocast state
(:class:`~trainfuse.graphs.CapturedStep`; a shape's first two batches run eagerly, the first as it
is, the second watched for host syncs; its third is captured); anything else runs the model as it
is. ``loss`` is the fused,
sync-free detection loss (:func:`~trainfuse.ultralytics.changes.loss.criterion`) where the model
takes one, ultralytics' own criterion otherwise.

Detection heads cache their anchors for the last input shape in Python attributes (computing them
reads the head's stride back to the host: a sync no graph may hold): a shape's very first batch runs
the model as it is, which computes them, and they are kept per input shape and set back on the
heads before each later call of that shape, so that neither the graph's eager first call nor its
capture recomputes them and every replay reads anchors that stay where they are. The graphs read
the EMA's weights where they are: :meth:`GraphedEval.fits` tells whether the model's tensors are
still the ones captured (the trainer's EMA is updated in place; a checkpoint load makes a new one).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch import nn
from typing_extensions import override
from ultralytics.nn.modules.head import Detect

from trainfuse.graphs import CapturedStep
from trainfuse.ultralytics.changes.loss import criterion

MAX_GRAPHS = 8  # input shapes kept captured at once: rect validation batches come in a few shapes


def fingerprint(model: nn.Module) -> tuple[int, ...]:
    """Where ``model``'s params and buffers live: a graph replays correctly while this is unchanged."""
    return tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))


def graphable(model: nn.Module) -> bool:
    """Whether :class:`GraphedEval` replays ``model``'s inference: a model with a detection head and
    no end-to-end branch (whose inference selects its top detections with a variable count)."""
    heads = [m for m in model.modules() if isinstance(m, Detect)]
    return bool(heads) and all(getattr(h, "one2one_cv2", None) is None for h in heads)


class GraphedEval(nn.Module):
    """``model`` (the trainer's EMA, or the model ``AutoBackend`` runs) for ultralytics' validation
    loop: its inference forward from CUDA graphs, its loss fused (see the module docstring).
    ``float``, ``eval`` and ``end2end`` reach ``model``.

    Args:
        model: a detection model (:func:`graphable`).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.heads = [m for m in model.modules() if isinstance(m, Detect)]
        self.step = CapturedStep(self._infer, max_graphs=MAX_GRAPHS, name="validation forward")
        self.criterion: Any = None
        self._fingerprint = fingerprint(model)
        self._anchors: dict[Hashable, list[tuple]] = {}  # input key -> each head's (anchors, strides, shape)

    def fits(self, model: nn.Module) -> bool:
        """Whether this stands for ``model`` with its tensors where they were captured."""
        return model is self.model and fingerprint(model) == self._fingerprint

    @property
    def end2end(self) -> bool:
        return self.model.end2end

    @end2end.setter
    def end2end(self, value: bool) -> None:
        self.model.end2end = value

    def _infer(self, img: torch.Tensor) -> Any:
        return self.model(img)

    @override
    def forward(self, img: torch.Tensor, augment: bool = False, **kwargs: Any) -> Any:
        """The model's output for ``img``: replayed where the call is an inference call on CUDA
        (other keywords, such as ``AutoBackend``'s ``embed=None``, left at None)."""
        eager = (augment or any(v is not None for v in kwargs.values()) or not isinstance(img, torch.Tensor)
                 or not img.is_cuda or self.model.training or torch.is_grad_enabled() or img.requires_grad
                 or torch.cuda.is_current_stream_capturing())
        if eager:
            return self.model(img, augment=augment, **kwargs) if augment or kwargs else self.model(img)
        bucket = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        key = (tuple(img.shape), img.stride(), img.dtype, img.device, bucket)
        kept = self._anchors.get(key)
        if kept is None:  # the heads compute this shape's anchors (a host sync) outside any graph
            out = self.model(img)
            if len(self._anchors) >= 4 * MAX_GRAPHS:  # many shapes: start over, graphs and all
                self._anchors.clear()
                self.step = CapturedStep(self._infer, max_graphs=MAX_GRAPHS, name="validation forward")
            self._anchors[key] = [(h.anchors, h.strides, h.shape) for h in self.heads]
            return out
        for h, (anchors, strides, shape) in zip(self.heads, kept):
            h.anchors, h.strides, h.shape = anchors, strides, shape
        return self.step(img, bucket=bucket)

    def loss(self, batch: dict[str, Any], preds: Any = None) -> Any:
        """``DetectionModel.loss`` with the fused criterion where the model takes one."""
        if self.criterion is None:
            self.criterion = criterion(self.model)
        if preds is None:
            preds = self.forward(batch["img"])
        return self.criterion(preds, batch)

    @property
    def stats(self):
        """The graphs' counts (:class:`~trainfuse.graphs.stats.StepStats`)."""
        return self.step.stats


__all__ = ["MAX_GRAPHS", "GraphedEval", "fingerprint", "graphable"]
