"""Every private torch internal trainfuse relies on, in one place.

Each name here is bound once at import, from the torch attribute it stands for, so a hot path pays
no wrapper (``current_raw_stream`` *is* ``torch._C._cuda_getCurrentRawStream``).
``tests/_runtime/test_compat.py`` checks each one against the installed torch: that it exists and
still behaves as the code below assumes. Where a public API does the same, it is named beside the
entry, and why it is not used.

Nothing outside this module names a private torch attribute (``tests/test_layering.py`` checks).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim import optimizer as _optimizer

# ---- CUDA streams and the caching allocator ------------------------------------------------------
# The raw cudaStream_t of a device's current stream, an int. Public: torch.cuda.current_stream(i)
# .cuda_stream, which builds a Stream object per call (~1 us against ~0.1 us): every launch asks.
# (absent from CPU-only torch builds, where no CUDA launch happens)
current_raw_stream: Callable[[int], int] = getattr(torch._C, "_cuda_getCurrentRawStream", None)
# The current CUDA device index. Public: torch.cuda.current_device(), which first initializes
# CUDA lazily through Python (~0.5 us against ~0.05 us).
current_device_index: Callable[[], int] = getattr(torch._C, "_cuda_getDevice", None)


def end_allocate_to_pool(device: int, pool: Any) -> None:
    """Stop routing the caching allocator to a graph's pool after a capture that failed half way
    (``CUDAGraph.capture_end`` raised before doing it). No public API: torch's own
    ``torch.cuda.graph`` context manager calls ``capture_end`` only."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None:
        end(device, pool)


# ---- autograd -------------------------------------------------------------------------------------
# Whether the running backward will execute a node (False under autograd.grad() for a leaf it does
# not ask for, or backward(inputs=...) that leaves it out). Public: none.
will_engine_execute_node: Callable[[Any], bool] = torch._C._will_engine_execute_node
# The C ``apply`` under torch.autograd.Function.apply (see trainfuse._runtime.function).
function_c_apply = torch._C._FunctionBase.__dict__["apply"]
# Whether a functorch transform (vmap, grad) is active. Public: none.
functorch_transforms_active: Callable[[], bool] = torch._C._are_functorch_transforms_active
# Whether the autograd profiler records: torch.optim's own step wrapper asks the same. Public:
# torch.profiler has no query for it.
profiler_enabled: Callable[[], bool] = torch.autograd._profiler_enabled

# ---- torch.amp.GradScaler -------------------------------------------------------------------------
# trainfuse.amp.GradScaler subclasses torch's and reads this state of its own (the scale and growth
# tracker tensors, the growth settings, the per-optimizer stage torch's step/unscale_/update keep):
# the names are pinned here, and tests/_runtime/test_compat.py checks each against torch.
GRAD_SCALER_STATE = ("_enabled", "_scale", "_growth_tracker", "_growth_factor", "_backoff_factor",
                     "_growth_interval", "_per_optimizer_states", "_check_scale_growth_tracker")


def scaler_optimizer_states(scaler: torch.amp.GradScaler) -> dict[int, dict[str, Any]]:
    """``id(optimizer)`` -> the stage torch's GradScaler keeps for it between ``unscale_``/``step``
    and ``update`` (cleared by ``update``; clearing it lets ``unscale_`` run again)."""
    return scaler._per_optimizer_states


# ---- nn.Module and Parameter hooks ------------------------------------------------------------------
# nn.Module keeps its hooks in these dicts; the public register_*_hook calls have no query.
_MODULE_HOOKS = {"forward": "_forward_hooks", "forward_pre": "_forward_pre_hooks",
                 "backward": "_backward_hooks", "backward_pre": "_backward_pre_hooks"}


def module_hooks(module: nn.Module, kinds: tuple[str, ...] = tuple(_MODULE_HOOKS)) -> list[str]:
    """The kinds of hook (``"forward"``, ``"forward_pre"``, ``"backward"``, ``"backward_pre"``)
    registered on ``module`` itself (not its children), in that order."""
    return [k for k in kinds if getattr(module, _MODULE_HOOKS[k], None)]


def tensor_grad_hooks(t: torch.Tensor) -> bool:
    """Whether a leaf tensor has hooks that see its grad (``register_hook``,
    ``register_post_accumulate_grad_hook``)."""
    return bool(t._backward_hooks or t._post_accumulate_grad_hooks)


def parameters_of(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module``'s own parameter dict: what ``module.weight`` reads through
    ``Module.__getattr__``, without its detour (hot forwards read it per call)."""
    return module._parameters


def compiled_original(module: nn.Module) -> nn.Module | None:
    """The module a ``torch.compile`` wrapper (OptimizedModule) holds, or None for any other."""
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else None


# the base class of BatchNorm and InstanceNorm layers (SyncBatchNorm, LazyBatchNorm included)
NormBase: type[nn.Module] = nn.modules.batchnorm._NormBase


# ---- matmul epilogues -----------------------------------------------------------------------------
# addmm with cuBLASLt's bias + ReLU (or GELU) epilogue in one kernel. Public: addmm then relu, two.
addmm_activation: Callable[..., torch.Tensor] = torch._addmm_activation

# ---- torch.optim.Optimizer ------------------------------------------------------------------------
# dtype of a CPU ``step`` counter in torch.optim's default (non-fused) layout.
scalar_dtype: Callable[[], torch.dtype] = _optimizer._get_scalar_dtype
# the global step hook dicts torch.optim.optimizer.register_optimizer_step_pre_hook/post_hook fill
global_step_pre_hooks: dict = _optimizer._global_optimizer_pre_hooks
global_step_post_hooks: dict = _optimizer._global_optimizer_post_hooks
# the method Optimizer.__init__ (and __setstate__) calls to wrap ``step`` in a profiler range and
# the hook walk, and to name zero_grad's range: a subclass that binds its own under this name keeps
# its step unwrapped. Public: none.
STEP_PATCH_METHOD = "_patch_step_function"
# the class attribute GradScaler.step reads: True, it sets ``grad_scale`` and ``found_inf`` on the
# optimizer and calls ``step()`` without unscaling the grads or checking them for inf/NaN first (as
# for torch's fused Adam). Public: none.
STEP_SUPPORTS_AMP_SCALING = "_step_supports_amp_scaling"
# torch.optim's names for the per-optimizer step hook dicts (register_step_pre_hook/post_hook)
_STEP_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")


def has_step_hooks(opt: torch.optim.Optimizer, *, global_too: bool = True) -> bool:
    """Whether ``opt.step`` has pre/post hooks (its own, and torch's global ones)."""
    own = any(getattr(opt, name, None) for name in _STEP_HOOKS)
    return own or (global_too and bool(global_step_pre_hooks or global_step_post_hooks))


def step_hooks(opt: torch.optim.Optimizer) -> tuple[list[Callable], list[Callable]]:
    """(pre hooks, post hooks) in the order torch.optim runs them around a step."""
    pre = [*global_step_pre_hooks.values(), *opt._optimizer_step_pre_hooks.values()]
    post = [*opt._optimizer_step_post_hooks.values(), *global_step_post_hooks.values()]
    return pre, post


def run_optimizer_step_code(opt: torch.optim.Optimizer) -> None:
    """Call ``Optimizer._optimizer_step_code``, the empty method torch's step wrapper calls after
    every step, inside the step's profiler range: the profiler's Python tracer hooks its code object
    to record the optimizer's params, groups and state after the step (memory timelines). A step
    that skips torch's wrapper calls this where the wrapper would. Public: none
    (``torch.profiler`` has no step hook of its own; the global step post hooks run beside it)."""
    opt._optimizer_step_code()


def set_zero_grad_profile_name(opt: torch.optim.Optimizer) -> None:
    """Name ``opt.zero_grad``'s profiler range as torch's ``_patch_step_function`` does
    (``"Optimizer.zero_grad#<class>.zero_grad"``, in ``_zero_grad_profile_name``): torch's
    ``zero_grad`` reads it, and calls ``_patch_step_function`` when it is missing. For a class
    that replaces that method (:data:`STEP_PATCH_METHOD`). Public: none."""
    opt._zero_grad_profile_name = f"Optimizer.zero_grad#{type(opt).__name__}.zero_grad"


def record_step_call(opt: torch.optim.Optimizer) -> None:
    """What torch.optim's step wrapper records for LR schedulers (``_opt_called``): a scheduler's
    first ``step`` warns when it was not set."""
    opt._opt_called = True


def mark_step_for_schedulers(opt: torch.optim.Optimizer, func: Callable[..., Any] | None = None) -> None:
    """Wrap ``opt.step`` as torch's LR schedulers wrap the optimizers they are built on (they warn
    on their first step when the optimizer's step lacks the mark); the same one-call wrapper. A step
    already marked stays as it is, unless ``func`` is given: ``opt.step`` then becomes that
    function (called as ``func(opt, *args, **kwargs)``), marked, in place of the class's step."""
    if func is None and hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    func = type(opt).step if func is None else func
    ref = weakref.ref(opt)

    @functools.wraps(func)
    def step(*args, **kwargs):
        this = ref()
        record_step_call(this)
        return func(this, *args, **kwargs)

    step._wrapped_by_lr_sched = True
    opt.step = step


def inner_schedulers(scheduler: Any) -> Iterator[Any]:
    """The schedulers a SequentialLR or ChainedScheduler drives (none for other schedulers)."""
    yield from getattr(scheduler, "_schedulers", ())


# ---- DTensor -------------------------------------------------------------------------------------


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, the very tensor the DTensor holds. Public:
    ``DTensor.to_local()``, which outside ``no_grad`` goes through an autograd function and, for a
    param, returns a fresh view per call (a few us a param, every step, for every param)."""
    return t._local_tensor


# ---- triton --------------------------------------------------------------------------------------


def triton_allocator_is_null() -> bool:
    """Whether this thread has no Triton allocator set (kernels that build tensor descriptors
    need one). No public query: ``triton.set_allocator`` only sets."""
    from triton.runtime import _allocation

    current = _allocation._allocator
    current = current.get() if hasattr(current, "get") else current
    return isinstance(current, _allocation.NullAllocator)


_JIT_FUNCTION: type | None = None


def jit_key_pending(value: Any) -> bool:
    """Whether ``value`` is a ``@triton.jit`` function whose cache key this process has not
    computed yet (``JITFunction.hash``, filled by its ``cache_key`` property). Cheap: launchers
    ask it on every launch."""
    global _JIT_FUNCTION
    if _JIT_FUNCTION is None:
        from triton.runtime.jit import JITFunction

        _JIT_FUNCTION = JITFunction
    return isinstance(value, _JIT_FUNCTION) and value.hash is None


def compiled_resources(kernel: Any) -> tuple[int, int] | None:
    """A compiled Triton kernel's registers per thread and shared memory bytes per program, its
    module loaded onto the current device first (``CompiledKernel._init_handles`` fills
    ``n_regs`` as it loads: no public call does); None where this Triton's compiled kernel has
    neither."""
    init = getattr(kernel, "_init_handles", None)
    if init is None:
        return None
    init()
    regs = getattr(kernel, "n_regs", None)
    shared = getattr(getattr(kernel, "metadata", None), "shared", None)
    return None if regs is None or shared is None else (int(regs), int(shared))


def unspecialized_args(fn: Any) -> frozenset[str]:
    """The names of ``@triton.jit`` function ``fn``'s arguments given in its ``do_not_specialize``
    (Triton keys such an int on its width alone). A compiled function lists them in ``params``;
    the interpreter's (``TRITON_INTERPRET=1``) only keeps the decorator's arguments."""
    params = getattr(fn, "params", None)
    if params is not None:
        return frozenset(p.name for p in params if p.do_not_specialize)
    given = getattr(fn, "kwargs", {}).get("do_not_specialize") or ()
    return frozenset(n for i, n in enumerate(fn.arg_names) if i in given or n in given)


__all__ = ["GRAD_SCALER_STATE", "NormBase", "STEP_PATCH_METHOD", "STEP_SUPPORTS_AMP_SCALING",
           "addmm_activation", "compiled_original", "compiled_resources", "current_device_index",
           "current_raw_stream", "end_allocate_to_pool", "function_c_apply", "functorch_transforms_active",
           "global_step_post_hooks", "global_step_pre_hooks", "has_step_hooks", "inner_schedulers",
           "jit_key_pending", "local_tensor", "mark_step_for_schedulers", "module_hooks", "parameters_of",
           "profiler_enabled", "record_step_call", "run_optimizer_step_code", "scalar_dtype",
           "scaler_optimizer_states", "set_zero_grad_profile_name", "step_hooks", "tensor_grad_hooks",
           "triton_allocator_is_null", "unspecialized_args", "will_engine_execute_node"]
