"""FusedDetectionTrainer against stock ultralytics (CPU: the fused optimizers take torch's path;
with the ``kernels`` fixture the Triton kernels run in the interpreter).

On torch's path a step is torch.optim's step and the EMA is ``_foreach_lerp_``, bit for bit; only the
clipping norm differs in its last bits where it clips: the fused step sums the per-tensor norms in
param-group order, ultralytics' ``clip_grad_norm_(model.parameters())`` in module order. Hence
``CLIPPED``, a float32-rounding tolerance, wherever a step clips; and whole runs use loss gains
scaled by ``GAIN`` (ultralytics' ``box``, ``cls``, ``dfl`` arguments), which keeps every gradient
norm of these runs below the clip (largest 6.5), so that they compare bit for bit: a last-bit
difference would otherwise grow through the assigner's discrete choices within a few steps.

Whole runs use YOLOv5n on 16 synthetic 64-pixel images (batch 4, nbs 8, two epochs: 8 iterations
and 5 optimizer steps through warmup and gradient accumulation). The optimizer-phase tests drive
``optimizer_step`` of both trainers directly on a small model, several steps with warmup-style lr
and momentum changes, clipping and a skipped step.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

from trainfuse.ultralytics.offline import offline_env

offline_env(Path(tempfile.gettempdir()) / "trainfuse-tests-yolo-config")
pytest.importorskip("ultralytics")

from ultralytics import YOLO  # noqa: E402
from ultralytics.models.yolo.detect import DetectionTrainer  # noqa: E402
from ultralytics.utils.torch_utils import ModelEMA  # noqa: E402

import trainfuse  # noqa: E402
from tests._helpers import cuda, no_host_sync  # noqa: E402
from trainfuse.losses.detection import PadTargets  # noqa: E402
from trainfuse.ultralytics import FusedDetectionLoss, FusedDetectionTrainer  # noqa: E402
from trainfuse.ultralytics.shapes import make_shapes_dataset  # noqa: E402


class FusedStepTrainer(FusedDetectionTrainer):
    """The fused optimizer phase with ultralytics' own loss: results identical to stock on CPU."""

    fused_loss = False


class FusedBlocksStepTrainer(FusedStepTrainer):
    """FusedStepTrainer with the Conv blocks' BatchNorm and SiLU as one op (on CPU, torch's path of
    the op: ``silu(batch_norm(...))``, what the blocks compute, so a run equals stock's)."""

    fuse_blocks = True


class FusedConcatStepTrainer(FusedBlocksStepTrainer):
    """FusedBlocksStepTrainer with the C3 blocks' concatenations written in place (on CPU by torch's
    ops and copies into the buffer; the tests set ``TRAINFUSE_FUSE_CONCAT=1``, its default)."""


NOT_CUDA_BLOCKS = "fuse_blocks defaults to on for CUDA devices only (True runs the torch reference here)"
STEPS_IN_TWO_EPOCHS = 5  # optimizer steps of the runs below (warmup ramps accumulate from 1 to 2)
CLIPPED = {"rtol": 1e-5, "atol": 1e-6}  # see the module docstring
GAIN = 0.1  # see the module docstring
# FusedDetectionLoss's float32 rounding, after 5 steps: on the losses (the eighth iteration's measured
# 3.4e-4 apart on torch 2.14's CPU kernels: a last-bit difference the assigner's discrete choices grow),
# and on weights of size ~0.1
FUSED_LOSS = {"rtol": 1e-3, "atol": 1e-5}
FUSED_LOSS_WEIGHTS = {"rtol": 1e-3, "atol": 1e-3}
# end-to-end heads: two assignments a step (top-k 10, and 7 then 1) turn those roundings into other
# anchor choices sooner. Each step's loss and grads match stock to 1e-5 (test_e2e_loss.py), and so
# does a run's first loss (the same model and batch); the later ones drift with the anchor choices,
# by how much depends on torch's CPU kernels (5e-4 by the eighth iteration on torch 2.11, 4.5e-3 on
# 2.14.1): bounded at 2 %, well inside what a wrong loss term moves (tens of %)
E2E_FIRST = {"rtol": 1e-5, "atol": 1e-6}
E2E_RUN = {"rtol": 2e-2, "atol": 1e-4}
# and the EMA states, which those choices move apart element by element (4.8e-3 in a running_mean on
# torch 2.14.1), compared as one vector: 2.9e-4 of its norm apart on torch 2.14.1 (yolov10n)
E2E_STATE_RTOL = 3e-3


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("shapes")
    return str(make_shapes_dataset(root, n_train=16, n_val=8, imgsz=64, seed=0))


class Run:
    """One training run: the YOLO object, its per-iteration losses, a mid-run checkpoint and the
    model's state when training started."""

    def __init__(self, model: YOLO, losses: list[float], mid: Path, start: dict[str, torch.Tensor]):
        self.model, self.losses, self.mid, self.start = model, losses, mid, start
        self.trainer = model.trainer


def _train(data: str, project: Path, trainer=None, optimizer: str = "SGD", epochs: int = 2,
           resume: Path | None = None, model: str = "yolov5n.yaml", **train_args) -> Run:
    name = (f"{trainer.__name__ if trainer else 'stock'}-{optimizer}-{Path(model).stem}"
            f"{'-' + resume.stem if resume else ''}{''.join(f'-{k}{v}' for k, v in train_args.items())}")
    model = YOLO(str(resume) if resume else model)
    losses: list[float] = []
    mid = project / f"{name}-epoch1.pt"
    model.add_callback("on_train_batch_end", lambda t: losses.append(float(t.loss.detach())))
    start: dict[str, torch.Tensor] = {}
    model.add_callback("on_train_start",
                       lambda t: start.update({k: v.clone() for k, v in t.model.state_dict().items()}))

    def keep_first_checkpoint(t):  # a checkpoint with optimizer state, as an interrupted run leaves it
        if t.epoch == 0:
            shutil.copyfile(t.last, mid)

    model.add_callback("on_model_save", keep_first_checkpoint)
    extra = {"trainer": trainer} if trainer else {}
    if resume:  # into a folder of its own (the checkpoint names the interrupted run's)
        model.train(resume=True, save_dir=str(project / name), **extra)
    else:
        model.train(data=data, epochs=epochs, imgsz=64, batch=4, nbs=8, workers=0, device="cpu", plots=False,
                    val=False, seed=0, deterministic=True, verbose=False, optimizer=optimizer,
                    box=7.5 * GAIN, cls=0.5 * GAIN, dfl=1.5 * GAIN, project=str(project), name=name,
                    exist_ok=True, **extra, **train_args)
    return Run(model, losses, mid, start)


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    """Runs per (trainer, optimizer), made on first use: trainer None is stock ultralytics."""
    project = tmp_path_factory.mktemp("runs")
    made: dict[tuple, Run] = {}

    def get(trainer, optimizer: str = "SGD", model: str = "yolov5n.yaml") -> Run:
        key = (trainer, optimizer, model)
        if key not in made:
            made[key] = _train(data, project, trainer, optimizer, model=model)
        return made[key]

    return get


def _assert_same_state(a: nn.Module, b: nn.Module, **tol) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        if tol:
            torch.testing.assert_close(sa[k], sb[k], **tol, msg=lambda m, k=k: f"{k}: {m}")
        else:
            assert torch.equal(sa[k], sb[k]), k


def _optimizer_states(opt: torch.optim.Optimizer) -> list[dict]:
    return [opt.state_dict()["state"][i] for i in sorted(opt.state_dict()["state"])]


# ---- whole runs -----------------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer,fused_cls", [("SGD", trainfuse.FusedSGD),
                                                 ("AdamW", trainfuse.FusedAdamW),
                                                 ("MuSGD", trainfuse.FusedMuSGD)])
@pytest.mark.cpu_training
def test_fused_optimizer_phase_trains_exactly_like_stock(runs, optimizer, fused_cls):
    stock, fused = runs(None, optimizer), runs(FusedStepTrainer, optimizer)
    assert type(fused.trainer.optimizer) is fused_cls
    for key in ("muon", "sgd"):  # MuSGD's factors, which ultralytics sets (0.2, 1.0)
        assert getattr(fused.trainer.optimizer, key, None) == getattr(stock.trainer.optimizer, key, None)
    assert fused.trainer.fused_reason == ""
    # ultralytics' own param groups: same keys and values, same params in the same order
    groups = zip(stock.trainer.optimizer.param_groups, fused.trainer.optimizer.param_groups, strict=True)
    for gs, gf in groups:
        assert {k: v for k, v in gs.items() if k != "params"} == {k: gf[k] for k in gf if k != "params"}
        assert [p.shape for p in gs["params"]] == [p.shape for p in gf["params"]]
    assert fused.losses == stock.losses and len(fused.losses) == 8
    assert isinstance(fused.trainer.ema, trainfuse.FusedEMA)
    assert fused.trainer.ema.updates == stock.trainer.ema.updates == STEPS_IN_TWO_EPOCHS
    _assert_same_state(fused.trainer.model, stock.trainer.model)
    _assert_same_state(fused.trainer.ema.ema, stock.trainer.ema.ema)
    for a, b in zip(_optimizer_states(fused.trainer.optimizer), _optimizer_states(stock.trainer.optimizer),
                    strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)
    assert fused.trainer.metrics.keys() == stock.trainer.metrics.keys()  # validated like stock


@pytest.mark.cpu_training
@pytest.mark.parametrize("optimizer", ["NAdam"])
def test_optimizers_without_fused_kernel_stay_stock(runs, optimizer):
    stock, fused = runs(None, optimizer), runs(FusedStepTrainer, optimizer)
    assert type(fused.trainer.optimizer) is type(stock.trainer.optimizer)
    assert type(fused.trainer.optimizer).__name__ == optimizer
    assert optimizer in fused.trainer.fused_reason
    assert isinstance(fused.trainer.ema, trainfuse.FusedEMA)  # the EMA is fused all the same
    assert fused.losses == stock.losses
    assert fused.trainer.ema.updates == stock.trainer.ema.updates == STEPS_IN_TWO_EPOCHS
    _assert_same_state(fused.trainer.ema.ema, stock.trainer.ema.ema)


@pytest.mark.cpu_training
def test_fused_trainer_with_fused_loss_tracks_stock(runs):
    stock, fused = runs(None), runs(FusedDetectionTrainer)
    rows = {r.kind: r for r in fused.trainer.report}
    assert rows["loss"].action == "swapped" and rows["loss"].detail.startswith("FusedDetectionLoss")
    assert not isinstance(fused.trainer.model.criterion, FusedDetectionLoss)  # ultralytics' own again
    assert isinstance(fused.trainer.train_loader.collate_fn, PadTargets)  # labels padded by the loader
    # the fused loss rounds differently from ultralytics' (float32 throughout): close, not equal
    torch.testing.assert_close(fused.losses, stock.losses, **FUSED_LOSS)
    assert fused.trainer.ema.updates == stock.trainer.ema.updates == STEPS_IN_TWO_EPOCHS
    _assert_same_state(fused.trainer.ema.ema, stock.trainer.ema.ema, **FUSED_LOSS_WEIGHTS)


@pytest.mark.cpu_training
def test_checkpoint_loads_validates_and_predicts_with_stock_yolo(runs, data, tmp_path):
    fused = runs(FusedDetectionTrainer)
    ckpt = torch.load(fused.mid, weights_only=False)
    assert ckpt["updates"] == fused.trainer.ema.updates - 2  # epoch 1 held 3 of the 5 steps
    assert ckpt["optimizer"]["param_groups"][0]["param_group"] == "weight"
    for weights in (fused.trainer.last, fused.trainer.best, fused.mid):
        model = YOLO(str(weights))
        metrics = model.val(data=data, imgsz=64, batch=4, device="cpu", workers=0, plots=False, verbose=False,
                            project=str(tmp_path), name="val")
        assert 0.0 <= metrics.box.map50 <= 1.0
        image = next((Path(data).parent / "images" / "val").iterdir())
        (result,) = model.predict(str(image), imgsz=64, device="cpu", verbose=False, project=str(tmp_path))
        assert result.boxes is not None


@pytest.mark.parametrize("made_by", [None, FusedDetectionTrainer],
                         ids=["stock-checkpoint", "fused-checkpoint"])
@pytest.mark.cpu_training
def test_resume_with_either_trainer_matches_stock_resume(runs, made_by, tmp_path):
    source = runs(made_by).mid
    resumed = {}
    for trainer in (None, FusedStepTrainer, FusedDetectionTrainer):
        ckpt = tmp_path / f"{trainer.__name__ if trainer else 'stock'}.pt"
        shutil.copyfile(source, ckpt)  # each resume gets its own copy of the interrupted run
        resumed[trainer] = _train("", tmp_path, trainer, resume=ckpt)
        assert resumed[trainer].trainer.start_epoch == 1
        assert len(resumed[trainer].losses) == 4
        assert resumed[trainer].trainer.ema.updates == STEPS_IN_TWO_EPOCHS
    stock, ours = resumed[None], resumed[FusedStepTrainer]
    assert isinstance(ours.trainer.ema, trainfuse.FusedEMA)
    assert isinstance(ours.trainer.optimizer, trainfuse.FusedSGD)
    assert ours.losses == stock.losses
    _assert_same_state(ours.trainer.ema.ema, stock.trainer.ema.ema)
    _assert_same_state(ours.trainer.model, stock.trainer.model)
    full = resumed[FusedDetectionTrainer]
    assert {r.kind: r.detail for r in full.trainer.report}["loss"].startswith("FusedDetectionLoss")
    torch.testing.assert_close(full.losses, stock.losses, **FUSED_LOSS)


# ---- the optimizer phase, step by step --------------------------------------------------------------
class _Small(nn.Sequential):
    @property
    def model(self) -> nn.Sequential:  # where MuSGD's build_optimizer looks for the head (model[-1])
        return self


def _small_model() -> nn.Module:
    return _Small(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.SiLU(), nn.Conv2d(8, 5, 1))


def _trainer_pair(data, tmp_path, optimizer, device, scaler: bool):
    """A stock and a fused trainer over copies of one small model, set up as _setup_train does."""
    base = _small_model().to(device)
    pair = []
    for cls in (DetectionTrainer, FusedStepTrainer):
        where = "0" if device.type == "cuda" else "cpu"
        tr = cls(overrides=dict(model="yolov5n.yaml", data=data, device=where, project=str(tmp_path),
                                name=cls.__name__, exist_ok=True, plots=False, verbose=False))
        tr.model = copy.deepcopy(base)
        tr.optimizer = tr.build_optimizer(tr.model, name=optimizer, lr=0.01, momentum=0.937, decay=5e-4)
        tr.scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10, enabled=scaler)
        tr.ema = ModelEMA(tr.model)
        pair.append(tr)
    stock, fused = pair
    if scaler and device.type == "cpu":  # ultralytics only ever makes "cuda" scalers: a CPU one here
        fused.scaler = trainfuse.amp.GradScaler("cpu", init_scale=2.0**10)
    fused.after_setup()  # the trainer's changes, as after ultralytics' own setup
    return stock, fused


@pytest.mark.parametrize("optimizer", ["RMSprop", "NAdam", "RAdam", "Adamax"])
def test_build_optimizer_leaves_other_optimizers_stock(data, tmp_path, optimizer, device):
    stock, fused = _trainer_pair(data, tmp_path, optimizer, device, scaler=False)
    assert type(fused.optimizer) is type(stock.optimizer) and type(fused.optimizer).__name__ == optimizer
    assert fused.fused_reason.startswith(f"{optimizer} has no fused counterpart")
    assert not fused.fused
    grads = [torch.randn_like(p) for p in stock.model.parameters()]
    _step((stock, fused), 0, grads)  # stock optimizer_step, with the FusedEMA
    assert fused.ema.updates == stock.ema.updates == 1
    tol = {} if device.type == "cpu" else CLIPPED
    _assert_same_state(fused.model, stock.model)
    _assert_same_state(fused.ema.ema, stock.ema.ema, **tol)


def _step(trainers, k: int, grads: list[torch.Tensor], poison: bool = False) -> None:
    """One iteration's optimizer work on each trainer: warmup lr and momentum written into the
    groups as _do_train writes them, a forward's BN statistics, the same (scaled) grads."""
    for tr in trainers:
        for group in tr.optimizer.param_groups:
            group["lr"] = 0.1 / (k + 1) if group.get("param_group") == "bias" else 0.002 * (k + 1)
            if "momentum" in group:
                group["momentum"] = 0.8 + 0.03 * k
        bn = tr.model[1]
        with torch.no_grad():
            bn.running_mean.add_(0.1 * (k + 1))
            bn.running_var.mul_(1.01)
        scale = tr.scaler.scale(torch.ones((), device=grads[0].device)) if tr.scaler.is_enabled() else 1.0
        for p, g in zip(tr.model.parameters(), grads):
            p.grad = g * scale
        if poison:
            tr.model[0].weight.grad[0, 0, 0, 0] = float("inf")
        tr.optimizer_step()


@pytest.mark.parametrize("backend", ["torch", "kernels"])
@pytest.mark.parametrize("optimizer", ["SGD", "AdamW", "Adam", "MuSGD"])
def test_optimizer_step_matches_stock(data, tmp_path, optimizer, backend, request, device):
    if backend == "kernels":
        request.getfixturevalue("kernels")
    stock, fused = _trainer_pair(data, tmp_path, optimizer, device, scaler=False)
    assert type(fused.optimizer).__name__ == f"Fused{optimizer}"
    exact = backend == "torch" and device.type == "cpu"
    for k, size in enumerate((0.1, 30.0, 0.1, 0.1)):  # step 1's gradient norm is far above the clip at 10
        grads = [torch.randn_like(p) * size for p in stock.model.parameters()]
        _step((stock, fused), k, grads)
        assert fused.ema.updates == stock.ema.updates == k + 1
        tol = {} if exact and k == 0 else CLIPPED
        _assert_same_state(fused.model, stock.model, **tol)
        _assert_same_state(fused.ema.ema, stock.ema.ema, **tol)
        assert all(p.grad is None for p in fused.model.parameters())  # zero_grad as stock


@pytest.mark.parametrize("optimizer", ["SGD", "MuSGD"])
@pytest.mark.parametrize("backend", ["torch", "kernels"])
def test_ema_updates_after_a_skipped_step_like_stock(data, tmp_path, backend, optimizer, request, device):
    if backend == "kernels":  # the inf check, the skip and the EMA fold in the kernels
        request.getfixturevalue("kernels")
    stock, fused = _trainer_pair(data, tmp_path, optimizer, device, scaler=True)
    tol = {} if backend == "torch" and device.type == "cpu" else CLIPPED
    grads = [torch.randn_like(p) * 0.1 for p in stock.model.parameters()]  # norm below the clip
    _step((stock, fused), 0, grads)
    weights = copy.deepcopy(fused.model.state_dict())
    ema_before = copy.deepcopy(fused.ema.ema.state_dict())
    _step((stock, fused), 1, grads, poison=True)  # GradScaler skips this step
    assert fused.scaler.get_scale() == stock.scaler.get_scale() == 2.0**9
    assert fused.ema.updates == stock.ema.updates == 2  # ... and the EMA still counts it
    for k, v in fused.model.state_dict().items():
        if k.endswith(("weight", "bias")):
            assert torch.equal(v, weights[k]), k  # weights untouched
    moved = [k for k, v in fused.ema.ema.state_dict().items() if not torch.equal(v, ema_before[k])]
    assert "1.running_mean" in moved and "0.weight" in moved  # toward the buffers and the unchanged weights
    _assert_same_state(fused.ema.ema, stock.ema.ema, **tol)
    _step((stock, fused), 2, grads)
    _assert_same_state(fused.model, stock.model, **tol)
    _assert_same_state(fused.ema.ema, stock.ema.ema, **tol)


@cuda
def test_fp16_inf_skips_the_step_in_two_launches(data, tmp_path):
    """Real AMP on the GPU: a float16 forward whose gradient overflows, GradScaler skips the step
    and backs off, the EMA still updates as stock's does; the fused optimizer phase is two
    launches (the scale update inside the first)."""
    device = torch.device("cuda")
    stock, fused = _trainer_pair(data, tmp_path, "SGD", device, scaler=True)
    assert type(fused.scaler) is trainfuse.amp.GradScaler
    x = torch.randn(4, 3, 16, 16, device=device)

    def backward(tr, overflow: bool):
        with torch.autocast("cuda", dtype=torch.float16):
            out = tr.model(x)
        # an overflowing loss: its float16 gradients are inf (the forward and BN statistics stay finite)
        loss = out.float().square().mean() * (1e8 if overflow else 1.0)
        tr.scaler.scale(loss).backward()

    for k, overflow in enumerate((False, True, False)):
        for tr in (stock, fused):
            backward(tr, overflow)
        if overflow:
            assert not torch.isfinite(fused.model[0].weight.grad).all()
            weights = copy.deepcopy(fused.model.state_dict())
        for tr in (stock, fused):
            tr.optimizer_step()
        if overflow:
            assert fused.scaler.get_scale() == stock.scaler.get_scale() == 2.0**9
            for name, v in fused.model.named_parameters():
                assert torch.equal(v, weights[name]), name
        assert fused.ema.updates == stock.ema.updates == k + 1
        _assert_same_state(fused.ema.ema, stock.ema.ema, rtol=1e-4, atol=1e-5)
    # in a training loop the caching allocator hands the grads back where the last step had them;
    # after the overflow step they may land elsewhere once, which re-uploads the grad column (one
    # copy): one more plain step first, then the phase is exactly the two kernels
    backward(fused, False)
    fused.optimizer_step()
    backward(fused, False)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fused.optimizer_step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(names) == 2, names
    assert "grad_stats_kernel" in names[0] and "update_kernel" in names[1], names


@cuda
def test_warmup_changes_lr_and_momentum_without_host_syncs_or_recompiles(data, tmp_path):
    """ultralytics' warmup writes new lr and momentum floats into the groups every iteration: the
    fused steps take them with no host sync (CUDA's sync debug mode raises on one) and no Triton
    compile, and follow them as stock's steps do."""
    import triton

    stock, fused = _trainer_pair(data, tmp_path, "SGD", torch.device("cuda"), scaler=True)
    grads = [torch.randn_like(p) * 0.1 for p in fused.model.parameters()]
    _step((stock, fused), 0, grads)  # the first step builds the tables and compiles the kernels
    torch.cuda.synchronize()
    compiled = []
    hook = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda *args, **kwargs: compiled.append(kwargs.get("fn"))
    try:
        for k in range(1, 5):
            with no_host_sync():
                _step((fused,), k, grads)
            _step((stock,), k, grads)  # stock's unscale_ reads found_inf on the host
    finally:
        triton.knobs.runtime.jit_post_compile_hook = hook
    assert compiled == []
    assert fused.optimizer.param_groups[0]["momentum"] == pytest.approx(0.8 + 0.03 * 4)
    _assert_same_state(fused.model, stock.model, **CLIPPED)
    _assert_same_state(fused.ema.ema, stock.ema.ema, **CLIPPED)


@pytest.mark.parametrize("model,right", [("yolov8n-seg.yaml", "FusedSegmentationTrainer"),
                                         ("yolov8n-pose.yaml", "FusedPoseTrainer"),
                                         ("yolov8n-obb.yaml", "FusedOBBTrainer"),
                                         ("yolov8n-cls.yaml", "FusedClassificationTrainer")])
def test_another_tasks_model_is_refused_with_its_trainer_named_before_training(data, tmp_path, model, right):
    expected = (rf"FusedDetectionTrainer trains task 'detect'; this run's task is "
                rf"'(segment|pose|obb|classify)' \(model={model}\): train it with {right}")
    with pytest.raises(ValueError, match=expected):
        YOLO(model).train(trainer=FusedDetectionTrainer, data=data, epochs=1, imgsz=64, device="cpu",
                          project=str(tmp_path), plots=False)
    assert not any(tmp_path.rglob("*.pt"))  # nothing trained


@pytest.mark.cpu_training
def test_fuse_blocks_swaps_every_conv_block_and_gives_it_back(runs, monkeypatch):
    monkeypatch.setenv("TRAINFUSE_FUSE_CONCAT", "0")  # the blocks alone: stock's numbers bit for bit
    plain, blocks = runs(FusedStepTrainer), runs(FusedBlocksStepTrainer)
    assert blocks.losses == plain.losses
    _assert_same_state(blocks.trainer.model, plain.trainer.model)
    _assert_same_state(blocks.trainer.ema.ema, plain.trainer.ema.ema)
    row = {r.kind: r for r in blocks.trainer.report}["blocks"]
    count = sum(type(m).__name__ == "Conv" for m in blocks.trainer.model.modules())
    assert row.action == "on" and row.detail.startswith(f"{count} Conv blocks: BatchNorm2d and SiLU as one")
    assert row.detail.endswith("; 1 SPPF blocks: the poolings and their concatenation as one op (one launch "
                               "forward, one backward)")
    assert not any("forward" in m.__dict__ for m in blocks.trainer.model.modules())  # given back
    upsampling = {r.kind: r for r in blocks.trainer.report}["upsample"]  # AMP is off on the CPU
    assert upsampling.action == "off" and upsampling.detail == "no AMP on CUDA: autocast casts nothing"
    off = {r.kind: r for r in plain.trainer.report}["blocks"]  # fuse_blocks=None on the CPU
    assert off.action == "off" and off.detail == NOT_CUDA_BLOCKS


@pytest.mark.cpu_training
def test_concatenations_written_in_place_train_like_stock_and_come_back(runs, monkeypatch):
    monkeypatch.setenv("TRAINFUSE_FUSE_CONCAT", "1")
    plain, concat = runs(FusedStepTrainer), runs(FusedConcatStepTrainer)
    # the same values; the grads of a branch read twice are summed in another order
    torch.testing.assert_close(concat.losses, plain.losses, rtol=1e-5, atol=1e-6)
    _assert_same_state(concat.trainer.model, plain.trainer.model, rtol=1e-4, atol=1e-6)
    row = {r.kind: r for r in concat.trainer.report}["blocks"]
    csp = sum(type(m).__name__ == "C3" for m in concat.trainer.model.modules())
    assert csp == 8 and f"; {csp} C2f and C3 blocks: each branch written into its slice" in row.detail
    assert not any("forward" in m.__dict__ for m in concat.trainer.model.modules())  # given back


@pytest.mark.cpu_training
def test_frozen_layers_keep_their_weights_and_the_rest_trains_like_stock(data, tmp_path, monkeypatch):
    """``freeze=3`` (ultralytics' first three layers: two Conv blocks and a C3) with the fused
    optimizer phase, the blocks fused and the C3 blocks' concatenations in place: the frozen
    weights and their BatchNorms' running statistics stay as they started (ultralytics puts those
    BatchNorms in eval mode, so the fused blocks normalize them with the running statistics), the
    layers after them train, and the run is stock's."""
    monkeypatch.setenv("TRAINFUSE_FUSE_CONCAT", "1")
    stock = _train(data, tmp_path, None, freeze=3)
    fused = _train(data, tmp_path, FusedConcatStepTrainer, freeze=3)
    assert {r.kind: r for r in fused.trainer.report}["blocks"].action == "on"
    torch.testing.assert_close(fused.losses, stock.losses, rtol=1e-5, atol=1e-6)
    _assert_same_state(fused.trainer.model, stock.trainer.model, rtol=1e-4, atol=1e-6)
    built, trained = fused.start, fused.trainer.model.state_dict()
    frozen = [k for k in trained if k.startswith(("model.0.", "model.1.", "model.2."))]
    weights = [k for k in frozen if k.endswith((".weight", ".bias"))]
    statistics = [k for k in frozen if k.endswith(".running_mean")]
    assert len(weights) > 10 and len(statistics) > 4
    assert all(torch.equal(trained[k], built[k]) for k in weights + statistics)
    for k in ("model.4.cv1.conv.weight", "model.4.cv1.bn.running_mean", "model.3.bn.running_var"):
        assert not torch.equal(trained[k], built[k]), k


@pytest.mark.cpu_training
def test_the_report_says_what_was_fused_and_what_stayed_stock(runs):
    fused, step_only = runs(FusedDetectionTrainer), runs(FusedStepTrainer)
    rows = {r.kind: r for r in fused.trainer.report}
    assert rows["optimizer"].action == "swapped" and "FusedSGD over ultralytics'" in rows["optimizer"].detail
    assert rows["loss"].action == "swapped" and rows["graphs"].action == "skipped"
    assert "the device is cpu, not CUDA" in rows["graphs"].detail
    assert rows["validator"].action == "on" and rows["validator"].name == "FusedDetectionValidator"
    assert rows["val workers"].action == "off" and rows["val workers"].detail.startswith("val=False")
    assert rows["device cache"].action == "off" and "on for CUDA devices only" in rows["device cache"].detail
    assert rows["upsample"].action == "off" and rows["upsample"].detail == NOT_CUDA_BLOCKS
    assert rows["convolutions"].action == "off" and rows["convolutions"].detail == "cudnn_benchmark=False"
    off = {r.kind: r for r in step_only.trainer.report}["loss"]
    assert off.action == "off"
    assert off.detail == "fused_loss=False (fused_loss=True trains with FusedDetectionLoss)"


@pytest.mark.cpu_training
@pytest.mark.parametrize("model", ["yolo26n.yaml", "yolov10n.yaml"])
def test_end_to_end_models_train_with_the_fused_e2e_loss_like_stock(runs, model):
    stock, fused = runs(None, "SGD", model), runs(FusedDetectionTrainer, "SGD", model)
    assert isinstance(fused.trainer.train_loader.collate_fn, PadTargets)
    rows = {r.kind: r for r in fused.trainer.report}
    assert rows["loss"].action == "swapped" and rows["loss"].detail.startswith("FusedE2ELoss")
    torch.testing.assert_close(fused.losses[0], stock.losses[0], **E2E_FIRST)
    torch.testing.assert_close(fused.losses, stock.losses, **E2E_RUN)
    assert fused.trainer.ema.updates == stock.trainer.ema.updates
    sa, sb = fused.trainer.ema.ema.state_dict(), stock.trainer.ema.ema.state_dict()
    assert sa.keys() == sb.keys()
    a, b = (torch.cat([v.double().flatten() for v in s.values() if v.is_floating_point()]) for s in (sa, sb))
    assert (a - b).norm() <= E2E_STATE_RTOL * b.norm()
