"""FusedMLP chains on the vendor GEMM: cuBLAS(Lt) for the matmuls, our kernels for what no library
call fuses.

With ``trainfuse.nn.mlp.config.library = True``, chains of ReLU (or no activation) layers
without dropout run their matmuls where they are fastest on the GPU: in cuBLAS, through torch.
What eager PyTorch runs as separate kernels around them is fused here:

* forward: ``torch._addmm_activation`` (cuBLASLt's bias + ReLU epilogue) instead of addmm + relu;
* backward, per layer: one pass of :func:`mask_bias_kernel` applies ReLU's mask to the upstream
  grad *and* sums the bias grad's columns (eager: ``threshold_backward``, then a ``sum`` reading
  the masked grad again), then cuBLAS's input grad and weight grad, the latter written (or added)
  straight into a float32 ``.grad`` with ``out_dtype`` (eager: a 16-bit product, a cast and an
  add in AccumulateGrad).

The bias grad's column sums are deterministic: per-program partials, then one reduce
(:func:`colsum_kernel`), never atomics. The numerics are autocast's: 16-bit operands, float32
accumulation, one rounding of each output; the param grads stay in float32 for float32 params
(autocast rounds them through bf16 first). See docs/design/mlp.md, "The cuBLAS path".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trainfuse._runtime import compat
from trainfuse._runtime.backend import interpreting
from trainfuse._runtime.launch import sm_count
from trainfuse.nn.mlp import launches
from trainfuse.nn.mlp.activations import ACTIVATIONS, Layer
from trainfuse.nn.mlp.grads import direct_grads, hand_over
from trainfuse.nn.mlp.kernels import to_dtype

_RELU = ACTIVATIONS["relu"]
_NONE = ACTIVATIONS["none"]
# ``config.library`` is off by default: called eagerly the path issues about ten torch ops a
# layer, and on the H100 and H200 hosts the benchmark's chains were host-bound on it (B=8192 x
# 1024, H200: 1.62 ms wall for 0.46 ms of GPU time), where the Triton chain, which replays its
# launches as one CUDA graph, took 1.13 ms. Where the host keeps ahead (a captured step, a fast
# host), the GPU time is what counts.
_BLOCK_M, _BLOCK_N = 32, 128


def eligible(layers: list[Layer], cd: torch.dtype, library: bool | None = None) -> bool:
    """Whether a chain call takes the cuBLAS path: ``library`` is True (None: ``config.library``
    is on), the compute dtype is 16-bit, and every layer is ReLU or linear, without dropout."""
    on = launches.config.library if library is None else library
    if not on or cd not in (torch.bfloat16, torch.float16):
        return False
    return all(layer.act in (_RELU, _NONE) and layer.p == 0.0 for layer in layers)


@triton.jit
def mask_bias_kernel(g_ptr, aux_ptr, out_ptr, part_ptr, rows, cols, rows_per_prog, col_blocks,
                     RELU: tl.constexpr, STORE: tl.constexpr, BIAS: tl.constexpr, RNE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One pass over a layer's upstream grad ``g`` (rows x cols, row-major): with ``RELU``, zero it
    where the layer's output ``aux`` is not positive; with ``STORE`` write the result to ``out``;
    with ``BIAS`` write this program's float32 column sums of it to row ``pid // col_blocks`` of
    ``part`` (``rows_per_prog`` rows each, a multiple of ``BLOCK_M``)."""
    pid = tl.program_id(0)
    pid_m = pid // col_blocks
    pid_n = pid % col_blocks
    cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cn < cols
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    row0 = pid_m * rows_per_prog
    for r in range(0, rows_per_prog, BLOCK_M):
        rm = row0 + r + tl.arange(0, BLOCK_M)
        mask = (rm < rows)[:, None] & cmask[None, :]
        off = rm.to(tl.int64)[:, None] * cols + cn[None, :]
        v = tl.load(g_ptr + off, mask=mask, other=0.0).to(tl.float32)
        if RELU:
            a = tl.load(aux_ptr + off, mask=mask, other=0.0).to(tl.float32)
            v = tl.where(a > 0.0, v, 0.0)
        if STORE:
            tl.store(out_ptr + off, to_dtype(v, out_ptr.dtype.element_ty, RNE), mask=mask)
        if BIAS:
            acc += tl.sum(v, axis=0)
    if BIAS:
        tl.store(part_ptr + pid_m.to(tl.int64) * cols + cn, acc, mask=cmask)


@triton.jit
def colsum_kernel(part_ptr, parts, cols, out_ptr, ACCUM: tl.constexpr, RNE: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """``out[c] (+)= sum_p part[p, c]`` in float32, in a fixed order (``part``: parts x cols)."""
    cn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cn < cols
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for p in range(0, parts):
        acc += tl.load(part_ptr + p * cols + cn, mask=cmask, other=0.0)
    if ACCUM:
        acc += tl.load(out_ptr + cn, mask=cmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + cn, to_dtype(acc, out_ptr.dtype.element_ty, RNE), mask=cmask)


def mask_and_bias_grad(g: torch.Tensor, aux: torch.Tensor | None, bias_grad: torch.Tensor | None,
                       accumulate: bool) -> torch.Tensor:
    """``g`` with ReLU's mask (where ``aux``, the layer's output, is not positive: zero) as a new
    tensor, or ``g`` itself without ``aux``; and the column sums of that into ``bias_grad`` (set,
    or added to with ``accumulate``), in one pass over ``g``. Both row-major 2-d."""
    rows, cols = g.shape
    relu = aux is not None
    out = torch.empty_like(g) if relu else g
    if bias_grad is None and not relu:
        return g
    col_blocks = -(-cols // _BLOCK_N)
    if g.device.type == "cuda":  # about four programs per SM
        want = max(1, -(-4 * sm_count(g.device.index) // col_blocks))
    else:
        want = 4
    per = -(-max(rows, 1) // want)
    per = -(-per // _BLOCK_M) * _BLOCK_M
    parts = max(1, -(-rows // per))
    part = torch.empty((parts, cols), dtype=torch.float32, device=g.device) if bias_grad is not None else g
    rne = interpreting()
    if rows:
        launches.launcher(mask_bias_kernel, (parts * col_blocks,), g, aux if relu else g, out, part, rows,
                          cols, per, col_blocks, RELU=relu, STORE=relu, BIAS=bias_grad is not None, RNE=rne,
                          BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, num_warps=4)
    if bias_grad is not None:
        if not rows:
            part.zero_()
        launches.launcher(colsum_kernel, (col_blocks,), part, parts, cols, bias_grad, ACCUM=accumulate,
                          RNE=rne, BLOCK_N=_BLOCK_N, num_warps=4)
    return out


def mask_and_bias_grad_reference(g: torch.Tensor, aux: torch.Tensor | None,
                                 prior: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`mask_and_bias_grad` computes, in plain torch: ``g`` masked where ``aux`` is not
    positive (in ``g``'s dtype: a mask rounds nothing), and its column sums in float64, plus
    ``prior`` (the bias grad accumulated onto) when given."""
    masked = g if aux is None else torch.where(aux > 0, g, 0)
    sums = masked.double().sum(0)
    return masked, sums if prior is None else sums + prior.double()


def _linear(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, act: int) -> torch.Tensor:
    if b is None:
        out = torch.mm(h, w.t())
        return out.relu_() if act == _RELU else out
    if act == _RELU:
        return compat.addmm_activation(b, h, w.t())
    return torch.addmm(b, h, w.t())


def weight_grad(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype,
                into: torch.Tensor | None) -> torch.Tensor:
    """``a @ b`` (16-bit operands, float32 accumulation) as ``dtype``, added to ``into`` in place
    when given: cuBLAS writes a float32 result or sum itself (``out_dtype``); elsewhere (the CPU)
    the product is taken in float32 and added."""
    if dtype == a.dtype:
        return torch.mm(a, b) if into is None else torch.addmm(into, a, b, out=into)
    if a.device.type == "cuda":
        if into is None:
            return torch.mm(a, b, out_dtype=dtype)
        return torch.addmm(into, a, b, out_dtype=dtype, out=into)
    prod = torch.mm(a.float(), b.float())
    return prod.to(dtype) if into is None else into.add_(prod)


class LibraryMLPFunction(torch.autograd.Function):
    """``apply(x, layers, cd, fuse_grads, *weights, *biases)``: a chain as one autograd node,
    matmuls in cuBLAS (see the module docstring); ``biases`` entries may be None, ``fuse_grads``
    as :class:`~trainfuse.nn.mlp.function.FusedMLPFunction`'s."""

    @staticmethod
    def forward(ctx, x, layers, cd, fuse_grads, *params):
        n = len(layers)
        weights, biases = params[:n], params[n:]
        ctx.x_dtype = x.dtype
        h = x if x.dtype == cd else x.to(cd)
        w16 = [w if w.dtype == cd else w.to(cd) for w in weights]
        inputs = []
        for layer, w, b in zip(layers, w16, biases):
            inputs.append(h)
            h = _linear(h, w, None if b is None else b if b.dtype == cd else b.to(cd), layer.act)
        ctx.layers, ctx.cd, ctx.fuse_grads = layers, cd, fuse_grads
        ctx.has_bias = [b is not None for b in biases]
        ctx.bias_dtypes = [None if b is None else b.dtype for b in biases]
        ctx.weight_dtypes = [w.dtype for w in weights]
        ctx.save_for_backward(*inputs, h, *w16)
        return h

    @staticmethod
    def backward(ctx, grad):
        ctx.create_graph = torch.is_grad_enabled()  # as FusedMLPFunction: seen before no_grad
        return LibraryMLPFunction._backward(ctx, grad)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def _backward(ctx, grad):
        layers, n, cd = ctx.layers, len(ctx.layers), ctx.cd
        saved = ctx.saved_tensors
        inputs, out, w16 = saved[:n], saved[n], saved[n + 1:]
        need = ctx.needs_input_grad
        need_w = need[4:4 + n]
        need_b = [need[4 + n + i] and ctx.has_bias[i] for i in range(n)]
        direct = (direct_grads(ctx, n, need_w, need_b) if ctx.fuse_grads else None) or [None] * n
        g = grad.to(cd).contiguous()
        gw, gb = [None] * n, [None] * n
        dx = None
        for i in reversed(range(n)):
            d = direct[i]
            accum = bool(d and d[2])
            if need_b[i]:
                gb[i] = d[1].grad if accum else torch.empty(w16[i].shape[0], dtype=ctx.bias_dtypes[i],
                                                             device=g.device)
            aux = (inputs[i + 1] if i + 1 < n else out) if layers[i].act == _RELU else None
            dpre = mask_and_bias_grad(g, aux, gb[i], accum)
            if need_w[i]:
                gw[i] = weight_grad(dpre.t(), inputs[i], ctx.weight_dtypes[i], d[0].grad if accum else None)
            if i > 0:
                g = torch.mm(dpre, w16[i])
            elif need[0]:
                dx = torch.mm(dpre, w16[0])
                dx = dx if dx.dtype == ctx.x_dtype else dx.to(ctx.x_dtype)
        hand_over(direct, gw, gb)
        return (dx, None, None, None, *gw, *gb)


__all__ = ["LibraryMLPFunction", "colsum_kernel", "eligible", "mask_and_bias_grad",
           "mask_and_bias_grad_reference",
           "mask_bias_kernel", "weight_grad"]
