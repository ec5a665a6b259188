"""Binary cross-entropy with logits, its weighting and its reduction, fused.

``torch.nn.functional.binary_cross_entropy_with_logits`` element for element::

    loss = (1 - y) x - (1 + (pos_weight - 1) y) log_sigmoid(x),   times weight
    log_sigmoid(x) = min(x, 0) - log1p(exp(-|x|))                  (stable for any |x|)
    dloss/dx = ((1 - y) sigmoid(x) - pos_weight y sigmoid(-x)) weight

then ``mean``, ``sum`` or ``none``. ``weight`` and ``pos_weight`` broadcast to the input as in torch
(``pos_weight`` usually has one value per class, the last dimension).

For ``mean`` and ``sum`` the forward is one pass: it reads the logits and targets once, writes the
reduced loss (deterministically: the last program to finish adds the partials in a fixed order)
and, when the logits need a grad, writes ``dloss/dx`` right away. The backward is then one launch
that multiplies by the upstream grad on the device and does no memory traffic at all when that
grad is 1 (``loss.backward()``): 3 bytes moved per input byte in total, against torch's 5+.
A second backward through the same graph (``retain_graph=True``) recomputes the grad from the
saved inputs. For ``none`` the forward writes the per-element loss and the backward recomputes
the grad from the inputs and the upstream grad in one pass.

Math runs in float32 (float64 for float64 inputs); the loss comes back in the target's dtype and
the grad in the logits' dtype, as torch returns them. Torch rounds every intermediate op to bf16
/fp16 for 16-bit inputs; we round once, so 16-bit results are closer to the float64 truth.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trainfuse._runtime.backend import use_triton
from trainfuse._runtime.function import applier
from trainfuse._runtime.launch import sm_count
from trainfuse._runtime.reduce import reduce_partials
from trainfuse.losses._common import (
    REDUCTIONS,
    bcast_index,
    broadcast_operand,
    check_float,
    fast_div,
    launcher,
    stream_config,
    workspace,
)

# log1p(e) = e * q(e) on [0, 1]: q is a degree-9 least-squares fit in Chebyshev nodes (float32
# Horner: 1.6e-7 relative error at most over [0, 1], about the error of libdevice's logf plus a
# compensation; 10 FMAs, no MUFU op and no division, where the log and the division it replaced
# cost ~25 instructions an element and made the 16-bit stream compute-bound)
_Q = [tl.constexpr(c) for c in (
    1.0, -0.4999990463256836, 0.33330005407333374, -0.24954566359519958, 0.1967814415693283,
    -0.15311922132968903, 0.10614343732595444, -0.05706481263041496, 0.019907411187887192,
    -0.00325641967356205)]
_Q0, _Q1, _Q2, _Q3, _Q4, _Q5, _Q6, _Q7, _Q8, _Q9 = _Q


@triton.jit
def log1p_unit(e):
    """log(1 + e) for e in [0, 1] (``exp(-|x|)``) to full float32 relative precision, tiny e
    included: a polynomial (float64: the libdevice log, for the float64 path)."""
    if e.dtype == tl.float64:
        u = 1.0 + e
        return tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
    q = e * _Q9 + _Q8
    q = q * e + _Q7
    q = q * e + _Q6
    q = q * e + _Q5
    q = q * e + _Q4
    q = q * e + _Q3
    q = q * e + _Q2
    q = q * e + _Q1
    q = q * e + _Q0
    return e * q


@triton.jit
def _load(ptr, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr, mask=mask, other=0.0)
    return tl.load(ptr)


@triton.jit
def _store(ptr, x, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty))


@triton.jit
def _bce_tile(x_ptr, y_ptr, w_ptr, pw_ptr, go_ptr, out_ptr, g_ptr, offs, n, inv,
              w_div, w_mod, pw_div, pw_mod, go_div, go_mod,
              HAS_W: tl.constexpr, W_BCAST: tl.constexpr, HAS_PW: tl.constexpr,
              PW_BCAST: tl.constexpr, HAS_GO: tl.constexpr, GO_BCAST: tl.constexpr,
              OUT: tl.constexpr, GRAD: tl.constexpr, CD: tl.constexpr, MASKED: tl.constexpr):
    mask = offs < n
    x = _load(x_ptr + offs, mask, MASKED).to(CD)
    y = _load(y_ptr + offs, mask, MASKED).to(CD)
    e = tl.exp(-tl.abs(x))
    log_sig = tl.minimum(x, 0.0) - log1p_unit(e)
    if HAS_PW:
        pw = _load(pw_ptr + bcast_index(offs, pw_div, pw_mod, PW_BCAST), mask, MASKED).to(CD)
        loss = (1.0 - y) * x - ((pw - 1.0) * y + 1.0) * log_sig
    else:
        loss = (1.0 - y) * x - log_sig
    if HAS_W:
        w = _load(w_ptr + bcast_index(offs, w_div, w_mod, W_BCAST), mask, MASKED).to(CD)
        loss = loss * w
    if OUT:
        _store(out_ptr + offs, loss, mask, MASKED)
    if GRAD:
        # torch's ((pw y + 1 - y) s - pw y) rearranged as (1 - y) s - pw y (1 - s): the same
        # value without the cancellation at large |x| (s and 1 - s both from the same exp)
        r = fast_div(tl.full(e.shape, 1.0, e.dtype), 1.0 + e)
        s = tl.where(x >= 0, r, e * r)
        sc = tl.where(x >= 0, e * r, r)
        t = pw * y if HAS_PW else y
        g = (1.0 - y) * s - t * sc
        if HAS_GO:
            g = g * _load(go_ptr + bcast_index(offs, go_div, go_mod, GO_BCAST), mask, MASKED).to(CD)
        if HAS_W:
            g = g * w
        _store(g_ptr + offs, g * inv, mask, MASKED)
    if MASKED:
        loss = tl.where(mask, loss, 0.0)
    return loss


@triton.jit
def _bce_kernel(x_ptr, y_ptr, w_ptr, pw_ptr, go_ptr, out_ptr, g_ptr, partials, counter, total,
                n, w_div, w_mod, pw_div, pw_mod, go_div, go_mod, denom,
                HAS_W: tl.constexpr, W_BCAST: tl.constexpr, HAS_PW: tl.constexpr,
                PW_BCAST: tl.constexpr, HAS_GO: tl.constexpr, GO_BCAST: tl.constexpr,
                OUT: tl.constexpr, REDUCE: tl.constexpr, GRAD: tl.constexpr, CD: tl.constexpr,
                WIDE: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr):
    """A persistent grid over tiles of ``BLOCK * NB`` elements. Writes, as the flags ask, the
    per-element loss (``OUT``), the loss sum over ``denom`` (``REDUCE``) and the grad of that
    (``GRAD``, times the upstream grad when ``HAS_GO``)."""
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)  # the tile index, and every offset after it, is 64-bit
    nprog = tl.num_programs(0)
    TILE: tl.constexpr = BLOCK * NB
    ntiles = tl.cdiv(n, TILE)
    inv = 1.0 / tl.cast(denom, CD)
    acc = tl.zeros([BLOCK], CD)
    for t in range(pid, ntiles, nprog):
        base = t * TILE
        full = base + TILE <= n
        for b in tl.static_range(NB):
            offs = base + b * BLOCK + tl.arange(0, BLOCK)
            if full:
                acc += _bce_tile(x_ptr, y_ptr, w_ptr, pw_ptr, go_ptr, out_ptr, g_ptr, offs, n, inv,
                                 w_div, w_mod, pw_div, pw_mod, go_div, go_mod, HAS_W, W_BCAST,
                                 HAS_PW, PW_BCAST, HAS_GO, GO_BCAST, OUT, GRAD, CD, False)
            else:
                acc += _bce_tile(x_ptr, y_ptr, w_ptr, pw_ptr, go_ptr, out_ptr, g_ptr, offs, n, inv,
                                 w_div, w_mod, pw_div, pw_mod, go_div, go_mod, HAS_W, W_BCAST,
                                 HAS_PW, PW_BCAST, HAS_GO, GO_BCAST, OUT, GRAD, CD, True)
    if REDUCE:
        reduce_partials(partials, counter, total, tl.sum(acc, 0), nprog, denom)


@triton.jit
def _scale_kernel(g_ptr, go_ptr, n, CD: tl.constexpr, BLOCK: tl.constexpr):
    """g *= go (in ``CD``), in place, over a persistent grid; when go is exactly 1
    (``loss.backward()``) the programs return at once: one small launch, no memory traffic."""
    go = tl.load(go_ptr).to(CD)
    if go != 1.0:
        for t in range(tl.program_id(0).to(tl.int64), tl.cdiv(n, BLOCK), tl.num_programs(0)):
            offs = t * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            g = tl.load(g_ptr + offs, mask=mask).to(CD)
            tl.store(g_ptr + offs, (g * go).to(g_ptr.dtype.element_ty), mask=mask)


# ---- host side --------------------------------------------------------------------------------
WIDE_FROM = 2**31 - 2**24  # element offsets go 64-bit here (a tile past the end must not overflow)


def _max_programs(device: torch.device, per_sm: int) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, so the persistent loop runs more than once
    return sm_count(device.index) * per_sm


def _run(x, y, weight, pos_weight, *, go=None, out=None, grad=None, total=None, denom=1):
    n = x.numel()
    shape = x.shape
    wf, wd, wm, wb = broadcast_operand(weight, shape) if weight is not None else (x, 1, 1, False)
    pf, pd, pm, pb = broadcast_operand(pos_weight, shape) if pos_weight is not None else (x, 1, 1, False)
    gf, gd, gm, gb = broadcast_operand(go, shape) if go is not None else (x, 1, 1, False)
    cfg = stream_config(x)
    tiles = -(-n // (cfg.block * cfg.unroll))
    grid = max(1, min(tiles, _max_programs(x.device, cfg.per_sm)))
    f64 = x.dtype == torch.float64 or y.dtype == torch.float64
    partials, count = workspace(x.device, grid, torch.float64 if f64 else torch.float32)
    launcher(_bce_kernel, (grid,), x, y, wf, pf, gf, x if out is None else out,
             x if grad is None else grad, partials, count, x if total is None else total,
             n, wd, wm, pd, pm, gd, gm, denom,
             HAS_W=weight is not None, W_BCAST=wb, HAS_PW=pos_weight is not None, PW_BCAST=pb,
             HAS_GO=go is not None, GO_BCAST=gb, OUT=out is not None, REDUCE=total is not None,
             GRAD=grad is not None, CD=tl.float64 if f64 else tl.float32, WIDE=n >= WIDE_FROM,
             BLOCK=cfg.block, NB=cfg.unroll, num_warps=cfg.num_warps)


class BCEWithLogitsFunction(torch.autograd.Function):
    """The kernels behind :func:`bce_with_logits` (grads for the logits only)."""

    @staticmethod
    def forward(ctx, input, target, weight, pos_weight, reduction):
        x = input.contiguous()
        y = target.contiguous()
        ctx.grad = None
        if reduction == "none":
            out = torch.empty(x.shape, dtype=target.dtype, device=x.device)
            _run(x, y, weight, pos_weight, out=out)
        else:
            out = torch.empty((), dtype=target.dtype, device=x.device)
            if ctx.needs_input_grad[0]:
                ctx.grad = torch.empty_like(x)
            _run(x, y, weight, pos_weight, total=out, grad=ctx.grad,
                 denom=x.numel() if reduction == "mean" else 1)
        ctx.save_for_backward(x, y, weight, pos_weight)
        ctx.reduction = reduction
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go):
        x, y, weight, pos_weight = ctx.saved_tensors
        grad, ctx.grad = ctx.grad, None
        if grad is not None:  # computed in the forward: only the upstream grad is left to apply
            cfg = stream_config(grad)
            block = cfg.block * cfg.unroll
            grid = max(1, min(-(-grad.numel() // block), _max_programs(grad.device, cfg.per_sm)))
            launcher(_scale_kernel, (grid,), grad, go, grad.numel(),
                     CD=tl.float64 if grad.dtype == torch.float64 else tl.float32, BLOCK=block,
                     num_warps=cfg.num_warps)
        else:
            grad = torch.empty_like(x)
            _run(x, y, weight, pos_weight, go=go, grad=grad,
                 denom=x.numel() if ctx.reduction == "mean" else 1)
        return grad, None, None, None, None


_apply_bce = applier(BCEWithLogitsFunction)


def _check(input, target, weight, pos_weight, reduction) -> None:
    fn = "bce_with_logits"
    check_float("input", fn, input)
    check_float("target", fn, target)
    if reduction not in REDUCTIONS:
        raise ValueError(f"{fn}: reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if target.shape != input.shape:
        raise ValueError(f"{fn}: target size ({tuple(target.shape)}) must be the same as input size "
                         f"({tuple(input.shape)})")
    for name, t in (("target", target), ("weight", weight), ("pos_weight", pos_weight)):
        if t is None:
            continue
        check_float(name, fn, t)
        if t.device != input.device:
            raise ValueError(f"{fn}: {name} is on {t.device}, input on {input.device}")
        if name != "target":
            try:
                ok = torch.broadcast_shapes(t.shape, input.shape) == input.shape
            except RuntimeError:
                ok = False
            if not ok:
                raise ValueError(f"{fn}: {name} of shape {tuple(t.shape)} does not broadcast to the "
                                 f"input's shape {tuple(input.shape)}")


def bce_with_logits(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                    pos_weight: torch.Tensor | None = None, reduction: str = "mean") -> torch.Tensor:
    """``torch.nn.functional.binary_cross_entropy_with_logits``, fused (see the module docstring).

    Args:
        input: logits, float32, bfloat16, float16 (or float64).
        target: same shape, a float dtype (the logits' or another).
        weight: rescaling weight, broadcastable to ``input``.
        pos_weight: weight of the positive class, broadcastable to ``input`` (usually ``(C,)``).
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.

    Returns:
        The loss in the target's dtype (scalar, or ``input``'s shape for ``"none"``).

    A target that requires grad takes torch's own function (its grad is not fused), as do CPU
    tensors unless ``TRAINFUSE_BACKEND=triton``.

    Example:
        >>> x = torch.tensor([[2.0, -1.0]])
        >>> round(bce_with_logits(x, torch.tensor([[1.0, 0.0]])).item(), 4)
        0.2201
    """
    _check(input, target, weight, pos_weight, reduction)
    extra_grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (target, weight, pos_weight))
    if not use_triton(input.device) or input.numel() == 0 or extra_grads:
        return torch.nn.functional.binary_cross_entropy_with_logits(
            input, target, weight, pos_weight=pos_weight, reduction=reduction)
    return _apply_bce(input, target, weight, pos_weight, reduction)


__all__ = ["BCEWithLogitsFunction", "bce_with_logits", "log1p_unit"]
