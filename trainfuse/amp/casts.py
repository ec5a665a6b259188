"""Cast fusion: the model keeps 16-bit weights, the fused optimizer keeps their float32 masters.

Under autocast every forward casts each float32 weight to bfloat16/float16 again (1.16 ms per
forward on GPT-2 124M, more than the whole AdamW step). After :func:`fuse_casts` the weights
*are* 16-bit, so autocast finds nothing to cast, and the optimizer's update kernel, which already
reads and writes every weight, writes the 16-bit copy beside the float32 master it updates. No
cast kernel runs anywhere in the step. This is the eager-mode form of OneFlow's fused model
update + cast (static graphs and float16 only there).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from trainfuse._runtime import compat
from trainfuse.optim._base import MASTER_KEY, FusedOptimizer

# normalization layers: their statistics and affine params are small and precision-sensitive, and
# autocast runs them in float32 too
NORM_LAYERS: tuple[type[nn.Module], ...] = (
    compat.NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)
# what stays float32 by default: the normalization layers, and embeddings. Autocast casts
# neither: an embedding runs in its weight's dtype, so under autocast its output, and a
# transformer's residual stream after it, stay float32. A 16-bit embedding would change that
# (a 16-bit residual stream, and a cast back to float32 before every LayerNorm) instead of only
# removing casts: on the 6-layer GPT-like benchmark (H200) a float32 embedding runs 297 kernels a
# step against 311 (torch: 397), and the step took 8.19 ms against 9.02 (torch 10.02).
KEEP_FP32: tuple[type[nn.Module], ...] = (*NORM_LAYERS, nn.Embedding, nn.EmbeddingBag)
_ORIGINAL = "_trainfuse_cast_dtypes"


def fuse_casts(model: nn.Module, optimizer: FusedOptimizer, dtype: torch.dtype = torch.bfloat16,
               keep_fp32: Iterable[type[nn.Module]] = KEEP_FP32) -> nn.Module:
    """Turn ``model``'s floating-point params into ``dtype`` in place, with float32 masters kept
    by ``optimizer``.

    The Parameter objects stay the same (``p.data`` is replaced), so param groups, schedulers,
    hooks and an EMA still hold them. Each param the optimizer owns gets a float32 master seeded
    from its current float32 value (not from the rounded one) and float32 states; from then on
    the update reads the 16-bit grad, updates master and states in float32 and writes the 16-bit
    weight. Keep running the forward under autocast: activations are still cast there, weights no
    longer are. With float16 use a GradScaler (unscale and the inf skip run in the kernel).

    Args:
        model: the model; modules that are instances of ``keep_fp32`` keep their params, also
            where another module shares them (an output layer tied to the embedding).
        optimizer: a trainfuse fused optimizer holding (some of) the model's params.
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        keep_fp32: module types whose own params stay float32 (:data:`KEEP_FP32`: normalization
            layers and embeddings, which autocast does not cast either; ``NORM_LAYERS`` makes
            embeddings 16-bit too).

    Returns:
        ``model``.

    Example:
        >>> import torch, trainfuse
        >>> nn = torch.nn
        >>> model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.LayerNorm(4))
        >>> opt = trainfuse.FusedAdamW(model.parameters())
        >>> _ = fuse_casts(model, opt)
        >>> model[0].weight.dtype, model[1].weight.dtype, model[2].weight.dtype
        (torch.float32, torch.bfloat16, torch.float32)
    """
    if dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"fuse_casts: dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    if not isinstance(optimizer, FusedOptimizer):
        raise TypeError(f"fuse_casts: the optimizer must be a trainfuse fused optimizer (FusedAdamW, "
                        f"FusedAdam, FusedSGD), got {type(optimizer).__name__}: only their update "
                        "kernel writes the 16-bit weights")
    keep = tuple(keep_fp32)
    owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
    original = model.__dict__.setdefault(_ORIGINAL, {})
    kept = {id(p) for m in model.modules() if keep and isinstance(m, keep)
            for p in m.parameters(recurse=False)}  # also where another module shares them
    with torch.no_grad():
        for mname, module in model.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                if id(p) in kept or not p.is_floating_point() or p.dtype == dtype:
                    continue
                if p.dtype != torch.float32:
                    raise TypeError(f"fuse_casts: {mname}.{pname} is {p.dtype}; expected float32 params")
                if p.grad is not None:
                    p.grad = None  # a float32 grad cannot stay on a 16-bit param
                if id(p) in owned:
                    optimizer.seed_master(p, p.detach())
                original[f"{mname}.{pname}" if mname else pname] = p.dtype
                p.data = p.data.to(dtype)
    return model


def fp32_state_dict(model: nn.Module, optimizer: FusedOptimizer | None = None) -> dict[str, torch.Tensor]:
    """A plain float32 ``state_dict`` of a model changed by :func:`fuse_casts`: params with a
    master come from the master (full precision), other cast params are upcast. It loads into the
    unmodified model class.

    Example:
        >>> import torch, trainfuse
        >>> model = torch.nn.Linear(4, 4)
        >>> opt = trainfuse.FusedAdamW(model.parameters())
        >>> ref = {k: v.clone() for k, v in model.state_dict().items()}
        >>> _ = fuse_casts(model, opt)
        >>> all(torch.equal(v, ref[k]) for k, v in fp32_state_dict(model, opt).items())
        True
    """
    original = model.__dict__.get(_ORIGINAL, {})
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for k, v in model.state_dict().items():
        p = params.get(k)
        master = None
        if p is not None and optimizer is not None:
            master = optimizer.state.get(p, {}).get(MASTER_KEY)
        if master is not None:
            out[k] = master.detach().clone()
        elif k in original:
            out[k] = v.to(original[k])
        else:
            out[k] = v
    return out


__all__ = ["KEEP_FP32", "NORM_LAYERS", "fp32_state_dict", "fuse_casts"]
