"""The concatenation writer's training forward and backward in one launch each
(``TRAINFUSE_BN_PERSIST=1``; :mod:`trainfuse.nn.bn_persist` for the plain op and the flag each
channel block's programs wait on): :func:`forward`, the statistics and the writes (the slice, the
dense channels, the shortcut); :func:`backward`, the sums and the grads (``dx`` and the
shortcut's). The same per-tile code as :mod:`trainfuse.nn.bn_silu_into`'s kernels
(:mod:`trainfuse.nn.bn_into_tiles`), so the same bits."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trainfuse._runtime.launch import cdiv
from trainfuse.nn import bn_into_tiles, bn_persist, bn_stats
from trainfuse.nn import channel_tiles as tiles


@triton.jit(do_not_specialize=["CB", "NSB", "Q", "tiles_per_program", "P", "M", "DF"])
def into_stats_apply_kernel(x_ptr, r_ptr, y_ptr, d_ptr, mean_ptr, m2_ptr, count_ptr, cnt_ptr, flag_ptr, w_ptr,
                            b_ptr, rmean_ptr, rvar_ptr, scale_ptr, shift_ptr, save_mean_ptr, save_invstd_ptr,
                            tracked_ptr, C, CB, S, NSB, Q, sN, sC, sS, rN, rC, rS, yN, yC, yS, dN, dC, dS, DF,
                            tiles_per_program, P, M, momentum, eps, HAS_W: tl.constexpr, UPDATE: tl.constexpr,
                            TRACK: tl.constexpr, BP: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                            UNROLL: tl.constexpr, EVEN_S: tl.constexpr, MASKED: tl.constexpr,
                            REL32: tl.constexpr, RESIDUAL: tl.constexpr, DENSE: tl.constexpr,
                            STATS: tl.constexpr, APPLY: tl.constexpr, BARRIER: tl.constexpr):
    """The statistics and :func:`~trainfuse.nn.bn_silu_into.into_apply_kernel`'s writes in one launch
    (``TRAINFUSE_BN_PERSIST=1``, :mod:`trainfuse.nn.bn_persist`): program ``(i, j)`` (``i * CB +
    j``) folds its tiles into the statistics' partials (``STATS``), waits for its block's constants
    (``BARRIER``) and writes its tiles (``APPLY``)."""
    i, j, c = tiles.program(CB, BC)
    cm = c < C
    if STATS:
        last = bn_stats.stats_program(x_ptr, mean_ptr, m2_ptr, count_ptr, cnt_ptr, w_ptr, b_ptr, rmean_ptr,
                                      rvar_ptr, scale_ptr, shift_ptr, save_mean_ptr, save_invstd_ptr,
                                      tracked_ptr, i, j, c, C, S, NSB, Q, sN, sC, sS, tiles_per_program, P,
                                      M, momentum, eps, HAS_W, UPDATE, TRACK, BP, BR, BC, UNROLL, EVEN_S,
                                      MASKED, REL32)
        if BARRIER:
            bn_persist.wait_for_block(flag_ptr, j, last)
    if APPLY:
        # read past the SM's cache: the block's last program wrote them in this launch
        s = tl.load(scale_ptr + c, mask=cm, other=0.0, cache_modifier=".cg")
        t = tl.load(shift_ptr + c, mask=cm, other=0.0, cache_modifier=".cg")
        q0 = i * tiles_per_program
        for k in range(tl.minimum(tiles_per_program, Q - q0)):
            bn_into_tiles.apply_tile(x_ptr, r_ptr, y_ptr, d_ptr, s, t, q0 + k, c, cm, S, NSB, sN, sC, sS, rN,
                                     rC, rS, yN, yC, yS, dN, dC, dS, DF, BR, EVEN_S, MASKED, RESIDUAL, DENSE,
                                     REL32)
        if BARRIER:
            bn_persist.leave_block(flag_ptr, j, CB, P)




@triton.jit(do_not_specialize=["CB", "NSB", "Q", "tiles_per_program", "P", "M", "DF"])
def into_grad_dx_kernel(x_ptr, g_ptr, e_ptr, dx_ptr, dr_ptr, scale_ptr, shift_ptr, mean_ptr, invstd_ptr,
                        sdu_ptr, sdux_ptr, cnt_ptr, flag_ptr, dw_ptr, db_ptr, gw_ptr, gb_ptr, C, CB, S, NSB,
                        Q, sN, sC, sS, gN, gC, gS, eN, eC, eS, DF, dN, dC, dS, fN, fC, fS, tiles_per_program,
                        P, M, BP: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, UNROLL: tl.constexpr,
                        EVEN_S: tl.constexpr, MASKED: tl.constexpr, ADD: tl.constexpr, REL32: tl.constexpr,
                        GRAD: tl.constexpr, DX: tl.constexpr, DR: tl.constexpr, SUMS: tl.constexpr,
                        GRADS: tl.constexpr, BARRIER: tl.constexpr):
    """The sums (``SUMS``: the grad-sums kernel's work) and the grads (``GRADS``: ``dx`` with
    ``DX``, the shortcut's with ``DR``, over the same tiles) of program ``(i, j)`` (``i * CB +
    j``); ``BARRIER``: between the two, the block's flag."""
    i, j, c = tiles.program(CB, BC)
    cm = c < C
    if SUMS:
        last = bn_into_tiles.sums_program(x_ptr, g_ptr, e_ptr, scale_ptr, shift_ptr, mean_ptr, invstd_ptr,
                                          sdu_ptr, sdux_ptr, cnt_ptr, dw_ptr, db_ptr, gw_ptr, gb_ptr, i, j, c,
                                          C, S, NSB, Q, sN, sC, sS, gN, gC, gS, eN, eC, eS, DF,
                                          tiles_per_program, P, BP, BR, BC, UNROLL, EVEN_S, MASKED, ADD,
                                          REL32, GRAD)
        if BARRIER:
            bn_persist.wait_for_block(flag_ptr, j, last)
    if GRADS:
        s = tl.load(scale_ptr + c, mask=cm, other=0.0)
        t = tl.load(shift_ptr + c, mask=cm, other=0.0)
        mean = tl.load(mean_ptr + c, mask=cm, other=0.0)
        invstd = tl.load(invstd_ptr + c, mask=cm, other=0.0)
        # read past the SM's cache: the block's last program wrote them in this launch
        dw = tl.load(dw_ptr + c, mask=cm, other=0.0, cache_modifier=".cg")
        db = tl.load(db_ptr + c, mask=cm, other=0.0, cache_modifier=".cg")
        rel = tiles.tile_offsets(c, sC, sS, BR, REL32)
        q0 = i * tiles_per_program
        for k in range(tl.minimum(tiles_per_program, Q - q0)):
            bn_into_tiles.dx_tile(x_ptr, g_ptr, e_ptr, dx_ptr, dr_ptr, q0 + k, c, cm, rel, s, t, mean, invstd,
                                  dw, db, M, S, NSB, sN, sS, gN, gC, gS, eN, eC, eS, DF, dN, dC, dS, fN, fC,
                                  fS, True, DX, DR, BR, EVEN_S, MASKED, ADD, REL32)
        if BARRIER:
            bn_persist.leave_block(flag_ptr, j, CB, P)


def forward(xf: torch.Tensor, writes: tuple, weight, bias, running_mean, running_var,
                     momentum: float, eps: float, tracked) -> torch.Tensor | None:
    """The training forward in one launch (:mod:`trainfuse.nn.bn_persist`): the ``(4, C)``
    constants, or None, nothing done, where its programs would not all fit on the GPU at once.
    ``writes``: the residual, slice and dense tensor (``(N, C, S)`` views), ``dense_from``, and
    the kernel's ``RESIDUAL`` and ``DENSE``."""
    rf, of, df, dense_from, residual, dense = writes
    N, C, S = xf.shape
    rc = bn_stats.config(xf.stride(), C, reduce=True)
    rcb, rnsb = cdiv(C, rc.channels), cdiv(S, rc.rows)
    if rcb > bn_stats.COUNTERS:  # the flags would lie on the arrival counters
        return None
    consts = torch.empty(4, C, device=xf.device, dtype=torch.float32)
    has_w, update = weight is not None, running_mean is not None
    affine = (weight, bias) if has_w else (consts, consts)
    running = (running_mean, running_var) if update else (consts, consts)

    def args_for(P: int, per: int) -> tuple:
        partials = torch.empty(3, P, C, device=xf.device, dtype=torch.float32)  # mean, m2, count
        return (xf, rf, of, df, *partials, bn_stats.counters(xf.device, rcb), bn_persist.flags(xf.device),
                *affine, *running, *consts.unbind(0), consts if tracked is None else tracked, C, rcb, S, rnsb,
                N * rnsb, *xf.stride(), *rf.stride(), *of.stride(), *df.stride(), dense_from, per, P, N * S,
                momentum, eps)

    constexprs = dict(HAS_W=has_w, UPDATE=update, TRACK=tracked is not None, BP=bn_stats.FINALIZE_ROWS,
                      BR=rc.rows, BC=rc.channels, UNROLL=rc.unroll, RESIDUAL=residual, DENSE=dense,
                      **bn_stats.flags(rc, C, S, xf.stride(), rf.stride(), of.stride(), df.stride()))
    launched = bn_persist.launch(into_stats_apply_kernel, rc, N * rnsb, rcb, args_for, constexprs, xf.device,
                                 ("STATS", "APPLY"))
    return consts if launched else None


def backward(xf: torch.Tensor, gf: torch.Tensor, ef: torch.Tensor, dense_from: int, add: int,
             dxf: torch.Tensor, drf: torch.Tensor, need: tuple[bool, bool], consts: torch.Tensor,
             sums: torch.Tensor, grads: tuple, direct: int) -> bool:
    """The training backward in one launch: ``dw``, ``db`` into ``sums`` (and the params'
    ``grads`` with ``direct``), ``dx`` into ``dxf`` and the shortcut's grad into ``drf`` as
    ``need`` says (``(N, C, S)`` views; ``xf`` where not needed); False, nothing done, where its
    programs would not all fit on the GPU at once."""
    N, C, S = xf.shape
    rc = bn_stats.config(xf.stride(), C, reduce=True)
    rcb, rnsb = cdiv(C, rc.channels), cdiv(S, rc.rows)
    if rcb > bn_stats.COUNTERS:  # the flags would lie on the arrival counters
        return False

    def args_for(P: int, per: int) -> tuple:
        partials = torch.empty(2, P, C, device=xf.device, dtype=torch.float32)  # sum du, sum du xhat
        return (xf, gf, ef, dxf, drf, *consts.unbind(0), *partials, bn_stats.counters(xf.device, rcb),
                bn_persist.flags(xf.device), *sums, *grads, C, rcb, S, rnsb, N * rnsb, *xf.stride(),
                *gf.stride(), *ef.stride(), dense_from, *dxf.stride(), *drf.stride(), per, P, N * S)

    constexprs = dict(BP=bn_stats.FINALIZE_ROWS, BR=rc.rows, BC=rc.channels, UNROLL=rc.unroll, ADD=add,
                      GRAD=direct, DX=need[0], DR=need[1],
                      **bn_stats.flags(rc, C, S, xf.stride(), gf.stride(), ef.stride(), dxf.stride(),
                                       drf.stride()))
    return bn_persist.launch(into_grad_dx_kernel, rc, N * rnsb, rcb, args_for, constexprs, xf.device,
                             ("SUMS", "GRADS"))


__all__ = ["backward", "forward", "into_grad_dx_kernel", "into_stats_apply_kernel"]
