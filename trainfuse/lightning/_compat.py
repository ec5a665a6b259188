"""The Lightning packages this process has: ``lightning.pytorch`` and/or ``pytorch_lightning``.

Both ship their own ``Callback``, ``LightningModule`` and strategy classes, and a Trainer of one
package refuses a callback of the other ("Expected a parent", Lightning #17485). FusedTraining
derives from every ``Callback`` class found here, so either Trainer accepts it, and everything
below looks classes up in the package the running Trainer comes from.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def _load(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def installed() -> list[ModuleType]:
    """The Lightning packages that import here, ``lightning.pytorch`` first."""
    return [m for m in map(_load, PACKAGES) if m is not None]


def callback_bases() -> tuple[type, ...]:
    """Every installed package's ``Callback`` class (FusedTraining's bases)."""
    bases = tuple(m.Callback for m in installed())
    if not bases:
        raise ImportError("trainfuse.lightning needs lightning (lightning.pytorch) or pytorch_lightning")
    return bases


def package_of(obj: Any) -> ModuleType:
    """The Lightning package a Trainer, module or strategy object comes from."""
    root = type(obj).__module__
    for m in installed():
        if root == m.__name__ or root.startswith(m.__name__ + "."):
            return m
    # a user subclass lives in the user's module: find the package by its base classes
    for m in installed():
        if isinstance(obj, (m.Trainer, m.LightningModule)):
            return m
        strategies = _load(m.__name__ + ".strategies")
        if strategies is not None and isinstance(obj, strategies.Strategy):
            return m
    raise TypeError(f"FusedTraining: {type(obj).__name__} is not from lightning.pytorch or pytorch_lightning")


def is_overridden(method: str, module: Any) -> bool:
    """Whether the LightningModule ``module`` overrides ``method`` of its package's base class."""
    base = package_of(module).LightningModule
    return getattr(type(module), method, None) is not getattr(base, method, None)


def compiled_by_trainer(module: Any) -> bool:
    """Whether the Trainer runs the LightningModule ``module``'s forward and steps through
    torch.compile: the fit was given ``torch.compile(module)``, which Lightning unwraps (its
    ``from_compiled``), keeping the compile context in the module's private ``_compiler_ctx``
    while the compiled forward and steps are in place."""
    return getattr(module, "_compiler_ctx", None) is not None


def weight_averaging_callbacks(callbacks: list[Any]) -> list[Any]:
    """The callbacks that are Lightning WeightAveraging (EMAWeightAveraging included), either package."""
    classes = []
    for m in installed():
        wa = getattr(_load(m.__name__ + ".callbacks"), "WeightAveraging", None)
        if wa is not None:
            classes.append(wa)
    return [cb for cb in callbacks if classes and isinstance(cb, tuple(classes))]


def rank_zero_info(trainer: Any, message: str) -> None:
    """Log ``message`` at info level on global rank zero through Lightning's ``rank_zero_info`` (of
    the Trainer's package; both packages log it through the one logger of lightning_utilities,
    which Lightning sets up to print)."""
    importlib.import_module(package_of(trainer).__name__ + ".utilities.rank_zero").rank_zero_info(message)


def strategy_kind(strategy: Any) -> str:
    """``"single"``, ``"ddp"``, ``"fsdp"`` (FSDPStrategy), ``"fsdp2"`` (ModelParallelStrategy), or
    the strategy's class name where FusedTraining does not act (DeepSpeed, XLA and others)."""
    pkg = package_of(strategy)
    s = importlib.import_module(pkg.__name__ + ".strategies")
    refused = tuple(getattr(s, n) for n in ("DeepSpeedStrategy", "XLAStrategy", "SingleDeviceXLAStrategy")
                    if hasattr(s, n))
    if isinstance(strategy, refused):
        return type(strategy).__name__
    if hasattr(s, "ModelParallelStrategy") and isinstance(strategy, s.ModelParallelStrategy):
        return "fsdp2"
    if hasattr(s, "FSDPStrategy") and isinstance(strategy, s.FSDPStrategy):
        return "fsdp"
    if isinstance(strategy, s.SingleDeviceStrategy):
        return "single"
    if isinstance(strategy, s.DDPStrategy):
        return "ddp"
    return type(strategy).__name__


def after_closure(plugin: Any, model: Any, optimizer: Any) -> None:
    """What a precision plugin's ``optimizer_step`` runs between the closure and the optimizer's
    step: the ``on_before_optimizer_step`` hooks of the callbacks and the module, then the
    plugin's gradient clipping (Lightning's private ``Precision._after_closure``)."""
    plugin._after_closure(model, optimizer)


__all__ = ["PACKAGES", "after_closure", "callback_bases", "compiled_by_trainer", "installed", "is_overridden",
           "package_of", "rank_zero_info", "strategy_kind", "weight_averaging_callbacks"]
