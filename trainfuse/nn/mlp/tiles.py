"""Launch shapes of FusedMLP's matmul: the settings users and benchmarks set (:class:`MatmulConfigs`),
the default tile per problem (:func:`default_tile`), and the plan of a launch (:func:`make_plan`):
everything that follows from a call's signature, worked out once and cached by the caller."""

from __future__ import annotations

import dataclasses
import itertools

import torch
import triton.language as tl

from trainfuse._runtime.backend import interpreting
from trainfuse._runtime.launch import sm_count
from trainfuse.nn.mlp.kernels import EPI_FORWARD, EPI_WGRAD


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Tile shape of one matmul launch. ``stages`` is the software-pipelining depth; the
    interpreter tests shrink the tiles so that small problems still span several programs."""

    bm: int = 128
    bn: int = 128
    bk: int = 64
    warps: int = 8
    stages: int = 3
    group_m: int = 8
    tma: bool = True  # operand tiles through TMA tensor descriptors where the layout allows


_serials = itertools.count()


@dataclasses.dataclass
class MatmulConfigs:
    """The launch shapes of the three matmuls of a layer and how the weight grad splits. Every
    assignment gives the object a new ``serial``: cached launch plans are keyed on it."""

    # a fixed launch shape per matmul, or None: :func:`default_tile` picks one per problem
    forward: MatmulConfig | None = None
    dgrad: MatmulConfig | None = None
    wgrad: MatmulConfig | None = None
    # wgrad: split the batch (its K) until about ``wave_programs`` programs per SM run, but keep at
    # least ``min_split_k`` rows per split (short splits spend more on the partials than they save)
    # (sweep: 4 per SM and 2048 rows is the best measured at both B=8192 x 1024^2, where it splits
    # 4 ways, and B=65536 x 256^2, 32 ways; 64-way splits spent more on partials than they saved)
    wave_programs: int = 4
    min_split_k: int = 2048
    max_split: int = 64
    act_block: int = 2048
    # forward and dgrad as C^T = W X^T: the weight is the A operand, which the tensor cores can
    # take from registers, so a float32 weight converted there never goes back to shared memory
    # (None: whenever the compute dtype is 16-bit. A 16-bit weight gains too: a whole 4-layer
    # step, CUDA-graph timed on an H200, took 3-6 % less at D=1024 and D=4096, +0.3-0.9 % at D=256)
    weight_first: bool | None = None
    # False: operand tiles always through pointers (else as the launch shape says)
    tma: bool | None = None
    # replay a chain's forward and its one-stream backward as CUDA graphs once their launches
    # repeat (:func:`trainfuse._runtime.launch.finish_recording`); False launches each kernel every call
    graphs: bool = True
    # chains of ReLU (or no activation) layers without dropout on cuBLAS's matmuls with our fused
    # mask and bias-grad pass (:mod:`trainfuse.nn.mlp.library`): less GPU time, more host time
    library: bool = False

    def __setattr__(self, name, value) -> None:
        object.__setattr__(self, name, value)
        if name not in ("serial", "graphs", "library"):  # these change no Triton launch
            object.__setattr__(self, "serial", next(_serials))


_SMEM_BUDGET = 200 * 1024  # bytes of shared memory the pipeline stages may take (228 KB on Hopper)


def rounds_weight_transposed(epi: int, converts: bool) -> bool:
    """The input grad of a float32 weight: it reads ``W^T`` and rounds it in registers. Through
    pointers in 3-stage pipelines triton 3.6 gave wrong tiles (H200, 65536 x 256: 8 launches in
    10; 8192 x 1024: 1 in 10; 128 x 128 tiles: nearly every launch); through TMA none in 30 (at
    +5 us a launch at D=256 and 1024, -8 us at D=4096), through pointers in 2 stages none in 18.
    :func:`default_tile` gives it TMA tiles; :func:`make_plan` caps the stages where the layout
    keeps it on pointers."""
    return converts and epi != EPI_FORWARD


def default_tile(epi: int, M: int, N: int, K: int, cd: torch.dtype, converts: bool, drop: bool,
                 sms: int) -> MatmulConfig:
    """The launch shape for an (M, N, K) matmul in compute dtype ``cd`` (``converts``: one operand
    is a float32 weight rounded in registers; ``drop``: the epilogue draws a dropout mask).

    Each choice is the fastest measured at the benchmark's three shapes (``python -m trainfuse.bench
    mlp --sweep``: each matmul alone, and whole steps, CUDA-graph timed; H200, torch 2.11, triton
    3.6), within what ptxas's register reports allow:

    - 8 warps per 128-row tile: 4 warps would hold a 128 x 128 float32 accumulator in 128
      registers a thread.
    - float32 operands: 128 x 128 x 32 tiles, as a stage takes twice the shared memory.
    - weight grads: 128 x 256 tiles in groups of 16 row tiles where those alone fill the GPU twice
      (16 rather than 8: -12 % at 4096^2 x 2048); else 64 x 128 tiles split over the batch, in 3
      stages (3 rather than 4: -13 % at 1024^2 x 8192).
    - the input grad of a float32 weight: TMA tiles (:func:`rounds_weight_transposed`).
    - a dropout epilogue: no 128 x 256 tiles (the Philox state spills); 64 x 128 TMA tiles for
      short reductions, else 128 x 128 pointer tiles.
    - 16-bit weights at a short reduction (K < 512) where 128 x 256 tiles fill the GPU: 128 x 128
      pointer tiles for the forward and input grad (K = 256, 65536 rows: step -14 %).
    - input grads of a 16-bit weight where 128 x 256 tiles fill the GPU: those tiles through TMA, 4
      stages (-5 % at D=1024, -9 to -17 % at D=4096).
    - short reductions otherwise: 64 x 128 TMA tiles (more programs resident per SM, one's epilogue
      overlapping another's loads), except a float32 weight where 128 x 256 tiles fill the GPU:
      those tiles (K = 256, 65536 rows: forward -41 %, input grad -24 %), through pointers.
    - long reductions: 128 x 256 pointer tiles; a 16-bit forward 128 x 128.
    """
    if cd == torch.float32:  # float32 operands: twice the shared memory per stage
        return MatmulConfig(128, 128, 32, 8, 3)
    if epi == EPI_WGRAD:
        if -(-M // 128) * -(-N // 256) >= 2 * sms:
            return MatmulConfig(128, 256, 64, 8, 3, group_m=16)
        return MatmulConfig(64, 128, 64, 4, 3)
    if rounds_weight_transposed(epi, converts):  # TMA tiles: see there
        return MatmulConfig(128, 128, 64, 8, 3) if drop else MatmulConfig(128, 256, 64, 8, 3)
    if drop:
        return MatmulConfig(64, 128, 64, 4, 4) if K < 512 else MatmulConfig(128, 128, 64, 8, 3, tma=False)
    fills = -(-M // 128) * -(-N // 256) >= sms  # 128 x 256 tiles fill the GPU at least once
    if K < 512 and not converts and fills:
        return MatmulConfig(128, 128, 64, 8, 3, tma=False)
    if epi != EPI_FORWARD and not converts and fills:
        return MatmulConfig(128, 256, 64, 8, 4)
    if K < 512 and not (converts and fills):
        return MatmulConfig(64, 128, 64, 4, 4)
    if epi == EPI_FORWARD and not converts:
        return MatmulConfig(128, 128, 64, 8, 3, tma=False)
    return MatmulConfig(128, 256, 64, 8, 3, tma=False)


def pipeline_stages(cfg: MatmulConfig, a: torch.Tensor, b: torch.Tensor) -> int:
    """Fewer stages when a float32 operand (read as stored, converted in registers) doubles a
    stage's shared memory."""
    per_stage = cfg.bk * (cfg.bm * a.element_size() + cfg.bn * b.element_size())
    return max(2, min(cfg.stages, _SMEM_BUDGET // per_stage))


_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _precision(cd: torch.dtype) -> str:
    if cd != torch.float32 or (not interpreting() and torch.backends.cuda.matmul.allow_tf32):
        return "tf32"  # 16-bit operands ignore it; float32 follows torch's TF32 switch
    return "ieee"


def tma_layout(t: torch.Tensor) -> bool | None:
    """How a tensor descriptor can read the 2-d view ``t``: False when its rows are contiguous
    (row-major), True when its columns are (the transpose of a row-major matrix), None when
    neither, or the base or the row pitch is not 16-byte aligned (what TMA needs)."""
    if t.stride(1) == 1 or t.shape[1] == 1:
        pitch, transposed = t.stride(0), False
    elif t.stride(0) == 1 or t.shape[0] == 1:
        pitch, transposed = t.stride(1), True
    else:
        return None
    if t.data_ptr() % 16 or (pitch * t.element_size()) % 16:
        return None
    return transposed


@dataclasses.dataclass
class MatmulPlan:
    """Everything about a matmul launch that follows from its signature (shapes, strides,
    dtypes, alignment, epilogue, launch shapes): worked out once, reused by every later call."""

    grid: tuple[int]
    ints: tuple[int, ...]
    split: int
    ws_floats: int
    tiles: int
    warps: int
    constexprs: dict


def make_plan(config: MatmulConfigs, a, b, c, x, cd, epi, act, has_bias, bias_rows, pre, drop, drop_index,
              accum) -> MatmulPlan:
    """The plan of a :func:`trainfuse.nn.mlp.launches.matmul` call (its arguments, resolved) under
    ``config``: grid, the kernel's int arguments, split-K, workspace size and constexprs."""
    M, K = a.shape
    N = b.shape[1]
    kind = config.wgrad if epi == EPI_WGRAD else config.dgrad if epi != EPI_FORWARD else config.forward
    sms = sm_count(a.device.index) if a.device.type == "cuda" else 4
    converts = cd != torch.float32 and torch.float32 in (a.dtype, b.dtype)
    if kind is None:
        kind = default_tile(epi, M, N, K, cd, converts, drop, sms)
    bm, bn, bk = kind.bm, kind.bn, kind.bk
    tiles = -(-M // bm) * -(-N // bn)
    split = 1
    if epi == EPI_WGRAD:
        target = sms * config.wave_programs
        split = max(1, min(config.max_split, target // tiles, K // config.min_split_k))
    k_split = -(-K // split)
    k_split = -(-k_split // bk) * bk
    split = max(1, -(-K // k_split))
    d_m, d_n = drop_index or (N, 1)
    a_t, b_t = tma_layout(a), tma_layout(b)
    tma = config.tma is not False and kind.tma and a_t is not None and b_t is not None
    stages = pipeline_stages(kind, a, b)
    if not tma and rounds_weight_transposed(epi, converts):
        stages = min(stages, 2)  # a layout TMA cannot read: pointers, at most 2 stages (see there)
    ints = (M, N, K, k_split, split, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0),
            c.stride(1), x.stride(0), x.stride(1), d_m, d_n)
    constexprs = dict(
        EPI=epi, ACT=act, HAS_BIAS=has_bias, BIAS_ROWS=bias_rows, STORE_PRE=pre, DROP=drop,
        SPLIT_K=split > 1, ACCUM=accum, CD=_TL[cd], PREC=_precision(cd),
        UPCAST=interpreting() and cd == torch.bfloat16,
        EVEN_M=M % bm == 0, EVEN_N=N % bn == 0, EVEN_K=K % k_split == 0, TMA=tma, A_T=bool(a_t),
        B_T=bool(b_t), BM=bm, BN=bn, BK=bk,
        GROUP_M=kind.group_m, num_stages=stages)
    return MatmulPlan((tiles * split,), ints, split, tiles * split * bm * bn + -(-M // bm) * split * bm,
                      tiles, kind.warps, constexprs)


__all__ = ["MatmulConfig", "MatmulConfigs", "MatmulPlan", "default_tile", "make_plan", "pipeline_stages",
           "rounds_weight_transposed", "tma_layout"]
