"""A scaled step's two launches replayed with their arguments resolved once.

``GradScaler.step_and_update`` on a fused optimizer is two launches (statistics with the scale
update, then the update) that repeat step after step with the same tables, the same scaler
tensors and the same kernels; only the EMA weight changes. After one step has gone the normal way
(``launch_stats`` and ``launch_update`` keying their kernels), :class:`DirectStep` keeps the two
compiled kernels and their argument lists, with the engine's own buffers (tables, partials,
statistics output, hyperparameter table) as raw addresses: the next steps launch them straight
away, saving the keying and, per pointer, the launcher's ``data_ptr`` call and driver lookup
(yolov5n's update launch on an H200 host, tight loop: 7.5 us with addresses, 10.3 with tensors).

What a launch's arguments depend on besides the plan is the entry's ``key``: the scaler's scale
and tracker tensors (by identity; passed as tensors, so their addresses are read each launch),
its growth and backoff factors and interval, the clipping settings, the hyperparameter table's
identity and the plan's kernel key (``plan.kernel_key``: buffer and grad alignment, launch shape).
The engine compares it each step and falls back to the normal launches on any difference. An
entry lives on its plan's cache entry (``CachedPlan.direct``, :mod:`trainfuse.optim.plans`), so
it is dropped with the tables it points at.
"""

from __future__ import annotations

import torch

from trainfuse._multi_tensor.tables import UPDATE_EMA_W_ARG
from trainfuse._runtime.launch import Compiled, DirectLaunch
from trainfuse.optim.contract import OptimizerClient


class DirectStep:
    """The statistics and update launches of one plan's scaled step, ready to go again: ``stats``
    and ``update`` are the launcher's ``(compiled kernel, args)`` of a step just launched with
    GradScaler tensors ``scale`` and ``tracker`` (kept as tensors) and the engine's ``hp`` and
    ``out`` (kept alive with the entry, as the ids in ``key`` require)."""

    __slots__ = ("key", "refs", "stats", "update")

    def __init__(self, key: tuple, scale: torch.Tensor, tracker: torch.Tensor, hp: torch.Tensor,
                 out: torch.Tensor, index: int, stats: tuple[Compiled, tuple], stats_grid: int,
                 update: tuple[Compiled, tuple], update_grid: int) -> None:
        self.key, self.refs = key, (scale, tracker, hp, out)
        self.stats = DirectLaunch(stats, stats_grid, index, keep=(scale, tracker))
        self.update = DirectLaunch(update, update_grid, index, var=UPDATE_EMA_W_ARG, keep=(scale, tracker))

    def launch(self, ema_w: float) -> None:
        """Both launches on the current stream, the update with EMA weight ``ema_w``."""
        self.stats()
        self.update(ema_w)


def step_key(client: OptimizerClient, scale: torch.Tensor, update: tuple, hp: torch.Tensor,
             kernel_key: tuple | None, out: torch.Tensor | None) -> tuple:
    """What a scaled step's launch arguments depend on besides its plan's tables: equal keys,
    equal launches (tensors by identity: an entry keeps the ones its key names alive)."""
    return (id(scale), id(update[0]), *update[1:], client.max_grad_norm, client.max_grad_value,
            client.wide16, id(hp), kernel_key, id(out))


__all__ = ["DirectStep", "step_key"]
