"""trainfuse.nn.conv_block: a Conv2d-BatchNorm2d-SiLU block with its BatchNorm and SiLU as one op
trains as the block does (outputs, grads, running statistics and the batch count over several
steps, momentum=None's cumulative average, eval mode), keeps its state_dict, deep-copies to the
plain block and comes off again; an ultralytics model with every Conv block fused (and its C2f
blocks' cv1 as two dense halves) takes the same training step as the stock model; a Sequential's
BatchNorm2d + SiLU pairs fuse and come back. Kernels through the interpreter on CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from trainfuse.nn import conv_block

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _kernels(kernels):
    """The Triton kernels (the interpreter on CPU)."""


class Block(nn.Module):
    """ultralytics' ``Conv`` in miniature."""

    def __init__(self, c1: int, c2: int, momentum: float | None = 0.03) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(c2, eps=1e-3, momentum=momentum)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


@pytest.mark.parametrize("momentum", [0.03, None])
@pytest.mark.parametrize("channels_last", [False, True])
def test_a_fused_block_trains_like_the_block(momentum, channels_last):
    plain = Block(3, 5, momentum).to(DEVICE)
    fused = copy.deepcopy(plain)
    assert conv_block.install(fused) and conv_block.installed(fused)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, fused)]
    for step in range(3):
        x = torch.randn(2, 3, 6, 7, device=DEVICE).to(memory_format=fmt)
        outs = []
        for m, opt in zip((plain, fused), opts):
            opt.zero_grad()
            y = m(x)
            (y * torch.linspace(-1, 1, y.numel(), device=DEVICE).view_as(y)).sum().backward()
            opt.step()
            outs.append(y)
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
        for (name, a), (_, b) in zip(plain.named_parameters(), fused.named_parameters()):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"step {step}: {name}")
        for (name, a), (_, b) in zip(plain.named_buffers(), fused.named_buffers()):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"step {step}: {name}")
    assert int(fused.bn.num_batches_tracked) == 3
    # eval on the same state: the three steps' float32 drift (checked above) is not the eval path's
    fused.load_state_dict(plain.state_dict())
    plain.eval()
    fused.eval()
    x = torch.randn(2, 3, 6, 7, device=DEVICE)
    torch.testing.assert_close(fused(x), plain(x), rtol=1e-5, atol=1e-5)


def test_state_dict_copies_and_uninstall_are_the_blocks_own():
    block = Block(3, 4).to(DEVICE)
    keys = list(block.state_dict())
    conv_block.install(block)
    assert list(block.state_dict()) == keys
    twin = copy.deepcopy(block)
    assert not conv_block.installed(twin) and "forward" in twin.__dict__
    assert twin.forward.__func__ is Block.forward and twin.forward.__self__ is twin
    assert not conv_block.install(block)  # already fused: nothing done
    conv_block.uninstall(block)
    assert not conv_block.installed(block) and "forward" not in block.__dict__


def test_only_conv_batchnorm_silu_blocks_are_fusable():
    block = Block(3, 4)
    assert conv_block.fusable(block)
    block.act = nn.ReLU()
    assert not conv_block.fusable(block)
    block = Block(3, 4)
    block.bn = nn.SyncBatchNorm(4)
    assert not conv_block.fusable(block)
    assert not conv_block.fusable(nn.Conv2d(3, 4, 3))


@pytest.mark.cpu_training
@pytest.mark.parametrize(("cfg", "concat", "changed"),
                         [("yolov8n-cls.yaml", False, 4), ("yolo11n-cls.yaml", True, 6)],
                         ids=["yolov8n-halves", "yolo11n-concat"])
def test_an_ultralytics_model_with_its_conv_blocks_fused_takes_stocks_steps(monkeypatch, cfg, concat,
                                                                             changed):
    """The ultralytics client's fusing, with C2f's halves dense (yolov8n), or with every C2f and C3
    block's concatenation written in place (yolo11n: C3k2 blocks with shortcuts, two holding C3k)."""
    pytest.importorskip("ultralytics")
    # float32 convolutions in float32 (cuDNN's default is TF32, whose rounding the 26 BatchNorms
    # amplify past the bound below) and the same algorithms in both models
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    from ultralytics.nn.modules.conv import Conv
    from ultralytics.nn.tasks import ClassificationModel

    torch.manual_seed(0)
    # YOLOv8n's backbone and a classification head: 26 Conv blocks (the interpreter's launches are
    # what a CPU run of this test costs)
    from trainfuse.ultralytics.changes.blocks import fuse_model, unfuse_model

    stock = ClassificationModel(cfg, nc=2, verbose=False).to(DEVICE).train()
    fused = copy.deepcopy(stock)
    blocks, c2f = fuse_model(fused, concat)
    silu = [m for m in fused.modules() if isinstance(m, Conv) and type(m.act) is nn.SiLU]  # not attention's
    assert len(blocks) == len(silu) > 20 and len(c2f) == changed
    x = torch.rand(2, 3, 64, 64, device=DEVICE)
    for model in (stock, fused):
        (model(x).float() ** 2).mean().backward()
    # float32 rounding differs (the fused op's sums in another order), and 20-odd BatchNorms over
    # as few as 8 values a channel (the deepest layers at 64 px) amplify it: each grad within 1e-3
    # of its norm; grads that are zero in exact arithmetic (yolo11n's attention: a BatchNorm's bias
    # read only through the next normalization) come out as float32 noise of norm ~1e-8 in both
    grads = {n: p.grad for n, p in stock.named_parameters()}
    for name, p in fused.named_parameters():
        gap = (p.grad - grads[name]).norm()
        assert gap < 1e-3 * grads[name].norm() + 1e-7, f"{name}: gap {gap:.2e} of {grads[name].norm():.2e}"
    for (name, a), (_, b) in zip(stock.named_buffers(), fused.named_buffers()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    unfuse_model(blocks, c2f)
    assert not any("forward" in m.__dict__ for m in fused.modules())


def test_depthwise_conv_blocks_of_a_yolo11_head_fuse_too():
    """``DWConv`` keeps ``Conv``'s forward: yolo11n's head has six, fused with the rest."""
    pytest.importorskip("ultralytics")
    from ultralytics.nn.modules.conv import Conv, DWConv
    from ultralytics.nn.tasks import DetectionModel

    from trainfuse.ultralytics.changes.blocks import fuse_model, unfuse_model

    model = DetectionModel("yolo11n.yaml", nc=2, verbose=False).to(DEVICE)
    stock = copy.deepcopy(model)
    blocks, c2f = fuse_model(model)
    depthwise = [m for m in blocks if type(m) is DWConv]
    assert len(depthwise) == 6
    assert len(blocks) == sum(isinstance(m, Conv) and type(m.act) is nn.SiLU for m in model.modules())
    name = next(n for n, m in model.named_modules() if m is depthwise[0])
    fused, plain = depthwise[0], stock.get_submodule(name)
    x = torch.randn(2, fused.conv.in_channels, 5, 6, device=DEVICE, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = fused(x), plain(x2)
    torch.testing.assert_close(y, y2, rtol=1e-5, atol=1e-5)
    weights = torch.linspace(-1, 1, y.numel(), device=DEVICE).view_as(y)
    (y * weights).sum().backward()
    (y2 * weights).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fused.bn.weight.grad, plain.bn.weight.grad, rtol=1e-4, atol=1e-5)
    unfuse_model(blocks, c2f)
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("shortcut", [False, True], ids=["yolo11", "yolo26-shortcut"])
def test_sppf_blocks_pool_and_concatenate_in_one_op_as_the_block_does(shortcut):
    """An SPPF block as yolo11's (three 5 x 5 poolings) and as YOLO26's (its shortcut added), at
    few channels: the block with the chain as one op gives the stock block's output and grads bit
    for bit (float32); yolo11n's and yolo26n's own SPPF blocks are the ones the change finds."""
    pytest.importorskip("ultralytics")
    from ultralytics.nn.modules.block import SPPF
    from ultralytics.nn.tasks import DetectionModel

    from trainfuse.ultralytics.changes import sppf

    for cfg in ("yolo11n.yaml", "yolo26n.yaml"):
        model = DetectionModel(cfg, nc=2, verbose=False)
        assert [type(m) for m in sppf.blocks(model)] == [SPPF]
    block = SPPF(8, 8, 5, 3, shortcut).to(DEVICE)
    assert block.add == shortcut and sppf.blocks(block) == [block]
    plain = copy.deepcopy(block)
    sppf.install(block)
    assert sppf.installed(block) and sppf.blocks(block) == []
    assert type(copy.deepcopy(block).forward.__self__) is SPPF  # a copy runs the class's forward
    x = torch.randn(2, 8, 5, 4, device=DEVICE).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    y, y2 = block(x), plain(x2)
    assert torch.equal(y, y2)
    weights = torch.linspace(-1, 1, y.numel(), device=DEVICE).view_as(y)
    (y * weights).sum().backward()
    (y2 * weights).sum().backward()
    assert torch.equal(x.grad, x2.grad)
    for (name, a), (_, b) in zip(block.named_parameters(), plain.named_parameters()):
        assert torch.equal(a.grad, b.grad), name
    sppf.uninstall(block)
    assert "forward" not in block.__dict__
    block.m = torch.nn.MaxPool2d(5, 2, 2)  # a pooling that halves the map: not the op's
    assert sppf.blocks(block) == []


def test_sequential_pairs_fuse_and_come_back():
    seq = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.SiLU(), nn.BatchNorm2d(4),
                        nn.ReLU()).to(DEVICE)
    ref = copy.deepcopy(seq)
    assert conv_block.fusable_pairs(seq) == [1]  # the second BatchNorm is followed by a ReLU
    taken = conv_block.fuse_pairs(seq, [1])
    assert type(seq[1]) is conv_block.BatchNormSiLU2d and type(seq[2]) is nn.Identity
    assert list(seq.state_dict()) == list(ref.state_dict())
    x = torch.randn(2, 3, 6, 6, device=DEVICE)
    torch.testing.assert_close(seq(x), ref(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"expected 4D input \(got 3D input\)"):
        seq[1](x[0])
    conv_block.unfuse_pairs(seq, taken)
    assert type(seq[1]) is nn.BatchNorm2d and type(seq[2]) is nn.SiLU


@pytest.mark.parametrize("kind", ["C2f-n0", "C2f-n2-shortcut", "C3-n0", "C3k2-c3k"])
def test_csp_blocks_with_their_concatenation_in_place_compute_the_stock_block(kind, monkeypatch):
    """A C2f, C3 or C3k2 block with the concatenation written in place, against the stock block
    in channels_last: the same outputs, grads and running statistics (float32: the fused op's
    sums in another order), the ends of the block's range too (no bottleneck; a C3k inside)."""
    pytest.importorskip("ultralytics")
    from ultralytics.nn.modules.block import C3, C2f, C3k2

    from trainfuse.ultralytics.changes import concat_free

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # TF32 makes an ulp 2**-11
    torch.manual_seed(0)
    stock = {"C2f-n0": lambda: C2f(8, 12, n=0), "C2f-n2-shortcut": lambda: C2f(8, 8, n=2, shortcut=True),
             "C3-n0": lambda: C3(8, 10, n=0), "C3k2-c3k": lambda: C3k2(8, 8, n=1, c3k=True)}[kind]()
    stock = stock.to(DEVICE).to(memory_format=torch.channels_last).train()
    fused = copy.deepcopy(stock)
    convs = [m for m in fused.modules() if conv_block.install(m)]
    blocks = concat_free.blocks(fused)
    assert blocks and len(convs) >= 2
    for block in blocks:
        concat_free.install(block)
    x = torch.randn(2, 8, 6, 5, device=DEVICE).contiguous(memory_format=torch.channels_last)
    outs = []
    for model in (stock, fused):
        xg = x.clone().requires_grad_()
        y = model(xg)
        (y * torch.linspace(-1, 1, y.numel(), device=DEVICE).view_as(y)).sum().backward()
        outs.append((y, xg.grad))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-4, atol=1e-5)
    for (name, a), (_, b) in zip(stock.named_parameters(), fused.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    for (name, a), (_, b) in zip(stock.named_buffers(), fused.named_buffers()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    for block in blocks:
        concat_free.uninstall(block)
    for block in convs:
        conv_block.uninstall(block)
    assert not any("forward" in m.__dict__ for m in fused.modules())
