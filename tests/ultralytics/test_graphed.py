"""The fused trainers' CUDA-graph step: against the same trainer run eagerly (GPU), and the parts
that are host logic (CPU).

The GPU run trains YOLOv5n for 200 iterations on 40 synthetic 64-pixel images (batch 4, nbs 16:
warmup ramps the accumulation from 1 to 4 over the first 100 iterations), AMP on, mosaic on, with
``deterministic=True`` and one data order for both runs. The kernels are deterministic (cuDNN in
deterministic mode; the fused loss sums without float atomics), and a replay launches the kernels
the eager step launches, so everything is compared bit for bit: every iteration's loss,
GradScaler's scale after every iteration (so the skipped steps), the weights, BatchNorm's running
statistics and ``num_batches_tracked``, the EMA, and the epoch's logged loss means. The graphed
run keeps its grads and zeroes them inside the first replay after each optimizer step; the eager
run frees them: 0 + g is g, so the sums agree. The segmentation, pose, OBB and classification
trainers run the same comparison on their tasks' synthetic data (their fused losses; ultralytics'
cross-entropy for classification).
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch

from trainfuse.ultralytics.offline import offline_env

offline_env(Path(tempfile.gettempdir()) / "trainfuse-tests-yolo-config")
pytest.importorskip("ultralytics")

from ultralytics import YOLO  # noqa: E402
from ultralytics.utils import DEFAULT_CFG  # noqa: E402

from tests._helpers import cuda  # noqa: E402
from trainfuse.losses.detection.targets import PADDED_KEY, PADDED_KEYPOINTS_KEY  # noqa: E402
from trainfuse.ultralytics import (  # noqa: E402
    FusedClassificationTrainer,
    FusedDetectionLoss,
    FusedDetectionTrainer,
    FusedOBBLoss,
    FusedOBBTrainer,
    FusedPoseLoss,
    FusedPoseTrainer,
    FusedSegmentationLoss,
    FusedSegmentationTrainer,
)
from trainfuse.ultralytics.changes import CALLBACKS  # noqa: E402
from trainfuse.ultralytics.changes.graphs import graph_inputs  # noqa: E402
from trainfuse.ultralytics.graphed import GraphedLoss, KeptGrads, replayed_loss  # noqa: E402
from trainfuse.ultralytics.readout import RING, LossReadout  # noqa: E402
from trainfuse.ultralytics.shapes import make_shapes_dataset  # noqa: E402
from trainfuse.ultralytics.task_shapes import make_task_dataset  # noqa: E402

TASK_RUNS = {"segment": ("yolo11n-seg.yaml", FusedSegmentationTrainer),
             "pose": ("yolo11n-pose.yaml", FusedPoseTrainer),
             "obb": ("yolo11n-obb.yaml", FusedOBBTrainer),
             "classify": ("yolo11n-cls.yaml", FusedClassificationTrainer),
             # YOLO26's end-to-end heads: E2ELoss over the segment, pose and OBB losses
             "segment26": ("yolo26n-seg.yaml", FusedSegmentationTrainer),
             "pose26": ("yolo26n-pose.yaml", FusedPoseTrainer),
             "obb26": ("yolo26n-obb.yaml", FusedOBBTrainer)}


def test_replayed_loss_backward_reaches_no_parameter():
    w = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    (w * w).sum().backward()
    before = w.grad.clone()
    loss = (w * 4).detach()
    anchor = torch.zeros((), requires_grad=True)
    out = replayed_loss(loss, anchor)
    assert out.requires_grad and torch.equal(out, loss)
    (out.sum() * 1024.0).backward()  # what the loop runs: scaler.scale(loss.sum()).backward()
    assert torch.equal(w.grad, before)
    assert anchor.grad is None


@pytest.mark.parametrize("model,loss,keys", [
    ("yolov5n.yaml", FusedDetectionLoss, (PADDED_KEY,)),
    ("yolo11n-pose.yaml", FusedPoseLoss, (PADDED_KEY, PADDED_KEYPOINTS_KEY)),
    ("yolo11n-obb.yaml", FusedOBBLoss, (PADDED_KEY,)),
    ("yolo11n-seg.yaml", FusedSegmentationLoss, (PADDED_KEY, "masks")),
])
def test_graph_inputs_are_the_labels_each_fused_loss_reads(model, loss, keys):
    made = YOLO(model).model
    made.args = DEFAULT_CFG  # what the trainer sets before the loss is made
    fused = loss(made)
    assert graph_inputs(fused) == (keys, tuple(fused.loss_names))


def test_graph_inputs_refuse_losses_that_sync_or_change_shape():
    from ultralytics.utils.loss import v8ClassificationLoss, v8DetectionLoss

    assert graph_inputs(v8ClassificationLoss()) == (("cls",), ("loss",))  # cross-entropy: no sync
    made = YOLO("yolo11n-seg.yaml").model
    made.args = DEFAULT_CFG
    assert graph_inputs(v8DetectionLoss(made)) is None
    no_overlap = FusedSegmentationLoss(made)
    no_overlap.overlap, no_overlap.graph_keys = False, None  # as overlap_mask=False makes it
    assert graph_inputs(no_overlap) is None
    with pytest.raises(ValueError, match="keys must name the labels"):
        GraphedLoss(made, torch.amp.GradScaler("cpu", enabled=False), keys=())


def test_kept_grads_fold_fresh_grads_in_as_autograd_accumulates(device):
    """Later backwards write fresh grads and ``fold_in`` adds them to the kept ones (copies them
    after an optimizer step; zeroes a param the backward missed), per dtype: the values autograd's
    own accumulation leaves, on the same tensors. Given grads (DDP's) are left to autograd."""
    g = torch.Generator().manual_seed(0)
    half = torch.float16 if device.type == "cuda" else torch.float32  # (no float16 matmul on some CPUs)
    params = [torch.randn(5, 3, generator=g).to(device, half).requires_grad_(),
              torch.randn(3, generator=g).to(device).requires_grad_(),
              torch.randn(4, 4, generator=g).to(device).t().requires_grad_(),  # a strided leaf
              torch.randn(2, generator=g).to(device).requires_grad_()]  # reached only sometimes
    stock = [p.detach().clone().requires_grad_() for p in params]

    def backward(ps, x, reach):
        y = (x.to(ps[0].dtype) @ ps[0]).float() * ps[1] + (x[:, :4] @ ps[2]).sum(1, keepdim=True)
        loss = (y.square().sum() + (ps[3].sum() if reach else 0.0)) / 7
        loss.backward()

    kept = KeptGrads(params)
    backward(params, torch.randn(6, 5, generator=g).to(device), True)  # the first call makes them
    kept.captured()
    ours = list(kept.grads)
    for p, s in zip(params, stock):
        s.grad = p.grad.clone()
    for step, (reach, zero_first) in enumerate([(True, False), (False, False), (True, True), (False, True)]):
        x = torch.randn(6, 5, generator=g).to(device)
        assert kept.begin_backward() and all(p.grad is None for p in params)
        backward(params, x, reach)
        kept.fold_in(zero_first)
        if zero_first:
            for s in stock:
                s.grad.zero_()
        backward(stock, x, reach)
        assert all(p.grad is k for p, k in zip(params, ours)), step
        for p, s in zip(params, stock):
            assert torch.equal(p.grad, s.grad), (step, p.grad, s.grad)
    given = KeptGrads(params, [torch.zeros_like(p) for p in params])
    assert not given.begin_backward() and all(p.grad is k for p, k in zip(params, ours))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("shapes")
    return str(make_shapes_dataset(root, n_train=8, n_val=4, imgsz=64, seed=0))


def test_cuda_graphs_takes_a_bool_and_its_callbacks_are_added_once(data, tmp_path):
    overrides = dict(model="yolov5n.yaml", data=data, device="cpu", project=str(tmp_path), name="t",
                     exist_ok=True, plots=False, verbose=False)
    with pytest.raises(TypeError, match="cuda_graphs must be True, False or None"):
        FusedDetectionTrainer(overrides=overrides, cuda_graphs="yes")
    first = FusedDetectionTrainer(overrides=overrides)
    assert first.cuda_graphs is True
    second = FusedDetectionTrainer(overrides=overrides, _callbacks=first.callbacks, cuda_graphs=False)
    assert second.cuda_graphs is False and first.cuda_graphs is True
    for event, callback in CALLBACKS.items():
        assert second.callbacks[event].count(callback) == 1 and second.callbacks[event][0] is callback


def test_cudnn_benchmark_takes_a_bool_and_is_off_on_the_cpu(data, tmp_path):
    from trainfuse.ultralytics.changes import ConvAlgorithms, Options, Run

    overrides = dict(model="yolov5n.yaml", data=data, device="cpu", project=str(tmp_path), name="t",
                     exist_ok=True, plots=False, verbose=False)
    with pytest.raises(TypeError, match="cudnn_benchmark must be True, False or None"):
        FusedDetectionTrainer(overrides=overrides, cudnn_benchmark="yes")
    trainer = FusedDetectionTrainer(overrides=overrides, cudnn_benchmark=True)
    assert trainer.cudnn_benchmark is True and FusedDetectionTrainer.cudnn_benchmark is False
    run = Run(trainer, Options(True, True, True, True, cudnn_benchmark=True), trainer.loading)
    assert ConvAlgorithms(True).why_off(run) == "the device is not CUDA"
    assert ConvAlgorithms(False).why_off(run) == "cudnn_benchmark=False"


@pytest.mark.cpu_training
def test_cpu_run_says_why_it_is_eager_and_leaves_the_model_as_it_was(data, tmp_path):
    model = YOLO("yolov5n.yaml")
    model.train(data=data, epochs=1, imgsz=64, batch=4, workers=0, device="cpu", plots=False, val=False,
                seed=0, verbose=False, project=str(tmp_path), name="cpu", exist_ok=True,
                trainer=FusedDetectionTrainer)
    trainer = model.trainer
    assert "not CUDA" in trainer.graphs_reason
    assert "loss" not in vars(trainer.model)


@cuda
def test_loss_readout_returns_recent_finished_items_and_exact_epoch_means():
    device = torch.device("cuda")
    readout = LossReadout(("box", "cls", "dfl"), device)
    pushed = [torch.tensor([i, 10.0 * i, -i], device=device) for i in range(1, 13)]
    readout.start_epoch()
    assert readout.epoch_means() is None
    seen = []
    for i, items in enumerate(pushed):
        if i % 5 == 4:
            torch.cuda.synchronize()  # the GPU caught up: the previous items must have landed
        got = readout.push(items)
        assert list(got) == ["box", "cls", "dfl"] and all(v.device.type == "cpu" for v in got.values())
        index = int(got["box"]) - 1
        assert torch.equal(torch.stack(tuple(got.values())), pushed[index].cpu())
        assert i - RING < index <= i  # at most RING - 1 iterations old
        if i % 5 == 4:
            assert index >= i - 1
        seen.append(index)
    assert seen == sorted(seen)  # never older than what was already shown
    torch.testing.assert_close(torch.stack(tuple(readout.epoch_means().values())),
                               torch.stack(pushed).mean(0).cpu(), rtol=1e-6, atol=0)
    readout.start_epoch()  # a new epoch's means count its own iterations only
    for items in pushed[:3]:
        readout.push(items * 2)
    torch.testing.assert_close(torch.stack(tuple(readout.epoch_means().values())),
                               torch.stack(pushed[:3]).mean(0).cpu() * 2, rtol=1e-6, atol=0)


# ---- GPU: 200 iterations, graphs against eager -------------------------------------------------------
class Record:
    """Per iteration: the loss and GradScaler's scale (host syncs are fine in a test)."""

    def __init__(self, model: YOLO):
        self.losses: list[torch.Tensor] = []
        self.scales: list[float] = []
        model.add_callback("on_train_batch_end", self.on_train_batch_end)

    def on_train_batch_end(self, trainer) -> None:
        self.losses.append(trainer.loss.detach().clone())
        self.scales.append(trainer.scaler.get_scale())


def _gpu_run(data: str, project: Path, graphs: bool, model: str = "yolov5n.yaml",
             optimizer: str = "auto", trainer=FusedDetectionTrainer, **options) -> tuple[YOLO, Record, dict]:
    name = f"{Path(model).stem}-{optimizer}-graphs-{graphs}"
    model = YOLO(model)
    record = Record(model)
    metrics: dict = {}
    model.add_callback("on_fit_epoch_end", lambda t: metrics.update({t.epoch: t.label_loss_items(t.tloss)}))
    model.train(data=data, epochs=20, imgsz=64, batch=4, nbs=16, workers=0, device=0, plots=False, val=False,
                seed=0, deterministic=True, verbose=False, project=str(project), name=name,
                optimizer=optimizer, exist_ok=True,
                trainer=functools.partial(trainer, cuda_graphs=graphs, **options))
    return model, record, metrics


def _same_training(eager: YOLO, graphed: YOLO, eager_rec: Record, graphed_rec: Record) -> None:
    """Every iteration's loss and scale, the EMA's updates, weights, BatchNorm statistics and EMA
    equal bit for bit."""
    te, tg = eager.trainer, graphed.trainer
    got, want = torch.stack(graphed_rec.losses), torch.stack(eager_rec.losses)
    differ = (got != want).nonzero().flatten().tolist()
    assert not differ, (f"iterations {differ[:5]} of {len(want)} differ, the first: {got[differ[0]]} != "
                        f"{want[differ[0]]}")
    assert graphed_rec.scales == eager_rec.scales
    assert tg.ema.updates == te.ema.updates
    for name, a, b in ((("model", tg.model, te.model)), ("ema", tg.ema.ema, te.ema.ema)):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        for k in sa:  # weights, BatchNorm running statistics and num_batches_tracked
            assert torch.equal(sa[k], sb[k]), f"{name}.{k}"


@cuda
@pytest.mark.parametrize("model,optimizer", [("yolov5n.yaml", "auto"), ("yolo26n.yaml", "auto"),
                                             ("yolov5n.yaml", "MuSGD"), ("yolov5n.yaml", "NAdam")])
def test_graph_replay_trains_exactly_like_eager(tmp_path_factory, model, optimizer):
    """A fused optimizer (auto: AdamW here; MuSGD, what auto picks past 10k iterations, its
    Newton-Schulz steps inside the graphs too) or a stock one (NAdam), a v8 head or an end-to-end
    one (FusedE2ELoss): the replay trains as eagerly."""
    root = tmp_path_factory.mktemp("shapes200")
    data = str(make_shapes_dataset(root, n_train=40, n_val=8, imgsz=64, seed=1))
    project = tmp_path_factory.mktemp("runs")
    eager, eager_rec, eager_metrics = _gpu_run(data, project, False, model, optimizer)
    graphed, graphed_rec, graphed_metrics = _gpu_run(data, project, True, model, optimizer)
    te, tg = eager.trainer, graphed.trainer
    assert te.graphs_reason == "cuda_graphs=False" and tg.graphs_reason == ""
    stats = tg.graph_stats
    assert stats.fallbacks == 0 and stats.captures >= 1
    assert stats.replays >= 150, stats  # each shape's first batch eager, the rest replayed
    assert stats.eager + stats.replays == len(graphed_rec.losses) == 200
    assert "loss" not in vars(tg.model)  # the model's own loss is back
    stem = {r.kind: r.action for r in tg.report}.get("stem")
    assert stem == ("on" if model.startswith("yolov5") else "off")  # the 6 x 6 stem folds, 3 x 3 not
    assert "forward" not in vars(tg.model.model[0].conv)  # and its own forward back after
    assert not tg.keeps_grads and tg.graphed_loss is None  # the graphs are dropped at the end...
    assert all(p.grad is None for p in tg.model.parameters())  # ... and the kept grads freed
    if optimizer == "MuSGD":  # its Newton-Schulz part inside the step's graphs too
        phase = tg.phase_stats
        assert phase["captures"] >= 1 and phase["folded"] >= 40, phase
        assert not tg.optimizer.graph_safe
    elif optimizer == "auto":  # AdamW: the phase inside the step's graphs, the steps equal all the same
        phase = tg.phase_stats
        # two steady eager steps, then one capture of its own graph (its kernels load), then every
        # later step runs inside the graph of the iteration the loop steps after (warmup included)
        assert (phase["eager"], phase["captures"], phase["replays"]) == (2, 1, 1), phase
        assert phase["folded"] == tg.ema.updates - 3 >= 40, phase
        assert not tg.optimizer.graph_safe  # handed back at the end
    else:  # a stock NAdam's phase: eager
        assert tg.phase_stats is None

    _same_training(eager, graphed, eager_rec, graphed_rec)
    if (model, optimizer) == ("yolov5n.yaml", "auto"):
        assert min(eager_rec.scales) < eager_rec.scales[0]  # the run did skip steps
    # the epoch means logged are exact (summed on the GPU, where ultralytics keeps a running mean):
    # not the lagged values the progress bar showed
    assert graphed_metrics.keys() == eager_metrics.keys()
    for epoch, items in eager_metrics.items():
        assert graphed_metrics[epoch] == pytest.approx(items, rel=1e-4, abs=1e-5), epoch


@cuda
@pytest.mark.parametrize("concat", ["0", "1"], ids=["halves", "concat-in-place"])
def test_fused_blocks_replay_trains_exactly_like_eager(tmp_path_factory, monkeypatch, concat):
    """``fuse_blocks=True`` on yolo11n (C3k2 blocks holding C3k ones), with C2f's halves dense or
    with every C2f and C3 block's concatenation written in place (TRAINFUSE_FUSE_CONCAT=1): the
    blocks' kernels replayed from graphs train bit for bit as eagerly."""
    monkeypatch.setenv("TRAINFUSE_FUSE_CONCAT", concat)
    root = tmp_path_factory.mktemp("shapes200")
    data = str(make_shapes_dataset(root, n_train=40, n_val=8, imgsz=64, seed=1))
    project = tmp_path_factory.mktemp("runs")
    eager, eager_rec, _ = _gpu_run(data, project, False, "yolo11n.yaml", fuse_blocks=True)
    graphed, graphed_rec, _ = _gpu_run(data, project, True, "yolo11n.yaml", fuse_blocks=True)
    row = {r.kind: r for r in graphed.trainer.report}["blocks"]
    assert row.action == "on" and (" C2f and C3 blocks: each branch" in row.detail) == (concat == "1")
    assert graphed.trainer.graph_stats.replays >= 150
    _same_training(eager, graphed, eager_rec, graphed_rec)
    assert not any("forward" in vars(m) for m in graphed.trainer.model.modules())


def _note_benchmark(seen: set, _trainer_or_validator) -> None:
    seen.add(torch.backends.cudnn.benchmark)


@cuda
def test_cudnn_benchmark_times_the_training_convolutions_and_gives_the_setting_back(tmp_path_factory):
    """``cudnn_benchmark=True``: on for every training batch (the graphs' warm-up and capture
    included), the user's setting for validation and after the run; the run trains as one without
    it up to the roundings of other convolution algorithms."""
    root = tmp_path_factory.mktemp("shapes-cudnn")
    data = str(make_shapes_dataset(root, n_train=16, n_val=8, imgsz=64, seed=2))
    project = tmp_path_factory.mktemp("runs")
    runs = {}
    for on in (False, True):
        model = YOLO("yolov5n.yaml")
        record, seen = Record(model), {"train": set(), "val": set()}
        for event, phase in (("on_train_batch_start", "train"), ("on_val_start", "val")):
            model.add_callback(event, functools.partial(_note_benchmark, seen[phase]))
        assert torch.backends.cudnn.benchmark is False
        model.train(data=data, epochs=2, imgsz=64, batch=4, workers=0, device=0, plots=False, seed=0,
                    deterministic=True, verbose=False, project=str(project), name=f"cudnn-{on}",
                    exist_ok=True, trainer=functools.partial(FusedDetectionTrainer, cudnn_benchmark=on))
        assert torch.backends.cudnn.benchmark is False  # the user's setting back
        runs[on] = model, record, seen
    (plain, plain_rec, plain_seen), (timed, timed_rec, timed_seen) = runs[False], runs[True]
    assert plain_seen == {"train": {False}, "val": {False}}
    assert timed_seen == {"train": {True}, "val": {False}}  # the final validation included
    rows = {r.kind: r for r in timed.trainer.report}
    assert rows["convolutions"].action == "on" and "deterministic algorithms" in rows["convolutions"].detail
    assert {r.kind: r for r in plain.trainer.report}["convolutions"].detail == "cudnn_benchmark=False"
    assert timed.trainer.graphs_reason == "" and timed.trainer.graph_stats.replays >= 1
    torch.testing.assert_close(timed_rec.losses[0], plain_rec.losses[0], rtol=1e-3, atol=1e-3)


# On an H200 (torch 2.11) the YOLO26 pose run replayed from graphs leaves the eager one at iteration
# 18 of 200 by one float32 ulp of the loss (126.70658875 against 126.70658112) and stays apart; two
# eager runs are equal throughout, so the difference is how a kernel computes under capture, not a
# stale input. The RLE term's flow model (ultralytics' RealNVP: small Linear layers, cuBLAS GEMMs)
# is the suspect, as the cuBLAS einsum of the segmentation mask term was before it became a Triton
# kernel (segmentation has been equal since).
POSE26_APART = pytest.mark.xfail(strict=True, reason="the graphed YOLO26 pose run leaves the eager one "
                                 "by an ulp at iteration 18")


@cuda
@pytest.mark.parametrize("task", [pytest.param(t, marks=POSE26_APART) if t == "pose26" else t
                                  for t in TASK_RUNS])
def test_each_tasks_graph_replay_trains_exactly_like_eager(tmp_path_factory, task):
    """Segmentation, pose and OBB with their fused losses (v8/11 and YOLO26 heads), classification
    with ultralytics' cross-entropy: 200 iterations replayed from graphs, the optimizer phase inside
    them, as eager."""
    model, trainer = TASK_RUNS[task]
    root = tmp_path_factory.mktemp(f"{task}200")
    data = str(make_task_dataset(root, task.removesuffix("26"), n_train=40, n_val=8, imgsz=64, seed=1,
                                 max_objects=4))
    project = tmp_path_factory.mktemp(f"{task}-runs")
    eager, eager_rec, _ = _gpu_run(data, project, False, model, trainer=trainer, fused_loss=True)
    graphed, graphed_rec, _ = _gpu_run(data, project, True, model, trainer=trainer, fused_loss=True)
    tg = graphed.trainer
    assert eager.trainer.graphs_reason == "cuda_graphs=False" and tg.graphs_reason == ""
    stats = tg.graph_stats
    assert stats.fallbacks == 0 and stats.captures >= 1 and stats.replays >= 150, stats
    assert stats.eager + stats.replays == len(graphed_rec.losses) == 200
    assert tg.phase_stats["folded"] >= 40, tg.phase_stats  # the optimizer phase inside the graphs
    assert "loss" not in vars(tg.model) and all(p.grad is None for p in tg.model.parameters())
    _same_training(eager, graphed, eager_rec, graphed_rec)


@cuda
def test_nan_recovery_mid_run_makes_the_graphs_anew(data, tmp_path):
    """ultralytics' own NaN recovery (a non-finite loss at an epoch's end) loads last.pt into the
    model, which changes the cast weights' storage: the graphs must be dropped and made again."""
    model = YOLO("yolov5n.yaml")
    seen: dict = {"before": None, "after": set(), "losses": []}

    def poison(trainer):
        if trainer.epoch == 1 and seen["before"] is None:
            seen["before"] = trainer.graphed_loss
            trainer.loss = torch.tensor(float("nan"), device=trainer.device)

    def batch_end(trainer):
        seen["losses"].append(float(trainer.loss.detach()))
        if seen["before"] is not None:
            seen["after"].add(trainer.graphed_loss)

    model.add_callback("on_train_epoch_end", poison)
    model.add_callback("on_train_batch_end", batch_end)
    model.train(data=data, epochs=3, imgsz=64, batch=2, workers=0, device=0, plots=False, val=False,
                seed=0, verbose=False, project=str(tmp_path), name="nan", exist_ok=True,
                trainer=FusedDetectionTrainer)
    trainer = model.trainer
    assert trainer.nan_recovery_attempts == 0 and seen["before"] is not None
    assert len(seen["after"]) == 1 and seen["before"] not in seen["after"]  # one new GraphedLoss
    assert len(seen["losses"]) == 4 * 4  # epochs 0, 1, 1 again, 2 of 4 batches
    assert all(torch.isfinite(torch.tensor(seen["losses"])))
    stats = trainer.graph_stats  # of the graphs made after the recovery
    assert stats.captures >= 1 and stats.fallbacks == 0 and stats.eager + stats.replays == 8
    assert "loss" not in vars(trainer.model)
