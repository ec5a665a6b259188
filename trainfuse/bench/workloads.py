"""What the benchmarks time: parameter shapes, models and input shapes, apart from the timing code.

- :func:`gpt2_shapes`: GPT-2 124M's 148 parameter tensors (optimizer, EMA, clipping, cast fusion).
- :func:`yolo_like_shapes`: 216 small conv tensors (10.2M params), the layout of a YOLO detector.
- :func:`yolov5n`: ultralytics' real yolov5n detection model, when ultralytics is installed.
- :class:`TinyGPT` and :func:`synthetic_task`: a 6-layer d=768 GPT-like model and a fixed
  synthetic language to train it on (a whole mixed-precision training step).
- :data:`MLP_WORKLOADS`: ``Linear + activation`` chains at three shapes, then GELU and dropout.
- :data:`CIOU_SIZES` and :data:`BCE_SHAPES`: the detection losses' box counts and logit shapes.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F


def gpt2_shapes() -> list[tuple[int, ...]]:
    """GPT-2 124M (d=768, 12 layers, vocab padded to 50304): 148 tensors, 124.5M params."""
    d, layers, vocab = 768, 12, 50304
    shapes = [(vocab, d), (1024, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,),
                   (d, 4 * d), (d,)]
    return shapes + [(d,), (d,)]


def yolo_like_shapes() -> list[tuple[int, ...]]:
    """216 conv, BatchNorm and head tensors (10.2M params): many small tensors, as in a detector."""
    shapes = []
    chans = [16, 32, 32, 64, 64, 128, 128, 256, 256, 256, 128, 128, 64, 64, 128, 128, 256]
    for i, c in enumerate(chans):
        cin = chans[i - 1] if i else 3
        for _ in range(3):
            shapes += [(c, cin, 3, 3), (c,), (c,)]
            cin = c
        shapes += [(c, c, 1, 1), (c,), (c,)]
    return shapes + [(64, 64, 3, 3), (64,), (80, 64, 1, 1), (80,)] * 3


def yolov5n() -> nn.Module | None:
    """ultralytics' yolov5n detection model on the GPU (219 param tensors, 2.7M params), or None
    where ultralytics cannot be imported."""
    try:
        os.environ.setdefault("YOLO_OFFLINE", "1")
        from ultralytics.nn.tasks import DetectionModel
    except Exception:  # noqa: BLE001 - any import problem means "not available"
        return None
    return DetectionModel("yolov5n.yaml", verbose=False).cuda()


class ParamShapes(nn.Module):
    """A module holding one random parameter per shape (a model's layout without its forward)."""

    def __init__(self, shapes: list[tuple[int, ...]]):
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(s)) for s in shapes)


class _Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """6 layers, d=768, 12 heads, vocab 4096: a small GPT-like model whose training step is
    host-bound, so that cast fusion's saved launches show in the step time."""

    def __init__(self, vocab=4096, d=768, layers=6, heads=12, ctx=256):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def synthetic_task(batch: int, ctx: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed synthetic language: each sequence follows x[t+1] = (a * x[t] + b) mod vocab with a
    per-sequence (a, b) drawn from 8 choices, so the model must read the context to predict.

    Returns:
        ``(inputs, targets)``, int64 CUDA tensors of shape ``(batch, ctx)``.
    """
    g = torch.Generator().manual_seed(seed)
    a = torch.tensor([1, 3, 5, 7, 11, 13, 17, 19])[torch.randint(0, 8, (batch,), generator=g)]
    b = torch.randint(0, vocab, (batch,), generator=g)
    x = torch.empty(batch, ctx + 1, dtype=torch.int64)
    x[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    for t in range(ctx):
        x[:, t + 1] = (a * x[:, t] + b) % vocab
    return x[:, :-1].cuda(), x[:, 1:].cuda()


class MLPWorkload(NamedTuple):
    """``layers`` x (Linear(width, width) + activation [+ dropout]) on ``batch`` rows."""

    name: str
    batch: int
    width: int
    layers: int
    activation: str
    dropout: float


# three shapes of one ReLU chain (wide batch, narrow layers, wide layers), then GELU and dropout
MLP_WORKLOADS = [MLPWorkload("relu B=8192 D=1024", 8192, 1024, 4, "relu", 0.0),
                 MLPWorkload("relu B=65536 D=256", 65536, 256, 4, "relu", 0.0),
                 MLPWorkload("relu B=2048 D=4096", 2048, 4096, 4, "relu", 0.0),
                 MLPWorkload("gelu B=8192 D=1024", 8192, 1024, 4, "gelu", 0.0),
                 MLPWorkload("relu+dropout0.1 B=8192 D=1024", 8192, 1024, 4, "relu", 0.1)]

# CIoU box counts: one image's anchors at 640 px (8,400), a batch's, a large batch's
CIOU_SIZES = (8400, 100_000, 1_000_000)

# BCE-with-logits: a YOLO batch's class logits (64 images x 8,400 anchors x 80 classes), a 2D one
BCE_SHAPES = [((64, 8400, 80), torch.float32), ((64, 8400, 80), torch.bfloat16),
              ((16384, 1024), torch.float32), ((16384, 1024), torch.bfloat16)]
