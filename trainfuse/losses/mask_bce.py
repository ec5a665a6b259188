"""The instance-mask term of YOLO segmentation losses: each mask slot's cropped BCE sum in one
launch forward and two backward, without the ``(B, C, h, w)`` tensors torch makes on the way.

For slot ``c`` of image ``b`` (an anchor whose predicted mask a label supervises) and mask pixel
``p`` (row ``p // w``, column ``p % w``)::

    x[b, c, p] = sum_n coef[b, n, c] proto[b, n, p]                    the predicted mask's logits
    y[b, c, p] = masks[b, p] == index[b, c]                            overlap: one index map per image
               | masks[b, index[b, c], p]                              else: a mask per label slot
    in[b, c, p] = x1 <= col < x2 and y1 <= row < y2                    boxes[b, c], in mask pixels
    out[b, c] = sum_p in bce(x, y)                                     d out / d x = in (sigmoid(x) - y)

The forward is a program per (image, block of slots) walking the pixels: ``x`` from ``tl.dot`` in
IEEE float32 (no TF32), the BCE, its crop and the slot's sum. The backward recomputes ``x``: the
coefficients' grad in a program per (image, slot block) walking the pixels, the prototypes' in a
program per (image, pixel block) walking the slots. No program adds into another's output, so the
same inputs give the same bits in every run, eager or replayed from a CUDA graph.

Bytes: the forward reads the prototypes once per slot block (``C / 16`` times, from L2 in
practice) and the masks as often, and writes ``B C`` floats; ultralytics' loss and the torch
reference (:func:`mask_bce_torch`) write and read several ``B C h w`` float tensors (the logits,
the targets, the BCE, the crop), 131 MB each for batch 16 at 640 pixels with 80 slots an image.
Math in float32; float64 inputs and devices without Triton take the torch reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from trainfuse._runtime.backend import use_triton
from trainfuse._runtime.function import applier
from trainfuse._runtime.launch import cdiv, next_power_of_2
from trainfuse.losses._common import launcher
from trainfuse.losses.bce import log1p_unit

BLOCK_SLOTS = 16  # slots a program takes at once (tl.dot needs 16 at least)
BLOCK_PIXELS = 128


@triton.jit
def _slots(index_ptr, boxes_ptr, b, c, cm, C):
    """The slots' target index (float32: compared with an index map's values) and crop box."""
    at = b * C + c
    index = tl.load(index_ptr + at, mask=cm, other=-1)
    x1 = tl.load(boxes_ptr + at * 4, mask=cm, other=0.0)
    y1 = tl.load(boxes_ptr + at * 4 + 1, mask=cm, other=0.0)
    x2 = tl.load(boxes_ptr + at * 4 + 2, mask=cm, other=0.0)
    y2 = tl.load(boxes_ptr + at * 4 + 3, mask=cm, other=0.0)
    return index, x1, y1, x2, y2


@triton.jit
def _tile(coef_ptr, proto_ptr, masks_ptr, b, c, cm, index, x1, y1, x2, y2, p, pm, NM, C, P, W, M,
          OVERLAP: tl.constexpr, NMP: tl.constexpr):
    """Slots ``c`` by pixels ``p``: the coefficients ``(BC, NMP)``, the prototypes ``(NMP, BP)``,
    the logits, the targets and the crop."""
    n = tl.arange(0, NMP)
    nm = n < NM
    a = tl.load(coef_ptr + b * NM * C + n[None, :] * C + c[:, None], mask=cm[:, None] & nm[None, :],
                other=0.0)
    pr = tl.load(proto_ptr + b * NM * P + n[:, None] * P + p[None, :], mask=nm[:, None] & pm[None, :],
                 other=0.0)
    x = tl.dot(a, pr, input_precision="ieee")
    if OVERLAP:
        m = tl.load(masks_ptr + b * P + p, mask=pm, other=0).to(tl.float32)
        y = tl.where(m[None, :] == index.to(tl.float32)[:, None], 1.0, 0.0)
    else:
        rows = tl.minimum(tl.maximum(index, 0), M - 1).to(tl.int64)
        y = tl.load(masks_ptr + (b * M + rows[:, None]) * P + p[None, :], mask=cm[:, None] & pm[None, :],
                    other=0).to(tl.float32)
    col = (p % W).to(tl.float32)[None, :]
    row = (p // W).to(tl.float32)[None, :]
    inside = ((col >= x1[:, None]) & (col < x2[:, None]) & (row >= y1[:, None]) & (row < y2[:, None])
              & cm[:, None] & pm[None, :])
    return a, pr, x, y, inside


@triton.jit
def mask_bce_fwd_kernel(coef_ptr, proto_ptr, masks_ptr, index_ptr, boxes_ptr, out_ptr, NM, C, P, W, M, ncb,
                        OVERLAP: tl.constexpr, NMP: tl.constexpr, BC: tl.constexpr, BP: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // ncb).to(tl.int64)
    c = (pid % ncb) * BC + tl.arange(0, BC)
    cm = c < C
    index, x1, y1, x2, y2 = _slots(index_ptr, boxes_ptr, b, c, cm, C)
    acc = tl.zeros([BC], tl.float32)
    for p0 in range(0, P, BP):
        p = p0 + tl.arange(0, BP)
        _, _, x, y, inside = _tile(coef_ptr, proto_ptr, masks_ptr, b, c, cm, index, x1, y1, x2, y2, p, p < P,
                                   NM, C, P, W, M, OVERLAP, NMP)
        loss = (1.0 - y) * x - (tl.minimum(x, 0.0) - log1p_unit(tl.exp(-tl.abs(x))))
        acc += tl.sum(tl.where(inside, loss, 0.0), axis=1)
    tl.store(out_ptr + b * C + c, acc, mask=cm)


@triton.jit
def _dlogits(x, y, inside, go):
    """``go (sigmoid(x) - y)`` inside the crop, 0 outside."""
    e = tl.exp(-tl.abs(x))
    r = 1.0 / (1.0 + e)
    s = tl.where(x >= 0, r, e * r)
    return tl.where(inside, (s - y) * go[:, None], 0.0)


@triton.jit
def mask_bce_coef_kernel(coef_ptr, proto_ptr, masks_ptr, index_ptr, boxes_ptr, go_ptr, gcoef_ptr, NM, C, P,
                         W, M, ncb, OVERLAP: tl.constexpr, NMP: tl.constexpr, BC: tl.constexpr,
                         BP: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // ncb).to(tl.int64)
    c = (pid % ncb) * BC + tl.arange(0, BC)
    cm = c < C
    index, x1, y1, x2, y2 = _slots(index_ptr, boxes_ptr, b, c, cm, C)
    go = tl.load(go_ptr + b * C + c, mask=cm, other=0.0)
    acc = tl.zeros([BC, NMP], tl.float32)
    for p0 in range(0, P, BP):
        p = p0 + tl.arange(0, BP)
        _, pr, x, y, inside = _tile(coef_ptr, proto_ptr, masks_ptr, b, c, cm, index, x1, y1, x2, y2, p, p < P,
                                    NM, C, P, W, M, OVERLAP, NMP)
        acc += tl.dot(_dlogits(x, y, inside, go), tl.trans(pr), input_precision="ieee")
    n = tl.arange(0, NMP)
    tl.store(gcoef_ptr + b * NM * C + n[None, :] * C + c[:, None], acc, mask=cm[:, None] & (n < NM)[None, :])


@triton.jit
def mask_bce_proto_kernel(coef_ptr, proto_ptr, masks_ptr, index_ptr, boxes_ptr, go_ptr, gproto_ptr, NM, C, P,
                          W, M, npb, OVERLAP: tl.constexpr, NMP: tl.constexpr, BC: tl.constexpr,
                          BP: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // npb).to(tl.int64)
    p = (pid % npb) * BP + tl.arange(0, BP)
    pm = p < P
    acc = tl.zeros([NMP, BP], tl.float32)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        cm = c < C
        index, x1, y1, x2, y2 = _slots(index_ptr, boxes_ptr, b, c, cm, C)
        go = tl.load(go_ptr + b * C + c, mask=cm, other=0.0)
        a, _, x, y, inside = _tile(coef_ptr, proto_ptr, masks_ptr, b, c, cm, index, x1, y1, x2, y2, p, pm,
                                   NM, C, P, W, M, OVERLAP, NMP)
        acc += tl.dot(tl.trans(a), _dlogits(x, y, inside, go), input_precision="ieee")
    n = tl.arange(0, NMP)
    tl.store(gproto_ptr + b * NM * P + n[:, None] * P + p[None, :], acc, mask=(n < NM)[:, None] & pm[None, :])


# ---- host side --------------------------------------------------------------------------------
def _sizes(coef: torch.Tensor, proto: torch.Tensor, masks: torch.Tensor, overlap: bool):
    B, NM, C = coef.shape
    H, W = proto.shape[-2:]
    M = 1 if overlap else masks.shape[1]
    return B, NM, C, H * W, W, M, max(16, next_power_of_2(NM))


def _launch(kernel, grid: int, coef, proto, masks, index, boxes, *rest, overlap: bool, per: int) -> None:
    B, NM, C, P, W, M, NMP = _sizes(coef, proto, masks, overlap)
    launcher(kernel, (grid,), coef, proto, masks, index, boxes, *rest, NM, C, P, W, M, per, num_warps=4,
             OVERLAP=overlap, NMP=NMP, BC=BLOCK_SLOTS, BP=BLOCK_PIXELS)


class _MaskBCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, coef, proto, masks, index, boxes, overlap):
        B, C = coef.shape[0], coef.shape[2]
        out = coef.new_zeros(B, C)
        ncb = cdiv(C, BLOCK_SLOTS)
        if out.numel() and proto.shape[-1] * proto.shape[-2]:
            _launch(mask_bce_fwd_kernel, B * ncb, coef, proto, masks, index, boxes, out, overlap=overlap,
                    per=ncb)
        ctx.save_for_backward(coef, proto, masks, index, boxes)
        ctx.overlap = overlap
        return out

    @staticmethod
    def backward(ctx, go):
        coef, proto, masks, index, boxes = ctx.saved_tensors
        go = go.contiguous().to(torch.float32)
        gcoef = torch.zeros_like(coef) if ctx.needs_input_grad[0] else None
        gproto = torch.zeros_like(proto) if ctx.needs_input_grad[1] else None
        B, C = coef.shape[0], coef.shape[2]
        P = proto.shape[-1] * proto.shape[-2]
        if B * C * P:
            if gcoef is not None:
                ncb = cdiv(C, BLOCK_SLOTS)
                _launch(mask_bce_coef_kernel, B * ncb, coef, proto, masks, index, boxes, go, gcoef,
                        overlap=ctx.overlap, per=ncb)
            if gproto is not None:
                npb = cdiv(P, BLOCK_PIXELS)
                _launch(mask_bce_proto_kernel, B * npb, coef, proto, masks, index, boxes, go, gproto,
                        overlap=ctx.overlap, per=npb)
        return gcoef, gproto, None, None, None, None


_apply = applier(_MaskBCE)


def mask_bce_torch(coef: torch.Tensor, proto: torch.Tensor, masks: torch.Tensor, index: torch.Tensor,
                   boxes: torch.Tensor, *, overlap: bool) -> torch.Tensor:
    """:func:`cropped_mask_bce` in torch operations (the logits from ``einsum``, as ultralytics
    makes them): the reference of the tests, and the path of CPUs and float64."""
    B, _, C = coef.shape
    H, W = proto.shape[-2:]
    pred = torch.einsum("bnc,bnhw->bchw", coef, proto)
    if overlap:
        gt = (masks[:, None] == index.view(B, C, 1, 1).to(masks.dtype)).to(pred.dtype)
    else:
        rows = index.long().clamp(0, max(masks.shape[1] - 1, 0)).view(B, C, 1, 1).expand(B, C, H, W)
        gt = masks.to(pred.dtype).gather(1, rows)
    bce = F.binary_cross_entropy_with_logits(pred, gt, reduction="none")
    x1, y1, x2, y2 = boxes.to(pred.dtype).unbind(-1)  # (B, C) each
    cols = torch.arange(W, device=pred.device, dtype=pred.dtype)
    lines = torch.arange(H, device=pred.device, dtype=pred.dtype)
    inside_x = (cols >= x1[..., None]) & (cols < x2[..., None])  # (B, C, W)
    inside_y = (lines >= y1[..., None]) & (lines < y2[..., None])  # (B, C, H)
    return (bce * inside_x[:, :, None, :] * inside_y[:, :, :, None]).sum((2, 3))


def _check(coef, proto, masks, index, boxes, overlap) -> None:
    fn = "cropped_mask_bce"
    if coef.dim() != 3 or proto.dim() != 4 or proto.shape[:2] != coef.shape[:2]:
        raise ValueError(f"{fn}: coef must be (B, nm, C) and proto (B, nm, h, w) of the same B and nm; got "
                         f"{tuple(coef.shape)} and {tuple(proto.shape)}")
    B, _, C = coef.shape
    H, W = proto.shape[-2:]
    want = (B, H, W) if overlap else (B, masks.shape[1] if masks.dim() == 4 else -1, H, W)
    if tuple(masks.shape) != want:
        kind = "(B, h, w) index maps (overlap=True)" if overlap else "(B, M, h, w) masks (overlap=False)"
        raise ValueError(f"{fn}: masks must be {kind} of proto's size {(H, W)}; got {tuple(masks.shape)}")
    if tuple(index.shape) != (B, C) or index.dtype.is_floating_point:
        raise ValueError(f"{fn}: index must be an integer (B, C) = {(B, C)} tensor; got {tuple(index.shape)} "
                         f"{index.dtype}")
    if tuple(boxes.shape) != (B, C, 4):
        raise ValueError(f"{fn}: boxes must be (B, C, 4) = {(B, C, 4)} (x1, y1, x2, y2 in mask pixels); got "
                         f"{tuple(boxes.shape)}")
    if not coef.dtype.is_floating_point or proto.dtype != coef.dtype:
        raise ValueError(f"{fn}: coef and proto must be floating point of one dtype; got {coef.dtype} and "
                         f"{proto.dtype}")
    if not overlap and masks.shape[1] == 0 and C:
        raise ValueError(f"{fn}: with overlap=False, masks must hold at least one mask an image for the "
                         "slots")


def cropped_mask_bce(coef: torch.Tensor, proto: torch.Tensor, masks: torch.Tensor, index: torch.Tensor,
                     boxes: torch.Tensor, *, overlap: bool) -> torch.Tensor:
    """Each mask slot's BCE-with-logits sum inside its crop box (the module docstring), ``(B, C)``
    in ``coef``'s dtype, differentiable in ``coef`` and ``proto``.

    Args:
        coef: the slots' mask coefficients ``(B, nm, C)``.
        proto: the prototype masks ``(B, nm, h, w)``, ``coef``'s dtype.
        masks: ``overlap``: the images' index maps ``(B, h, w)`` (a pixel holds its label's
            number, 0 for none); else the labels' masks in slots ``(B, M, h, w)``.
        index: ``(B, C)`` integers: the number whose pixels are the slot's mask (``overlap``), or
            the slot's row of ``masks``.
        boxes: ``(B, C, 4)`` crop boxes ``x1, y1, x2, y2`` in mask pixels (half-open).
        overlap: which kind ``masks`` is.
    """
    _check(coef, proto, masks, index, boxes, overlap)
    if coef.dtype != torch.float32 or not use_triton(coef.device):
        return mask_bce_torch(coef, proto, masks, index, boxes, overlap=overlap)
    B, _, C = coef.shape
    P = proto.shape[-2] * proto.shape[-1]
    flat = masks.reshape(B, P) if overlap else masks.reshape(B, masks.shape[1], P)
    return _apply(coef.contiguous(), proto.contiguous(), flat.contiguous(),
                  index.to(torch.int32).contiguous(), boxes.to(torch.float32).contiguous(), overlap)


__all__ = ["cropped_mask_bce", "mask_bce_coef_kernel", "mask_bce_fwd_kernel", "mask_bce_proto_kernel",
           "mask_bce_torch"]
