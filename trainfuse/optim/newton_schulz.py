"""Newton-Schulz orthogonalization of MuSGD's Muon updates, two ways.

- :func:`orthogonalized`: ultralytics' ``muon_update`` batching, op for op (the torch path of
  :class:`~trainfuse.optim.musgd.FusedMuSGD`, bit for bit MuSGD's): the matrices of equal column
  count share a zero-padded batch, so a model with many shapes runs many small batches (yolov5n:
  29 of them, some 560 launches a step).
- :class:`BatchedNewtonSchulz`: the kernels' path, for a fixed set of params. Every matrix is
  oriented wide (transposed when it has more rows than columns, as Newton-Schulz itself does)
  and zero-padded into a few batches by its smaller dimension (powers of two from 16; a batch's
  column counts span at most 8x), matrices of other long sides padded together only where the
  padding's extra matmul work is smaller than another batch's launches (GPT-2's 768 x 768,
  768 x 2304 and 768 x 3072 matrices run as three batches, not as one of 768 x 3072). Zero rows
  and columns stay zero through Newton-Schulz and leave the Frobenius norm as it is, so the
  padding and the orientation change only the order the matmuls sum in. MuSGD orients a whole
  batch by its padded shape where this orients each matrix by its own, and pads the long side to
  the batch's: on CPU most matrices still come out with MuSGD's bits, the others within bfloat16
  rounding (the same distance from a float64 Newton-Schulz). The quintic iteration amplifies that
  rounding along small singular directions, so on a GPU an element may differ from MuSGD's by a
  few percent. One Triton launch gathers (and casts) every batch into one bfloat16 buffer in
  square tiles, a tall matrix's tiles read along its rows and transposed in registers (for
  ``torch.optim.Muon``'s blend, FusedMuon's, the gather reads the momentum buffers and the grads
  where they are and blends them itself: no copy of the momentum, no float32 blend pass); after the
  batches' matmuls (17 launches a batch: the norm, the division, three products an iteration)
  another scatters them back scaled, straight into float32 targets laid out as their matrices
  (through a buffer and a copy otherwise).

The matrix of an update ``u`` is ``u`` flattened to ``(d[0], rest)`` in its own memory order (a
view for contiguous and channels_last tensors, a row-major copy otherwise); its scale is
``sqrt(max(1, d[-2] / d[-1]))``.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import triton
import triton.language as tl

from trainfuse._runtime.backend import interpreting
from trainfuse._runtime.launch import cdiv
from trainfuse._runtime.rounding import round_bf16_rne

# MuSGD's quintic Newton-Schulz coefficients, iteration count and norm epsilon
_NS_COEFFS = (3.4445, -4.7750, 2.0315)
_NS_STEPS = 5
_NS_EPS = 1e-7
# a bucket's row counts span at most this factor (MuSGD's bound on the zero padding)
_ROW_SPAN = 16
# BatchedNewtonSchulz: smallest padded short side, and the widest span of long sides in a batch
_MIN_SHORT = 16
_LONG_SPAN = 8
# a batch's fixed cost as matmul work: about 20 launches of a few microseconds each, at the
# bfloat16 matmul rate of an H100/H200 (~600 TFLOP/s): padding that costs more work than this
# runs as a batch of its own
_BATCH_FLOPS = 5e10
_TILE = 64  # the gather and scatter tiles (TILE x TILE elements)


def _ns_flops(count: int, M: int, N: int, steps: int) -> float:
    """The matmul work of ``steps`` quintic iterations on ``count`` wide ``M x N`` matrices:
    ``X X^T`` and ``B X`` (``2 M^2 N`` each), ``A^2`` (``2 M^3``)."""
    return count * steps * (4 * M * M * N + 2 * M ** 3)


def _iterate(X: torch.Tensor, coefficients: tuple[float, float, float] = _NS_COEFFS,
             steps: int = _NS_STEPS, out: torch.Tensor | None = None) -> torch.Tensor:
    """``steps`` quintic iterations on a batch of normalized wide bfloat16 matrices; the last one
    written into ``out`` where given (``X`` itself must then be ``out`` when ``steps`` is 0)."""
    a, b, c = coefficients
    for k in range(steps):
        A = X @ X.transpose(-2, -1)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A^2
        if k < steps - 1 or out is None:
            X = torch.baddbmm(X, B, X, beta=a)  # a X + B X
        elif X is out:  # one iteration on out itself: the product may not overwrite its input
            X = out.copy_(torch.baddbmm(X, B, X, beta=a))
        else:
            X = torch.baddbmm(X, B, X, beta=a, out=out)
    return X


def _newton_schulz(G: torch.Tensor) -> torch.Tensor:
    """``NS_5`` of each matrix of ``G`` (batch, rows, cols), in bfloat16: normalized to spectral
    norm <= 1, transposed when it has more rows than columns (the smaller Gram matrix)."""
    X = G.bfloat16()
    X /= X.norm(dim=(-2, -1), keepdim=True) + _NS_EPS
    tall = G.size(-2) > G.size(-1)
    X = _iterate(X.transpose(-2, -1) if tall else X)
    return X.transpose(-2, -1) if tall else X


def _scale(u: torch.Tensor) -> float:
    return max(1, u.size(-2) / u.size(-1)) ** 0.5


def orthogonalized(updates: list[torch.Tensor]) -> list[torch.Tensor]:
    """``sqrt(max(1, d[-2] / d[-1])) * NS_5(u)`` for each ``u`` of ``updates`` (2+ dims), in
    ``u``'s dtype and memory layout, batched as ultralytics' ``muon_update`` batches them (so the
    bits are its bits): the matrices with the same column count, scale, device and dtype share one
    batch, zero-padded to its most rows (zero rows stay zero through Newton-Schulz), split where
    the row counts would span more than 16x.

    Args:
        updates: the Muon momentum (or its Nesterov blend) of each param.

    Returns:
        The orthogonalized, scaled updates, in ``updates``' order.
    """
    buckets: dict[tuple, list] = {}
    for i, u in enumerate(updates):
        dense = u.is_contiguous()
        nhwc = not dense and u.ndim == 4 and u.is_contiguous(memory_format=torch.channels_last)
        if nhwc:
            m = u.permute(0, 2, 3, 1).flatten(1)
        else:
            m = u.flatten(1) if u.ndim > 2 else u.contiguous()
        buckets.setdefault((m.size(1), _scale(u), m.device, m.dtype), []).append(
            (i, m, u.stride() if dense or nhwc else None))
    out: list[Any] = [None] * len(updates)
    for (cols, scale, device, dtype), items in buckets.items():
        items.sort(key=lambda t: -t[1].size(0))
        start = 0
        for j in range(1, len(items) + 1):
            if j < len(items) and items[start][1].size(0) <= _ROW_SPAN * items[j][1].size(0):
                continue
            batch = items[start:j]
            start = j
            X = torch.zeros(len(batch), batch[0][1].size(0), cols, device=device, dtype=dtype)
            torch._foreach_add_([X[k, : m.size(0)] for k, (_, m, _) in enumerate(batch)],
                                [m for _, m, _ in batch])
            X = _newton_schulz(X).contiguous().to(dtype).mul_(scale)
            for k, (i, m, stride) in enumerate(batch):
                x = X[k, : m.size(0)]
                shape = updates[i].shape
                out[i] = x.as_strided(shape, stride) if stride else x.reshape(shape)
    return out


# ---- the kernels' path ------------------------------------------------------------------------------
# A plan's matrix table, one int64 row per matrix: where its padded copy starts in the bfloat16
# buffer (elements), the padded M and N, the float32 addresses the gather reads (the stage's
# slice, or the target for Nesterov's lerp) and the scatter writes, its rows and columns in memory
# order, whether it is tall (enters transposed), and its momentum buffer's address (for the
# gather that blends torch.optim.Muon's momentum itself; written when the buffers are bound).
# The tile table: matrix, tile row, tile column per program (int32).
_MAT_WIDTH = tl.constexpr(10)
_FROM_STAGE, _FROM_TARGET = 3, 4
_MOMENTUM = tl.constexpr(9)


@triton.jit
def _tile_of(mats, tiles, ALIGNED: tl.constexpr, TILE: tl.constexpr):
    """This program's tile: its matrix's index and table row, the tile's row and column indices in
    the padded matrix, and the matrix's M, N, rows, columns and whether it is tall."""
    t = tl.program_id(0)
    k = tl.load(tiles + t * 3).to(tl.int64)
    mat = mats + k * _MAT_WIDTH
    i = tl.load(tiles + t * 3 + 1) * TILE + tl.arange(0, TILE)
    j = tl.load(tiles + t * 3 + 2) * TILE + tl.arange(0, TILE)
    c = tl.load(mat + 7)
    if ALIGNED:  # every address 16-byte aligned and every column count a multiple of 4: 16-byte accesses
        c = (c // 4) * 4
    return k, mat, i, j, tl.load(mat + 1), tl.load(mat + 2), tl.load(mat + 6), c, tl.load(mat + 8) != 0


@triton.jit
def _read(mat, col, i, j, r, c, tall, ALIGNED: tl.constexpr):
    """The tile of the float32 matrix at address ``mat[col]`` (rows x cols in memory order) at
    padded rows ``i`` and columns ``j``, zeros past its edges; a tall one enters transposed: its
    tile is read along its own rows (coalesced) and transposed in registers."""
    src = tl.load(mat + col).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        src = tl.multiple_of(src, 16)
    if tall:  # X[i, j] = S[j, i]
        x = tl.trans(tl.load(src + j[:, None] * c + i[None, :], mask=(j[:, None] < r) & (i[None, :] < c),
                             other=0.0))
    else:
        x = tl.load(src + i[:, None] * c + j[None, :], mask=(i[:, None] < r) & (j[None, :] < c), other=0.0)
    return x


@triton.jit
def _lerp(a, b, w, EXACT_FMA: tl.constexpr):
    """``torch.lerp(a, b, w)``: its two formulas, each one fused multiply-add, as torch's CUDA
    kernel (nvcc) and its vectorized CPU kernel compute them. The interpreter's ``fma`` rounds
    twice, so there (``EXACT_FMA``) the product and the sum are formed in float64, where the
    product of two float32 numbers is exact, and rounded once to float32."""
    d = b - a
    if EXACT_FMA:
        d64 = d.to(tl.float64)
        w64 = tl.cast(w, tl.float64)
        small = a.to(tl.float64) + w64 * d64
        large = b.to(tl.float64) - d64 * (1.0 - w64)
        return tl.where(w < 0.5, small, large).to(tl.float32)
    return tl.where(w < 0.5, tl.fma(w, d, a), tl.fma(-d, 1.0 - w, b))


@triton.jit
def _gather(mats, tiles, X, mu_ptr, mu, rest, FROM: tl.constexpr, BLEND: tl.constexpr,
            NESTEROV: tl.constexpr, MU_ON_DEVICE: tl.constexpr, ALIGNED: tl.constexpr, TILE: tl.constexpr,
            RNE: tl.constexpr):
    # one TILE x TILE tile of a padded matrix (M x N, zero-padded, at element mats[0] of X) from the
    # float32 matrix at address mats[FROM]; with BLEND, torch.optim.Muon's blend of the momentum
    # (at mats[_MOMENTUM]) and the grads (at mats[FROM]): u = m.lerp(g, 1 - mu), g.lerp(u, mu)
    # for Nesterov; mu and 1 - mu as float32 from the float64 at mu_ptr (MU_ON_DEVICE) or as given
    # RNE (the interpreter): round to nearest even by hand (the interpreter's conversion truncates;
    # the GPU's rounds) and fused multiply-adds formed exactly
    _, mat, i, j, M, N, r, c, tall = _tile_of(mats, tiles, ALIGNED, TILE)
    x = _read(mat, FROM, i, j, r, c, tall, ALIGNED)
    if BLEND:
        if MU_ON_DEVICE:
            m64 = tl.load(mu_ptr)
            mu = m64.to(tl.float32)
            rest = (1.0 - m64).to(tl.float32)
        u = _lerp(_read(mat, _MOMENTUM, i, j, r, c, tall, ALIGNED), x, rest, RNE)
        if NESTEROV:
            x = _lerp(x, u, mu, RNE)
        else:
            x = u
    if RNE:
        x = round_bf16_rne(x)
    dst = X + tl.load(mat) + i[:, None] * N + j[None, :]
    tl.store(dst, x.to(X.dtype.element_ty), mask=(i[:, None] < M) & (j[None, :] < N))


@triton.jit
def _scatter(X, mats, tiles, scales, ALIGNED: tl.constexpr, TILE: tl.constexpr):
    k, mat, i, j, M, N, r, c, tall = _tile_of(mats, tiles, ALIGNED, TILE)
    dst = tl.load(mat + 5).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        dst = tl.multiple_of(dst, 16)
    x = tl.load(X + tl.load(mat) + i[:, None] * N + j[None, :], mask=(i[:, None] < M) & (j[None, :] < N),
                other=0.0).to(tl.float32)
    x = x * tl.load(scales + k)
    if tall:
        tl.store(dst + j[:, None] * c + i[None, :], tl.trans(x), mask=(j[:, None] < r) & (i[None, :] < c))
    else:
        tl.store(dst + i[:, None] * c + j[None, :], x, mask=(i[:, None] < r) & (j[None, :] < c))


def _batched(items: list, steps: int) -> list[list]:
    """One short-side class's matrices (``(long side, ..., short side, ...)`` items) in batches:
    by long side, a group per long side merged into the batch before it while the merged batch's
    long sides span at most ``_LONG_SPAN`` and its padding costs less work than a batch of its
    own (``_BATCH_FLOPS``)."""
    groups: dict[int, list] = {}
    for it in sorted(items, key=lambda it: it[0]):
        groups.setdefault(it[0], []).append(it)

    def work(batch: list) -> float:
        M = max(it[3] for it in batch)
        return _ns_flops(len(batch), M, max(M, max(it[0] for it in batch)), steps)

    out: list[list] = []
    for group in groups.values():
        if out:
            last = out[-1]
            merged = last + group
            if (group[0][0] <= _LONG_SPAN * last[0][0]
                    and work(merged) - work(last) - work(group) <= _BATCH_FLOPS):
                out[-1] = merged
                continue
        out.append(list(group))
    return out


def _memory_strides(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides where its memory order is the matrix MuSGD takes (contiguous, channels_last),
    else the row-major strides of its shape (MuSGD then takes a row-major copy)."""
    if t.is_contiguous() or (t.ndim == 4 and t.is_contiguous(memory_format=torch.channels_last)):
        return t.stride()
    return torch.empty(t.shape, device="meta").stride()


class BatchedNewtonSchulz:
    """The Muon momentum, its Nesterov blend and ``scale * NS_5`` of it for a fixed list of params,
    in a few padded batches (module docstring).

    Args:
        targets: one tensor per param (2+ dims, one device): where :meth:`run` writes each
            param's orthogonalized, scaled update. Their addresses and layouts are the plan's key
            (:meth:`key_of`).
        scales: each target's scale (None: MuSGD's ``sqrt(max(1, d[-2] / d[-1]))``).
        coefficients, steps: the quintic iteration's ``(a, b, c)`` and count (MuSGD's by default).
        eps: the norm's guard: added to it (MuSGD), or its floor with ``clamp_eps``
            (``torch.optim.Muon``).

    Attributes:
        direct: whether the scatter stores into the targets themselves (every target float32,
            contiguous or channels_last), not into a buffer copied to them.
        layout: per batch ``(rows, cols, indices)``: its padded size and the indices of its
            tensors in ``targets`` (a matrix with more rows than columns enters transposed), what a
            reference needs to pad the same way.
    """

    def __init__(self, targets: list[torch.Tensor], scales: list[float] | None = None,
                 coefficients: tuple[float, float, float] = _NS_COEFFS, steps: int = _NS_STEPS,
                 eps: float = _NS_EPS, clamp_eps: bool = False):
        device = targets[0].device
        self.settings = (tuple(coefficients), steps, eps, clamp_eps)
        scales = [_scale(t) for t in targets] if scales is None else scales
        sizes = [t.numel() for t in targets]
        offsets = [0, *itertools.accumulate(sizes)][:-1]
        total = sum(sizes)
        self.key = self.key_of(targets)
        self._stage = torch.zeros(total, dtype=torch.float32, device=device)
        strides = [_memory_strides(t) for t in targets]
        layouts = list(zip(targets, strides, offsets))
        self._stage_views = [self._stage.as_strided(t.shape, s, o) for t, s, o in layouts]
        # float32 targets whose memory order is their matrix take the scatter's stores themselves
        # (and, for Nesterov's lerp, the blend the gather reads); others go through a buffer
        self.direct = all(t.dtype == torch.float32 and t.stride() == s for t, s in zip(targets, strides))
        if self.direct:
            self._out, self._out_views = None, targets
        else:
            self._out = torch.zeros(total, dtype=torch.float32, device=device)
            self._out_views = [self._out.as_strided(t.shape, s, o) for t, s, o in layouts]
        stage_at = [self._stage.data_ptr() + 4 * o for o in offsets]
        target_at = [t.data_ptr() for t in targets] if self.direct else stage_at
        out_at = target_at if self.direct else [self._out.data_ptr() + 4 * o for o in offsets]
        classes: dict[int, list] = {}
        for i, t in enumerate(targets):
            r = t.size(0)
            c = t.numel() // r
            short, long_ = min(r, c), max(r, c)
            cls = max(_MIN_SHORT, 1 << max(0, math.ceil(math.log2(short))))
            classes.setdefault(cls, []).append((long_, (r, c), scales[i], short, i))
        # every batch's padded matrices in one bfloat16 buffer: one gather and one scatter launch
        # for all of them (a matrix table row and a tile per program, module comment above)
        self._batches = []
        self.layout: list[tuple[int, int, list[int]]] = []
        mats, tiles, mat_scales = [], [], []
        self._mat_targets: list[int] = []  # each table row's index in targets
        self._bound: list[int] | None = None  # the momentum buffers' addresses in the table
        at = 0
        for items in classes.values():
            for batch in _batched(items, steps):
                M = max(it[3] for it in batch)
                N = max(M, max(it[0] for it in batch))
                for k, (_, (r, c), scale, _, i) in enumerate(batch):
                    x_at = at + k * M * N
                    tiles += [(len(mats), ti, tj) for ti in range(cdiv(M, _TILE))
                              for tj in range(cdiv(N, _TILE))]
                    mats.append((x_at, M, N, stage_at[i], target_at[i], out_at[i], r, c, int(r > c), 0))
                    self._mat_targets.append(i)
                    mat_scales.append(scale)
                self._batches.append((at, len(batch), M, N))
                self.layout.append((M, N, [it[4] for it in batch]))
                at += len(batch) * M * N
        self._padded = at
        self._mats = torch.tensor(mats, dtype=torch.int64, device=device)
        self._tiles = torch.tensor(tiles, dtype=torch.int32, device=device)
        self._scales = torch.tensor(mat_scales, dtype=torch.float32, device=device)
        self._aligned = all(a % 16 == 0 for m in mats for a in m[3:6]) and all(m[7] % 4 == 0 for m in mats)

    @staticmethod
    def key_of(targets: list[torch.Tensor]) -> tuple:
        """What a plan is valid for: the targets' addresses, shapes and strides."""
        return tuple((t.data_ptr(), t.shape, t.stride()) for t in targets)

    @property
    def batches(self) -> int:
        """How many padded batches a step runs (each 17 launches of its own)."""
        return len(self._batches)

    def _fill_stage(self, bufs: list[torch.Tensor]) -> None:
        """The stage := ``bufs`` (each in its matrix's order): one concatenation where every buffer
        is float32 and laid out as its slice of the stage (a flat view of each), else a copy each."""
        if all(b.dtype == torch.float32 and b.shape == v.shape and b.stride() == v.stride()
               for b, v in zip(bufs, self._stage_views)):
            torch.cat([b.as_strided((b.numel(),), (1,)) for b in bufs], out=self._stage)
        else:
            torch._foreach_copy_(self._stage_views, bufs)

    def _bind(self, bufs: list[torch.Tensor]) -> bool:
        """The momentum buffers' addresses in the matrix table (rewritten only where they moved:
        a step captured in a CUDA graph finds them as written before); whether all are 16-byte
        aligned."""
        at = [bufs[i].data_ptr() for i in self._mat_targets]
        if at != self._bound:
            self._mats[:, _MOMENTUM.value].copy_(torch.tensor(at, dtype=torch.int64))
            self._bound = at
        return all(a % 16 == 0 for a in at)

    def run(self, bufs: list[torch.Tensor], grads: list[torch.Tensor], momentum: float | torch.Tensor,
            nesterov: bool, targets: list[torch.Tensor], lerp: bool = False) -> None:
        """``targets[i] = scale_i * NS(u_i)`` with ``u = mu m + (1 - mu) g`` (``m`` the Muon
        momentum ``bufs``, read only), blended once more with ``g`` for Nesterov, MuSGD's ops in
        MuSGD's order; with ``lerp``, ``torch.optim.Muon``'s: ``u = m.lerp(g, 1 - mu)``, and
        ``g.lerp(u, mu)`` for Nesterov. ``grads`` (float32, unscaled and clipped) may be
        ``targets`` themselves. ``momentum``: a number, or a 0-d device tensor, read on the device
        (a step replayed from a CUDA graph then takes the value written there): the same float32
        factors as the number's."""
        coefficients, steps, eps, clamp_eps = self.settings
        device = self._stage.device
        flat = torch.empty(self._padded, dtype=torch.bfloat16, device=device)
        grid = (self._tiles.size(0),)
        in_targets = self.direct and (grads is targets or all(g is t for g, t in zip(grads, targets)))
        if lerp and in_targets and all(b.dtype == torch.float32 and b.shape == t.shape
                                       and b.stride() == t.stride() for b, t in zip(bufs, targets)):
            # torch.optim.Muon's blend inside the gather: it reads the momentum and the grads (in
            # the targets) where they are and writes the blend's bfloat16 copy, in one launch
            aligned = self._bind(bufs) and self._aligned
            on_device = isinstance(momentum, torch.Tensor)
            mu = 0.0 if on_device else float(momentum)
            _gather[grid](self._mats, self._tiles, flat, momentum if on_device else self._scales, mu,
                          1.0 - mu, FROM=_FROM_TARGET, BLEND=True, NESTEROV=bool(nesterov),
                          MU_ON_DEVICE=on_device, ALIGNED=aligned, TILE=_TILE, RNE=interpreting())
        else:
            self._blend_to_stage(bufs, grads, momentum, nesterov, targets, lerp, in_targets)
            _gather[grid](self._mats, self._tiles, flat, self._scales, 0.0, 0.0,
                          FROM=_FROM_TARGET if lerp and nesterov and in_targets else _FROM_STAGE, BLEND=False,
                          NESTEROV=False, MU_ON_DEVICE=False, ALIGNED=self._aligned, TILE=_TILE,
                          RNE=interpreting())
        # bfloat16 products whatever autocast the caller steps under (a float16 autocast would
        # cast them, and the last one could not land in the bfloat16 buffer)
        with torch.autocast(device.type, enabled=False):
            for at, count, M, N in self._batches:
                X = flat[at : at + count * M * N].view(count, M, N)
                norm = X.norm(dim=(-2, -1), keepdim=True)
                X /= norm.clamp(min=eps) if clamp_eps else norm + eps
                _iterate(X, coefficients, steps, out=X)
        _scatter[grid](flat, self._mats, self._tiles, self._scales, ALIGNED=self._aligned, TILE=_TILE)
        if not self.direct:
            torch._foreach_copy_(targets, self._out_views)

    def _blend_to_stage(self, bufs: list[torch.Tensor], grads: list[torch.Tensor],
                        momentum: float | torch.Tensor, nesterov: bool, targets: list[torch.Tensor],
                        lerp: bool, in_targets: bool) -> None:
        """:meth:`run`'s blend by torch's foreach operations, into the stage (Nesterov's lerp into
        the targets, where they hold the grads)."""
        u = self._stage_views
        into_targets = lerp and nesterov and in_targets
        self._fill_stage(bufs)
        if isinstance(momentum, torch.Tensor) and lerp:
            # a weight per tensor (a lone 0-d weight would be read on the host, which a capture
            # refuses): torch's lerp of a tensor weight, the same formula as a number's
            mu, rest = momentum.to(torch.float32), (1 - momentum).to(torch.float32)
            torch._foreach_lerp_(u, grads, [rest] * len(u))
            if into_targets:
                torch._foreach_lerp_(targets, u, [mu] * len(u))
            elif nesterov:
                torch._foreach_copy_(u, torch._foreach_lerp(grads, u, [mu] * len(u)))
        elif isinstance(momentum, torch.Tensor):
            mu, rest = momentum.to(torch.float32), (1 - momentum).to(torch.float32)
            torch._foreach_mul_(u, mu)
            torch._foreach_addcmul_(u, grads, [rest] * len(u))
            if nesterov:
                torch._foreach_mul_(u, mu)
                torch._foreach_addcmul_(u, grads, [rest] * len(u))
        elif lerp:
            torch._foreach_lerp_(u, grads, 1 - momentum)
            if into_targets:
                torch._foreach_lerp_(targets, u, momentum)
            elif nesterov:
                torch._foreach_copy_(u, torch._foreach_lerp(grads, u, momentum))
        else:
            torch._foreach_mul_(u, momentum)
            torch._foreach_add_(u, grads, alpha=1 - momentum)
            if nesterov:
                torch._foreach_mul_(u, momentum)
                torch._foreach_add_(u, grads, alpha=1 - momentum)


__all__ = ["BatchedNewtonSchulz", "orthogonalized"]
