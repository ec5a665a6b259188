"""FusedDetectionValidator: ultralytics' ``DetectionValidator`` with a batch's NMS, IoU and matching
on the device at once and no host sync inside a batch.

Stock validation, per image: NMS (a Python loop, torchvision's nms on up to 30000 candidates),
``box_iou`` and the greedy matching in numpy, each with a copy to the host. Here, per batch:
:func:`~trainfuse.ultralytics.validate.nms.batched_nms` (``postprocess``), the IoU and
:func:`~trainfuse.ultralytics.validate.matching.match_detections` (``update_metrics``), then one
non-blocking copy of the counts, confidences, classes and ``tp`` (and the boxes, where plots,
``save_json`` or ``save_txt`` need them) into pinned memory, with an event. A batch's results
become ultralytics' per-image ``metrics.update_stats`` entries (same keys and values as stock)
once the next batch is queued, or at ``gather_stats`` / ``get_stats``; the per-image extras
(confusion matrix, JSON and text results, the custom-JSON ground truth) run then, through stock's
own methods, on host copies.

The labels come padded from the CPU (``batch["padded_targets"]``, put there in ``preprocess``
while the batch is still on the CPU, as the fused loss reads them), and the per-image target
classes from the CPU copy of the batch, so nothing is read back from the device but the results.
On CUDA the model's forward is replayed from CUDA graphs
(:class:`~trainfuse.ultralytics.validate.graphed.GraphedEval`): during training the EMA's, whose
loss is then the fused one; in ``model.val`` the PyTorch model ultralytics' ``AutoBackend`` runs.
``cuda_graphs=False`` keeps stock's eager forward and loss.

Without Triton (``TRAINFUSE_BACKEND=torch``, or CPU tensors by default) NMS is ultralytics' own
function and the matching :func:`~trainfuse.ultralytics.validate.matching.match_torch`: the
statistics are stock's exactly. End-to-end heads (YOLOv10, YOLO26), which skip NMS, keep stock's
path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from typing_extensions import override
from ultralytics.models.yolo.detect import DetectionValidator
from ultralytics.utils import ops

from trainfuse.losses.detection.targets import PADDED_KEY, add_padded_targets, pad_targets, target_capacity
from trainfuse.ultralytics.validate.graphed import GraphedEval, graphable
from trainfuse.ultralytics.validate.matching import true_positives
from trainfuse.ultralytics.validate.nms import BatchedDetections, batched_nms

HOST_LABELS_KEY = "host_labels"


@dataclass
class HostLabels:
    """A batch's labels and image facts on the CPU, as the loader gave them."""

    batch_idx: np.ndarray
    cls: torch.Tensor
    bboxes: torch.Tensor
    imgsz: torch.Size
    ori_shape: list
    ratio_pad: list
    im_file: list

    @classmethod
    def of(cls, batch: dict) -> HostLabels:
        """From ``batch`` (read back from the device where it is there already: a host sync)."""
        return cls(batch["batch_idx"].cpu().numpy(), batch["cls"].cpu(), batch["bboxes"].cpu(),
                   batch["img"].shape[2:], batch["ori_shape"], batch["ratio_pad"], batch["im_file"])

    def target_cls(self, si: int) -> np.ndarray:
        """Image ``si``'s label classes, as stock's ``pbatch["cls"].cpu().numpy()``."""
        return self.cls[torch.from_numpy(self.batch_idx == si)].squeeze(-1).numpy()

    def image(self, si: int) -> dict[str, Any]:
        """Image ``si``'s ``pbatch``, as stock's ``_prepare_batch`` makes it, on the CPU."""
        idx = torch.from_numpy(self.batch_idx == si)
        cls, bbox = self.cls[idx].squeeze(-1), self.bboxes[idx]
        if cls.shape[0]:
            bbox = ops.xywh2xyxy(bbox) * torch.tensor(self.imgsz)[[1, 0, 1, 0]]
        return {"cls": cls, "bboxes": bbox, "ori_shape": self.ori_shape[si], "imgsz": self.imgsz,
                "ratio_pad": self.ratio_pad[si], "im_file": self.im_file[si]}


class QueuedBatch:
    """A batch's results on their way to the host: copies started on the current stream, an event
    after them; :meth:`results` waits for it."""

    def __init__(self, detections: BatchedDetections, cls: torch.Tensor, tp: torch.Tensor, with_boxes: bool,
                 labels: HostLabels, img: torch.Tensor | None):
        self.detections, self.labels, self.img = detections, labels, img
        parts = [detections.count, detections.conf, cls, tp] + ([detections.boxes] if with_boxes else [])
        self.parts = [to_host(p) for p in parts]
        self.event = None
        if detections.rows.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def results(self) -> tuple[np.ndarray, ...]:
        """``(count, conf, cls, tp, boxes or None)`` as numpy arrays, once the copies are done."""
        if self.event is not None:
            self.event.synchronize()
        arrays = [p.numpy() for p in self.parts]
        return (*arrays, None) if len(arrays) == 4 else tuple(arrays)

    def predictions(self) -> list[dict[str, torch.Tensor]]:
        """Stock's ``postprocess`` dicts (``bboxes``, ``conf``, ``cls``, ``extra``) of every image,
        on the CPU (needs the boxes)."""
        count, conf, cls, _, boxes = self.results()
        return [image_prediction(boxes[i], conf[i], cls[i], int(count[i])) for i in range(len(count))]


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU: from a GPU, a non-blocking copy into pinned memory (read it after an event)."""
    if not t.is_cuda:
        return t
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


def image_prediction(boxes: np.ndarray, conf: np.ndarray, cls: np.ndarray, n: int) -> dict[str, torch.Tensor]:
    """One image's first ``n`` detections as a stock prediction dict of CPU tensors."""
    return {"bboxes": torch.from_numpy(boxes[:n].copy()), "conf": torch.from_numpy(conf[:n].copy()),
            "cls": torch.from_numpy(cls[:n].copy()), "extra": torch.zeros(n, 0)}


class FusedDetectionValidator(DetectionValidator):
    """``ultralytics.models.yolo.detect.DetectionValidator`` with batched, sync-free NMS and matching
    (see the module docstring): ``model.val(data=..., validator=FusedDetectionValidator)``;
    :class:`~trainfuse.ultralytics.FusedDetectionTrainer` validates with it.

    Attributes:
        cuda_graphs: on CUDA, run the model's forward from CUDA graphs, and during training the
            EMA's loss fused (default True; a class attribute, set per instance as the trainer
            does).
        graphed: the :class:`~trainfuse.ultralytics.validate.graphed.GraphedEval` of the trainer's
            EMA, kept across validations while the EMA's tensors stay where they are; or None.
    """

    cuda_graphs = True

    def __init__(self, dataloader=None, save_dir=None, args=None, _callbacks: dict | None = None) -> None:
        super().__init__(dataloader, save_dir, args, _callbacks)
        self.queued: list[QueuedBatch] = []
        self.thresholds: torch.Tensor | None = None  # ``iouv`` on the device
        self.graphed: GraphedEval | None = None

    @override
    def get_model(self, model, trainer=None):
        """Stock's model; during training on CUDA, the EMA behind :class:`GraphedEval`."""
        model = super().get_model(model, trainer)
        if (trainer is None or not self.cuda_graphs or trainer.device.type != "cuda" or trainer.args.compile
                or not isinstance(model, torch.nn.Module) or not graphable(model)):
            return model
        if self.graphed is None or not self.graphed.fits(model):
            self.graphed = GraphedEval(model)
        return self.graphed

    @override
    def init_metrics(self, model: torch.nn.Module) -> None:
        if isinstance(model, GraphedEval):
            model = model.model
        elif not self.training:
            self.graph_backend(model)
        super().init_metrics(model)

    def graph_backend(self, model: Any) -> None:
        """For ``model.val``: the PyTorch model inside ultralytics' ``AutoBackend`` (``model``, built
        for this validation) behind :class:`GraphedEval`, on CUDA where it is graphable."""
        backend = getattr(model, "backend", None)
        inner = getattr(backend, "model", None)
        if (self.cuda_graphs and self.device.type == "cuda" and getattr(model, "format", None) == "pt"
                and not self.args.compile and isinstance(inner, torch.nn.Module)
                and not isinstance(inner, GraphedEval) and graphable(inner)):
            backend.model = GraphedEval(inner)
        self.queued = []
        self.thresholds = self.iouv.to(self.device)

    @override
    def preprocess(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Stock's, after padding the labels and keeping a CPU copy of them (the batch is still on
        the CPU here)."""
        labels = HostLabels.of(batch)
        if PADDED_KEY not in batch:
            add_padded_targets(batch)
        batch = super().preprocess(batch)
        batch[HOST_LABELS_KEY] = labels
        return batch

    @override
    def postprocess(self, preds: Any) -> BatchedDetections | list[dict[str, torch.Tensor]]:
        """Batched NMS (stock's settings) into :class:`BatchedDetections`; stock's for end-to-end heads."""
        if self.end2end:
            return super().postprocess(preds)
        return batched_nms(preds, self.args.conf, self.args.iou, multi_label=True,
                           agnostic=self.args.single_cls or self.args.agnostic_nms, max_det=self.args.max_det)

    @override
    def update_metrics(self, preds: BatchedDetections | list[dict[str, torch.Tensor]],
                       batch: dict[str, Any]) -> None:
        """Queue the batch's matching and its copies to the host; unpack the batch before it."""
        if not isinstance(preds, BatchedDetections):
            return super().update_metrics(preds, batch)
        labels = batch.get(HOST_LABELS_KEY)
        if labels is None:
            labels = HostLabels.of(batch)
        size = len(labels.im_file)
        padded = batch.get(PADDED_KEY)
        if padded is None:  # a batch that skipped preprocess: its capacity is read back (a host sync)
            padded = pad_targets(batch["batch_idx"], batch["cls"], batch["bboxes"], size,
                                 target_capacity(batch["batch_idx"], size))
        padded = padded.to(preds.rows.device, non_blocking=True)
        idx = batch["batch_idx"].to(preds.rows.device, non_blocking=True).reshape(-1).long()
        nlabels = torch.zeros(size, dtype=torch.int32, device=idx.device).scatter_add_(
            0, idx, torch.ones_like(idx, dtype=torch.int32))
        cls = preds.cls * 0 if self.args.single_cls else preds.cls  # stock's _prepare_pred
        thresholds = self.thresholds if self.thresholds is not None else self.iouv
        tp = true_positives(preds.boxes, cls, preds.count, padded, nlabels, labels.imgsz, thresholds)
        with_boxes = self.args.plots or self.args.save_json or self.args.save_txt
        img = batch["img"] if self.args.plots and self.args.visualize else None
        self.queued.append(QueuedBatch(preds, cls, tp, with_boxes, labels, img))
        self.unpack(keep=1)

    def unpack(self, keep: int = 0) -> None:
        """Turn the queued batches but the last ``keep`` into stock's per-image statistics."""
        while len(self.queued) > keep:
            self.unpack_batch(self.queued.pop(0))

    def unpack_batch(self, queued: QueuedBatch) -> None:
        """Stock's ``update_metrics`` image by image, from a batch's host copies."""
        count, conf, cls, tp, boxes = queued.results()
        labels = queued.labels
        extras = self.args.plots or self.args.save_json or self.args.save_txt or self.build_gdict
        for si in range(len(count)):
            self.seen += 1
            n = int(count[si])
            target_cls = labels.target_cls(si)
            no_pred = n == 0
            if self.is_custom_json:
                self.pred_counts.append(n)
            self.metrics.update_stats({
                "tp": tp[si, :n].copy(),
                "target_cls": target_cls,
                "target_img": np.unique(target_cls),
                "conf": np.zeros(0) if no_pred else conf[si, :n].copy(),
                "pred_cls": np.zeros(0) if no_pred else cls[si, :n].copy(),
                "im_name": Path(labels.im_file[si]).name,
            })
            if extras:
                predn = None if boxes is None else image_prediction(boxes[si], conf[si], cls[si], n)
                self.image_extras(si, predn, labels.image(si), queued.img)

    def image_extras(self, si: int, predn: dict[str, torch.Tensor] | None, pbatch: dict[str, Any],
                     img: torch.Tensor | None) -> None:
        """What stock's ``update_metrics`` does for image ``si`` besides its statistics, in its order
        (the custom-JSON ground truth first, then the confusion matrix, JSON and text results)."""
        if self.build_gdict:
            im_idx = self.eval_ids[self.seen - 1]
            scaled = ops.scale_boxes(pbatch["imgsz"], pbatch["bboxes"].clone(), pbatch["ori_shape"],
                                     pbatch["ratio_pad"])
            boxes = ops.xyxy2ltwh(scaled).tolist()
            self.gdict["images"].append({"id": im_idx})
            self.gdict["annotations"].extend(
                {"id": (im_idx << 32 | i) + 1, "image_id": im_idx, "category_id": self.class_map[int(c)],
                 "bbox": b, "area": b[2] * b[3], "iscrowd": 0}
                for i, (b, c) in enumerate(zip(boxes, pbatch["cls"].numpy())))
        if predn is None:
            return
        if self.args.plots:
            self.confusion_matrix.process_batch(predn, pbatch, conf=self.args.conf)
            if self.args.visualize:
                self.confusion_matrix.plot_matches(img[si], pbatch["im_file"], self.save_dir,
                                                   self.args.show_labels, self.args.show_conf)
        if predn["cls"].shape[0] == 0:
            return
        if self.args.save_json or self.args.save_txt:
            predn_scaled = self.scale_preds(predn, pbatch)
        if self.args.save_json:
            self.pred_to_json(predn_scaled, pbatch)
        if self.args.save_txt:
            name = "_".join(Path(pbatch["im_file"]).relative_to(self.label_root).with_suffix("").parts)
            self.save_one_txt(predn_scaled, self.args.save_conf, pbatch["ori_shape"],
                              self.save_dir / "labels" / f"{name}.txt")

    @override
    def plot_predictions(self, batch: dict[str, Any], preds: Any, ni: int,
                         max_det: int | None = None) -> None:
        """Stock's, given stock's per-image dicts (waits for this batch's copies)."""
        if isinstance(preds, BatchedDetections):
            queued = next(q for q in reversed(self.queued) if q.detections is preds)
            preds = queued.predictions()
        super().plot_predictions(batch, preds, ni, max_det)

    @override
    def gather_stats(self) -> None:
        self.unpack()
        super().gather_stats()

    @override
    def get_stats(self) -> dict[str, Any]:
        self.unpack()
        return super().get_stats()


__all__ = ["HOST_LABELS_KEY", "FusedDetectionValidator", "HostLabels", "QueuedBatch"]
