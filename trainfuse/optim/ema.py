r"""FusedEMA: ultralytics' ModelEMA with the update in one multi-tensor launch.

Keeps an exponential moving average of every floating-point param and buffer of a model:

.. math::
    d_k = \mathrm{decay}\,(1 - e^{-k/\tau}), \qquad
    \mathrm{ema} \leftarrow \mathrm{lerp}(\mathrm{ema}, \theta, 1 - d_k)

after update :math:`k` (``updates``), exactly as ``ultralytics.utils.torch_utils.ModelEMA`` does
with ``torch._foreach_lerp_`` (torch's two-sided lerp formula, switching at weight 0.5). The
update is one launch over all tensors; attached to a fused optimizer
(``optimizer.attach_ema(ema)``) it runs inside the optimizer's update kernel instead. The kernel
math is shared with that fold, so it lives in the engine: ``trainfuse/_multi_tensor/kernels.py``
(``lerp``, ``ema_chunk``, ``ema_fold``); the torch reference is
``torch._foreach_lerp_`` (the path CPU tensors take, and what the tests compare against).
"""

from __future__ import annotations

import math
import weakref
from copy import deepcopy

import torch
from torch import nn

from trainfuse._multi_tensor import kernels
from trainfuse._multi_tensor.tables import (
    DTYPE_CODES,
    OP_EMA,
    OP_PARAM,
    UPDATE_EMA_W_ARG,
    Plan,
    RowBuilder,
    TensorListPlans,
    code_of,
    is_dense,
    launch_update,
    same_layout,
)
from trainfuse._runtime import compat
from trainfuse._runtime.backend import use_triton
from trainfuse._runtime.launch import DirectLaunch
from trainfuse.optim.dtensors import is_dtensor, is_fully_sharded, local, locals_of, tensor_copy

_data_ptr = torch.Tensor.data_ptr


def _unwrap(model: nn.Module) -> nn.Module:
    """The module under DataParallel/DDP and torch.compile wrappers (ultralytics' unwrap_model)."""
    while True:
        if compat.compiled_original(model) is not None:
            model = compat.compiled_original(model)
        elif isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        else:
            return model


def copy_attr(a: object, b: object, include=(), exclude=()) -> None:
    """Copy ``b``'s public attributes to ``a`` (only ``include`` if given, never ``exclude``)."""
    for k, v in b.__dict__.items():
        if (len(include) and k not in include) or k.startswith("_") or k in exclude:
            continue
        setattr(a, k, v)


class DecayRamp:
    """``decay * (1 - exp(-updates / tau))``, ModelEMA's decay ramp, as a picklable callable."""

    def __init__(self, decay: float, tau: float) -> None:
        self.decay, self.tau = decay, tau

    def __call__(self, updates: float) -> float:
        return self.decay * (1 - math.exp(-updates / self.tau))


def match_layout(ema: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``ema`` with ``src``'s memory layout: where the two differ (say the model went
    channels_last after the EMA was made), ``ema``'s data is copied into ``src``'s layout in place
    of the old, keeping its values and dtype. The fused kernels pair element k of each tensor's
    memory, so the two must agree."""
    if ema.shape == src.shape and is_dense(src) and not (is_dense(ema) and same_layout(ema, src)):
        relaid = torch.empty_like(src, dtype=ema.dtype, device=ema.device)
        with torch.no_grad():
            relaid.copy_(ema)
        ema.data = relaid
    return ema


class FusedEMA:
    """Drop-in ``ultralytics.utils.torch_utils.ModelEMA``: same constructor, attributes (``ema``,
    ``updates``, ``decay``, ``enabled``) and methods.

    Args:
        model: the model to average (DataParallel/DDP/compiled wrappers are unwrapped).
        decay: the decay the ramp approaches.
        tau: time constant of the ramp ``decay * (1 - exp(-updates / tau))``.
        updates: updates already done (resuming).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        >>> ema = FusedEMA(model)
        >>> ema.update(model)
        >>> ema.updates
        1
    """

    def __init__(self, model: nn.Module, decay: float = 0.9999, tau: float = 2000, updates: int = 0):
        model = _unwrap(model)
        # FSDP2 modules refuse deepcopy: their EMA keeps the sharded tensors, under the same keys
        self.ema = (tensor_copy(model) if is_fully_sharded(model) else deepcopy(model)).eval()
        if hasattr(self.ema, "teacher_model"):  # as ultralytics: no duplicate of a distillation teacher
            self.ema.teacher_model = None
        self.updates = updates
        self.decay = DecayRamp(decay, tau)
        for p in self.ema.parameters():
            p.requires_grad_(False)
        self.enabled = True
        self.attached = None  # the fused optimizer whose step folds this EMA in, if any
        self._plans = TensorListPlans()
        self._model = weakref.ref(model)
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._dtensors = False  # whether a paired tensor is a DTensor (set with the pairs)
        self._last = None  # (addresses, plan) of the last single-device launch

    def _ensure_pairs(self, model: nn.Module | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(ema tensor, model tensor) for every floating-point entry of the state_dicts, paired as
        ModelEMA pairs them on its first update (so a ``model.to()`` before it is followed).
        keep_vars holds the Parameters themselves, so a param whose ``.data`` is replaced
        (fuse_casts) is followed too; a tensor tied under two names is averaged once."""
        if self._pairs is None:
            model = _unwrap(model) if model is not None else self._model()
            if model is None:
                raise RuntimeError("FusedEMA: the model it was built from no longer exists")
            msd = model.state_dict(keep_vars=True)
            pairs, seen = [], set()
            for k, v in self.ema.state_dict(keep_vars=True).items():
                if v.dtype.is_floating_point and id(v) not in seen:
                    seen.add(id(v))
                    pairs.append((v, msd[k]))
            self._pairs = pairs
            self._flat = [t for pair in pairs for t in pair]
            self._dtensors = any(map(is_dtensor, self._flat))
            self._by_src = {id(src): e for e, src in pairs}
        return self._pairs

    def __getstate__(self):
        # the pairs travel (a copy of an optimizer with this EMA attached pairs the copied
        # params); tables, the weak model reference and the id-keyed index do not
        state = self.__dict__.copy()
        state["_plans"] = state["_model"] = state["_last"] = None
        state.pop("_by_src", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.__dict__.setdefault("_dtensors", False)
        self._plans = TensorListPlans()
        self._model = lambda: None
        if self._pairs is not None:
            self._by_src = {id(src): e for e, src in self._pairs}

    def update(self, model: nn.Module) -> None:
        """One EMA update toward ``model`` (a no-op while attached to an optimizer, whose step
        already did it)."""
        if not self.enabled or self.attached is not None:
            return
        self.updates += 1
        w = 1.0 - self.decay(self.updates)
        if model is not self._model():  # a wrapper of it, or another model (or a copy of this EMA)
            model = _unwrap(model)
            if self._model() is not model:  # another model: pair with it
                self._pairs, self._last, self._model = None, None, weakref.ref(model)
        if self._last is not None:  # the hot path: one device, tensors where the plan has them
            key, plan, direct, device = self._last
            if self._addresses() == key and use_triton(device):
                if direct is not None and self._plans.launcher.direct():
                    direct(w)  # the last launch again, arguments resolved: a few us less host time
                else:
                    launch_update(self._plans.launcher, kernels.ema_chunk, plan, ema_w=w)
                return
        self._ensure_pairs(model)
        self._last = None
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for e, src in self._pairs:
            by_device.setdefault(e.device, []).append((e, src))
        with torch.no_grad():
            for device, pairs in by_device.items():
                if self._kernel_ok(device, pairs):
                    self._plans.launcher.last = None
                    # DTensors (FSDP2): the kernel averages each rank's shards
                    plan = self._launch(device, [(local(e), local(src)) for e, src in pairs], w)
                    if len(by_device) == 1:
                        last = self._plans.launcher.last  # arguments: the plan's own buffers and w
                        direct = None if last is None else DirectLaunch(last, plan.nchunks, device.index,
                                                                        var=UPDATE_EMA_W_ARG)
                        self._last = (self._addresses(), plan, direct, device)
                else:
                    torch._foreach_lerp_([e for e, _ in pairs], [s.to(e.dtype) for e, s in pairs], w)

    def update_attr(self, model: nn.Module, include=(), exclude=()) -> None:
        """Copy ``model``'s public attributes to the EMA model (ModelEMA.update_attr)."""
        if self.enabled:
            copy_attr(self.ema, _unwrap(model), include, exclude)

    def _addresses(self) -> list[int]:
        """Where the paired tensors are now (their local shards, for DTensors)."""
        return list(map(_data_ptr, locals_of(self._flat) if self._dtensors else self._flat))

    # ---- the fused path ----------------------------------------------------------------------
    def _kernel_ok(self, device: torch.device, pairs) -> bool:
        if not use_triton(device):
            return False
        for e, src in pairs:
            if src.device != device or src.shape != e.shape or src.dtype not in DTYPE_CODES:
                return False
            if e.dtype not in (torch.float32, src.dtype):
                return False
        for e, src in pairs:
            match_layout(e, src)
        return True

    def _launch(self, device, pairs, w: float) -> Plan:
        flat = [t for pair in pairs for t in pair]
        # the plan is a function of these alone (pairs share a layout: _kernel_ok matched them)
        key = (device, *((t.data_ptr(), t.numel(), t.dtype) for t in flat))

        def build():
            for t in flat:
                if not is_dense(t):
                    raise ValueError(f"FusedEMA: a tensor of shape {tuple(t.shape)} has gaps in memory")
            builder = RowBuilder()
            for e, src in pairs:
                builder.add({OP_PARAM: src, OP_EMA: e}, src.numel(), code_of(src.dtype, ema=e, ema_only=True))
            return builder.build(device)

        plan = self._plans.get(key, build)
        launch_update(self._plans.launcher, kernels.ema_chunk, plan, ema_w=w)
        return plan

    # ---- what an optimizer with this EMA attached reads --------------------------------------
    def target_of(self, p: torch.Tensor) -> torch.Tensor | None:
        """The EMA tensor that follows ``p`` (laid out like ``p``), or None."""
        self._ensure_pairs()
        e = self._by_src.get(id(p))
        return None if e is None else match_layout(e, p)

    def pairs_on(self, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(ema tensor, model tensor)`` pairs on ``device``, each EMA tensor laid out like its
        model tensor."""
        return [(match_layout(e, src), src) for e, src in self._ensure_pairs() if e.device == device]

    def tensors(self) -> list[torch.Tensor]:
        """Every EMA tensor and model tensor, flat; the same list object until the pairs change,
        so a caller can tell by identity that they did not."""
        self._ensure_pairs()
        return self._flat

