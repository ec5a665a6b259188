"""CapturedStep: a training step captured per input shape trains exactly as the same step run eagerly.

Off CUDA only the argument checks run; the GPU tests compare a captured run with an eager run of an
identical copy of the model on the same batches, in the same order.
"""

from __future__ import annotations

import copy
import warnings
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F

import trainfuse
from tests._helpers import cuda
from trainfuse.graphs import CapturedStep, StepStats
from trainfuse.graphs.step import _static_outputs
from trainfuse.graphs.tree import unflatten


# ---- off CUDA: arguments ------------------------------------------------------------------------
def test_cpu_inputs_are_refused_before_fn_runs():
    calls = []
    step = CapturedStep(lambda x, y: calls.append(1), name="train")
    x = torch.randn(4, 3)
    before = x.clone()
    expected = "CapturedStep 'train': input 0 is on cpu; CapturedStep needs CUDA tensors"
    with pytest.raises(ValueError, match=expected):
        step(x, torch.randn(4))
    assert calls == [] and torch.equal(x, before)
    assert step.stats == StepStats()


@pytest.mark.parametrize("inputs, error, message", [
    ((), ValueError, "no inputs"),
    ((3.0,), TypeError, "input 0 is a float; inputs must be CUDA tensors"),
    ((None,), TypeError, "input 0 is a NoneType"),
], ids=["none", "float", "None"])
def test_inputs_that_are_not_tensors_are_refused(inputs, error, message):
    with pytest.raises(error, match=message):
        CapturedStep(lambda *a: None)(*inputs)


def test_bad_arguments_name_themselves():
    with pytest.raises(TypeError, match="fn must be callable"):
        CapturedStep(3)
    with pytest.raises(ValueError, match="warmup must be an int >= 0"):
        CapturedStep(lambda: None, warmup=-1)
    with pytest.raises(ValueError, match="max_graphs must be a positive int"):
        CapturedStep(lambda: None, max_graphs=0)


def test_nothing_to_report_before_the_first_call():
    step = CapturedStep(lambda x: x)
    assert step.stats == StepStats()
    assert step.reasons == {}
    assert step.memory_report() == {"peak_before_capture": None, "peak_now": None}


Pair = namedtuple("Pair", "a b")


def test_outputs_are_detached_and_rebuilt_in_fresh_containers():
    w = torch.randn(3, requires_grad=True)
    out = {"loss": (w * 2).sum(), "parts": [w * 3, None], "pair": Pair(w + 1, w - 1)}
    tensors, structure = _static_outputs(out)  # what a replay rebuilds its return value from
    assert len(tensors) == 4 and not any(t.requires_grad for t in tensors)

    def rebuild():
        return unflatten(structure, iter(tensors))

    static = rebuild()
    assert isinstance(static["pair"], Pair) and not static["pair"].a.requires_grad
    torch.testing.assert_close(static["loss"], out["loss"].detach(), rtol=0, atol=0)

    first, second = rebuild(), rebuild()
    assert isinstance(first["pair"], Pair) and first["parts"][1] is None
    assert first is not second and first["parts"] is not second["parts"]
    assert first["parts"][0] is second["parts"][0]  # the same static tensors
    first["parts"].append("edit")
    assert len(rebuild()["parts"]) == 2


@pytest.mark.parametrize("out, where", [
    ((torch.ones(1), 3.0), r"fn's output\[1\] is a Python float"),
    ({"loss": torch.ones(1), "n": 4}, r"fn's output\['n'\] is a Python int"),
    ("done", "fn's output is a Python str"),
    ({"parts": [torch.ones(1), {"n": None, "scale": 0.5}]},
     r"fn's output\['parts'\]\[1\]\['scale'\] is a Python float"),
])
def test_outputs_a_replay_cannot_reproduce_are_named(out, where):
    with pytest.raises(TypeError, match=where):
        _static_outputs(out)


class Losses(list):
    """A list subclass a step might return."""


def test_a_list_subclass_comes_back_as_a_plain_list():
    tensors, structure = _static_outputs(Losses([torch.ones(1), torch.zeros(1)]))
    back = unflatten(structure, iter(tensors))
    assert type(back) is list and [t.item() for t in back] == [1.0, 0.0]


# ---- on CUDA: training ------------------------------------------------------------------------------
@pytest.fixture
def deterministic():
    """cuDNN's deterministic algorithms, so that eager and captured runs can agree to the last bits."""
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.SiLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4),
    ).cuda()


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = model.parameters()
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=True)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2, capturable=True, foreach=True)
    return trainfuse.FusedSGD(params, lr=0.05, momentum=0.9)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, losses: list | None = None):
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if losses is not None:
            losses.append(loss.item())  # a host sync: cannot be captured
        return loss.detach()

    return step


def _batches(sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(n, 3, 6, 6, device="cuda"), torch.randn(n, 4, device="cuda")) for n in sizes]


def _run_both(sizes: list[int], kind: str = "sgd", **step_kwargs):
    """The same batches through a captured step and an eager step on identical model copies: both
    models, both loss lists (cloned: a replay overwrites its outputs) and the CapturedStep."""
    model = _model()
    ref = copy.deepcopy(model)
    step = CapturedStep(_train_step(model, _optimizer(kind, model)), **step_kwargs)
    ref_step = _train_step(ref, _optimizer(kind, ref))
    losses, ref_losses = [], []
    for x, y in _batches(sizes):
        losses.append(step(x, y).clone())
        ref_losses.append(ref_step(x, y))
    torch.cuda.synchronize()
    return model, ref, losses, ref_losses, step


def _assert_trained_alike(model, ref, losses, ref_losses):
    tol = {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), **tol)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **tol, msg=lambda m, name=name: f"param {name}: {m}")
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):  # running mean/var, batch count
        torch.testing.assert_close(b, c, **tol, msg=lambda m, name=name: f"buffer {name}: {m}")


@cuda
@pytest.mark.parametrize("kind", ["sgd", "adam", "fused_sgd"])
def test_captured_training_matches_eager(kind, deterministic):
    model, ref, losses, ref_losses, step = _run_both([8] * 20, kind)
    _assert_trained_alike(model, ref, losses, ref_losses)
    # first call eager, second captured and replayed, the rest replayed
    assert step.stats == StepStats(eager=1, replays=19, captures=1)
    assert 0 < step.stats.capture_s < 60  # the capture's own time, reported beside the counts


@cuda
def test_each_input_shape_gets_its_own_graph(deterministic):
    sizes = [8, 5, 8, 5, 5, 8, 8, 5, 8, 8, 5, 5]
    model, ref, losses, ref_losses, step = _run_both(sizes)
    _assert_trained_alike(model, ref, losses, ref_losses)
    assert step.stats == StepStats(eager=2, replays=10, captures=2)


@cuda
def test_the_least_recently_used_graph_is_dropped_beyond_max_graphs(deterministic):
    # a a b b c c (drops a) a a (a again from its first sighting: drops b) c
    sizes = [8, 8, 5, 5, 3, 3, 8, 8, 3]
    model, ref, losses, ref_losses, step = _run_both(sizes, max_graphs=2)
    _assert_trained_alike(model, ref, losses, ref_losses)
    assert step.stats == StepStats(eager=4, replays=5, captures=4, evictions=2)


@cuda
def test_a_host_sync_falls_back_to_eager_with_one_warning(deterministic):
    model = _model()
    ref = copy.deepcopy(model)
    seen, ref_seen = [], []
    step = CapturedStep(_train_step(model, _optimizer("sgd", model), seen), name="with_item")
    ref_step = _train_step(ref, _optimizer("sgd", ref), ref_seen)
    sizes = [8, 8, 8, 5, 5, 5, 8]
    losses, ref_losses = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in _batches(sizes):
            losses.append(step(x, y))
            ref_losses.append(ref_step(x, y))
    ours = [w for w in caught if issubclass(w.category, RuntimeWarning) and "CapturedStep" in str(w.message)]
    assert len(ours) == 1 and "'with_item'" in str(ours[0].message)
    _assert_trained_alike(model, ref, losses, ref_losses)
    assert seen == pytest.approx(ref_seen, rel=1e-5, abs=1e-6) and len(seen) == len(sizes)
    assert step.stats == StepStats(eager=7, fallbacks=2)
    assert len(step.reasons) == 2
    # found in the eager first sighting: no capture is attempted
    assert all("synchronizes with the host" in reason for reason in step.reasons.values()), step.reasons


@cuda
def test_replay_reads_each_calls_inputs_and_returns_its_static_outputs():
    calls = []

    def fn(x):
        calls.append(1)
        return {"double": x * 2, "sum": x.sum()}

    step = CapturedStep(fn)
    outs = []
    for _ in range(4):
        x = torch.randn(5, 7, device="cuda")
        out = step(x)
        torch.testing.assert_close(out["double"], x * 2, rtol=0, atol=0)
        torch.testing.assert_close(out["sum"], x.sum())
        outs.append(out)
    assert len(calls) == 2  # the eager call and the capture: replays run no Python
    # replays of one key hand back the same static tensors: the next replay overwrites them
    assert outs[2]["double"].data_ptr() == outs[3]["double"].data_ptr()
    assert not outs[3]["double"].requires_grad


@cuda
def test_warmup_runs_fn_before_capturing():
    calls = []

    def fn(x):
        calls.append(1)
        return x + 1

    step = CapturedStep(fn, warmup=2)
    for _ in range(4):
        x = torch.randn(3, device="cuda")
        torch.testing.assert_close(step(x), x + 1, rtol=0, atol=0)
    assert len(calls) == 1 + 2 + 1  # first sighting, two warm-ups, the capture
    assert step.stats == StepStats(eager=1, replays=3, captures=1)


@cuda
def test_an_output_a_replay_cannot_reproduce_falls_back():
    def fn(x):
        return x * 2, 3.0

    step = CapturedStep(fn)
    with pytest.warns(RuntimeWarning, match=r"fn's output\[1\] is a Python float"):
        for _ in range(3):
            x = torch.randn(4, device="cuda")
            out = step(x)
            torch.testing.assert_close(out[0], x * 2, rtol=0, atol=0)
            assert out[1] == 3.0
    assert step.stats == StepStats(eager=3, fallbacks=1)


@cuda
def test_bad_cuda_inputs_are_refused():
    step = CapturedStep(lambda x, y: x)
    x = torch.randn(3, device="cuda")
    with pytest.raises(ValueError, match="input 1 is on cpu; CapturedStep needs CUDA tensors"):
        step(x, torch.randn(3))
    with pytest.raises(ValueError, match="input 0 requires grad"):
        step(x.requires_grad_(), x.detach())
    assert step.stats == StepStats()


@cuda
def test_memory_report_brackets_the_first_capture():
    step = CapturedStep(lambda x: x @ x)
    x = torch.randn(64, 64, device="cuda")
    step(x)
    assert step.memory_report()["peak_before_capture"] is None
    step(x)
    report = step.memory_report()
    assert report["peak_before_capture"] >= x.numel() * x.element_size()
    assert report["peak_now"] >= report["peak_before_capture"]
