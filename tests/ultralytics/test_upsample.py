"""The neck's nearest upsamplings in 16 bits (trainfuse.ultralytics.changes.upsample): which layers
qualify in ultralytics' models, which of them join the Concat after them as one op, a model's step
with them joined (CPU, float32) and on a GPU under AMP, bit for bit stock's with them changed."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

from trainfuse.ultralytics.offline import offline_env

offline_env(Path(tempfile.gettempdir()) / "trainfuse-tests-yolo-config")
pytest.importorskip("ultralytics")

from ultralytics.nn.modules.conv import Concat  # noqa: E402
from ultralytics.nn.tasks import ClassificationModel, DetectionModel  # noqa: E402

from tests._helpers import cuda  # noqa: E402
from trainfuse.nn import upsample  # noqa: E402
from trainfuse.ultralytics.changes import upsample as change  # noqa: E402
from trainfuse.ultralytics.changes.upsample import exact_upsamplings  # noqa: E402


@pytest.mark.parametrize("cfg,changed,total", [
    ("yolo11n.yaml", 2, 2), ("yolo26n.yaml", 2, 2), ("yolov3-tinyu.yaml", 1, 1),
    ("yolov5n.yaml", 0, 2),  # C3 reads the Concat in two convolutions: grads added in float16
    ("yolov9t.yaml", 0, 2),  # RepNCSPELAN4 reads the Concat: not a block the change knows
])
def test_the_necks_upsamplings_that_feed_a_concat_read_by_one_convolution(cfg, changed, total):
    model = DetectionModel(cfg, nc=3, verbose=False)
    found, n = exact_upsamplings(model)
    assert (len(found), n) == (changed, total)
    assert all(type(m) is nn.Upsample for m in found)


def test_an_upsampling_read_by_anything_but_one_concat_stays():
    model = DetectionModel("yolo11n.yaml", nc=3, verbose=False)
    found, _ = exact_upsamplings(model)
    layers = model.model
    first = found[0].i
    assert type(layers[first + 1]) is Concat
    concat_f = layers[first + 1].f
    layers[first + 1].f = [-1, first - 1]  # still one Concat reading it once: still changed
    assert found[0] in exact_upsamplings(model)[0]
    layers[first + 1].f = [-1, -1]  # read twice: its grads added in float16, so it stays
    assert found[0] not in exact_upsamplings(model)[0]
    layers[first + 1].f = concat_f
    concat = layers[first + 1]
    layers[first + 1] = nn.Identity()  # what reads it is no Concat now
    layers[first + 1].f, layers[first + 1].i = concat.f, concat.i
    assert found[0] not in exact_upsamplings(model)[0]


def test_no_upsampling_in_a_classifier_or_a_plain_module():
    assert exact_upsamplings(ClassificationModel("yolo11n-cls.yaml", nc=3, verbose=False)) == ([], 0)
    assert exact_upsamplings(nn.Sequential(nn.Upsample(scale_factor=2))) == ([], 0)


@pytest.mark.parametrize("cfg,pairs,wide", [("yolo11n.yaml", 2, 0), ("yolo26n.yaml", 2, 0),
                                           ("yolov3-tinyu.yaml", 1, 0), ("yolov5n.yaml", 2, 2),
                                           ("yolov9t.yaml", 2, 2)])
def test_each_upsampling_into_a_concat_of_two_becomes_one_op_and_comes_back(cfg, pairs, wide):
    """Every neck's upsamplings join their Concat: in 16 bits where that is exact, else (yolov5's
    C3, yolov9's RepNCSPELAN4 read the Concat) in float32 as autocast computes them."""
    model = DetectionModel(cfg, nc=3, verbose=False)
    changed, joined, total = change.install(model)
    assert (len(changed), len(joined), total) == (0, pairs, pairs)
    assert sum(as_autocast for _, _, as_autocast in joined) == wide
    assert all("forward" in up.__dict__ and "forward" in concat.__dict__ for up, concat, _ in joined)
    change.uninstall(changed, joined)
    assert not any("forward" in m.__dict__ for m in model.modules())
    up = [m for m in model.model if upsample.nearest(m)][0]
    up.scale_factor = 3.0  # not a doubling: in 16 bits where that is exact, never joined
    changed, joined, _ = change.install(model)
    assert (up in changed) == (wide == 0) and all(u is not up for u, _, _ in joined)
    change.uninstall(changed, joined)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run of the kernels; on a GPU "
                    "test_a_models_step_under_amp_is_stocks_bit_for_bit runs them")
@pytest.mark.parametrize("cfg", ["yolo11n.yaml", "yolov5n.yaml"])
def test_a_model_with_its_upsamplings_joined_to_their_concats_takes_stocks_step(cfg, kernels):
    """float32 (no autocast on the CPU): the joined op's forward and backward inside a whole model,
    bit for bit the stock model's, the kernels through the interpreter."""
    torch.manual_seed(0)
    model = DetectionModel(cfg, nc=3, verbose=False).train()
    x = torch.randn(2, 3, 64, 64)
    ref_out, ref_grads = _step(model, x, autocast=False)
    changed, joined, _ = change.install(model)
    assert joined
    out, grads = _step(model, x, autocast=False)
    change.uninstall(changed, joined)
    assert all(torch.equal(a, b) for a, b in zip(out, ref_out))
    differ = [k for k in grads if not torch.equal(grads[k], ref_grads[k])]
    assert not differ, differ


def _step(model: nn.Module, x: torch.Tensor, autocast: bool = True):
    """The model's outputs and grads of one forward and backward (under float16 autocast on CUDA
    with ``autocast``); its state (the BatchNorms' running statistics) as before."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=torch.float16, enabled=autocast):
        out = model(x)
    outs = _tensors(out)
    sum((o.float() * (i + 1)).square().mean() for i, o in enumerate(outs)).backward()
    model.load_state_dict(state)
    return [o.detach().clone() for o in outs], {k: p.grad.clone() for k, p in model.named_parameters()
                                                if p.grad is not None}


def _tensors(out) -> list[torch.Tensor]:
    """The tensors of a detection model's training output (a dict of tensors and lists of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    items = out.values() if isinstance(out, dict) else out
    return [t for item in items for t in _tensors(item)]


@cuda
@pytest.mark.parametrize("cfg", ["yolo11n.yaml", "yolo26n.yaml", "yolov3-tinyu.yaml", "yolov5n.yaml"])
def test_a_models_step_under_amp_is_stocks_bit_for_bit(cfg):
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
        _check_step_bit_for_bit(cfg)


def _check_step_bit_for_bit(cfg: str) -> None:
    torch.manual_seed(0)
    model = DetectionModel(cfg, nc=3, verbose=False).cuda().to(memory_format=torch.channels_last).train()
    x = torch.randn(2, 3, 128, 128, device="cuda").to(memory_format=torch.channels_last)
    ref_out, ref_grads = _step(model, x)
    found, _ = exact_upsamplings(model)
    assert all(upsample.install(m) for m in found)
    half = _step(model, x)  # the upsamplings in 16 bits where exact (none in yolov5n), then torch's cat
    for m in found:
        upsample.uninstall(m)
    changed, joined, _ = change.install(model)
    assert joined
    fused = _step(model, x)  # each upsampling and its Concat as one op
    change.uninstall(changed, joined)
    for out, grads in (half, fused):
        assert all(torch.equal(a, b) for a, b in zip(out, ref_out))
        assert grads.keys() == ref_grads.keys()
        differ = [k for k in grads if not torch.equal(grads[k], ref_grads[k])]
        assert not differ, differ
