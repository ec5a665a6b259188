"""The fused optimizers and the stock optimizers they stand in for: one line each.

Everything that needs the list reads it here: ``trainfuse.optim``'s and ``trainfuse``'s exports,
the clients that swap a user's optimizer for its fused counterpart (Lightning, ultralytics), the
tests that check each fused optimizer against its stock one, and ``python -m trainfuse.bench
optim``. Adding an optimizer is its file in this package plus one :class:`Counterpart` line below.

Both sides are named by import path, so a stock optimizer from an optional package (ultralytics)
costs nothing until it is asked for, and this module imports no optimizer file until a name is
resolved.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Mapping
from typing import Any


def _load(path: str) -> Any:
    """``"package.module:Name"`` -> the object, or None when the package is not installed."""
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):  # no such package, or a version without the class
        return None


@dataclasses.dataclass(frozen=True)
class Counterpart:
    """One fused optimizer and the stock optimizer it replaces.

    Attributes:
        stock: the stock class, ``"module:Name"`` (its arguments, defaults and state_dict layout
            are the fused class's contract).
        fused: the fused class, ``"trainfuse.optim.<file>:Name"``.
        examples: hyperparameter -> values the tests draw from (every combination the stock
            constructor accepts is a valid draw); the first value of each is the benchmark's.
        attributes: constructor arguments the stock class keeps as attributes of the optimizer
            rather than in ``defaults`` (MuSGD's ``muon`` and ``sgd``): a swap carries them over.
        matrices: the optimizer takes 2-dim params only (Muon): the tests and benchmarks that give
            every optimizer vectors too leave it to its own.
    """

    stock: str
    fused: str
    examples: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    attributes: tuple[str, ...] = ()
    matrices: bool = False

    @property
    def name(self) -> str:
        """The fused class's name, ``"FusedAdamW"``."""
        return self.fused.partition(":")[2]

    @property
    def stock_name(self) -> str:
        """The stock class's name, ``"AdamW"``."""
        return self.stock.partition(":")[2]

    @functools.cached_property
    def fused_class(self) -> type:
        cls = _load(self.fused)
        if cls is None:
            raise ImportError(f"trainfuse.optim.registry: cannot import {self.fused}")
        return cls

    @functools.cached_property
    def stock_class(self) -> type | None:
        """The stock class, or None when its package is not installed."""
        return _load(self.stock)

    def bench_hparams(self) -> dict[str, Any]:
        """The first example value of every hyperparameter."""
        return {k: v[0] for k, v in self.examples.items()}


# the values the tests draw from; the first of each is the benchmark's setting
_ADAM = dict(lr=(1e-3, 3e-2), weight_decay=(0.01, 0.0, 0.3), betas=((0.9, 0.999), (0.3, 0.9), (0.0, 0.999)),
             eps=(1e-8, 1e-3), amsgrad=(False, True), maximize=(False, True))
_SGD = dict(lr=(1e-2, 1e-3, 0.05), momentum=(0.937, 0.0, 0.5), nesterov=(True, False),
            weight_decay=(5e-4, 0.0, 0.1), dampening=(0.0, 0.3), maximize=(False, True))
# MuSGD's Muon part needs use_muon groups of matrices: its own tests build those (test_musgd.py)
_MUSGD = dict(lr=(1e-2, 1e-3), momentum=(0.9, 0.937, 0.0), nesterov=(True, False),
              weight_decay=(5e-4, 0.0, 0.1), use_muon=(False,), muon=(0.2, 0.5), sgd=(1.0, 0.5))
_MUON = dict(lr=(0.02, 1e-3), weight_decay=(0.1, 0.0), momentum=(0.95, 0.9), nesterov=(True, False),
             ns_steps=(5, 3), adjust_lr_fn=(None, "original", "match_rms_adamw", "spectral_unclamped"))

COUNTERPARTS: tuple[Counterpart, ...] = (
    Counterpart("torch.optim:AdamW", "trainfuse.optim.adam:FusedAdamW", _ADAM),
    Counterpart("torch.optim:Adam", "trainfuse.optim.adam:FusedAdam", _ADAM),
    Counterpart("torch.optim:SGD", "trainfuse.optim.sgd:FusedSGD", _SGD),
    Counterpart("ultralytics.optim:MuSGD", "trainfuse.optim.musgd:FusedMuSGD", _MUSGD, ("muon", "sgd")),
    Counterpart("torch.optim:Muon", "trainfuse.optim.muon:FusedMuon", _MUON, matrices=True),
)


def fused_classes() -> dict[str, type]:
    """Fused class name -> class, in registry order."""
    return {c.name: c.fused_class for c in COUNTERPARTS}


def counterpart_of(optimizer_class: type) -> Counterpart | None:
    """The entry whose stock class is exactly ``optimizer_class`` (a subclass is a user's own
    optimizer, with a step of its own: it has no counterpart), or None."""
    for c in COUNTERPARTS:
        if c.stock_class is optimizer_class:
            return c
    return None


def by_fused(fused_class: type) -> Counterpart:
    """The entry of a fused class."""
    for c in COUNTERPARTS:
        if c.fused_class is fused_class:
            return c
    raise KeyError(f"{fused_class.__name__} is not in trainfuse.optim.registry.COUNTERPARTS")


__all__ = ["COUNTERPARTS", "Counterpart", "by_fused", "counterpart_of", "fused_classes"]
