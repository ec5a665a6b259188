"""FusedTraining(cuda_graphs=True): the model's forward and backward replayed from CUDA graphs.

Lightning runs ``training_step`` (the user's Python: the loss, ``self.log``, counters), then
``zero_grad``, ``backward`` and the optimizer step, with hooks between them. Capturing that whole
closure would replay none of the user's Python after the first step. So the callback graphs the
modules ``training_step`` calls, each as a :class:`~trainfuse.graphs.GraphedModule` (forward and
backward from CUDA graphs per input shape, the code around them eager):

- the LightningModule itself when it defines ``forward`` (``training_step`` calls ``self(x)``);
- each direct child module with trainable params that has a ``forward`` of its own (not a
  ModuleList or ModuleDict), for steps that call ``self.body(x)`` and ``self.head(h)`` directly.
  A child called inside a graphed forward is part of that forward's graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainfuse._runtime import compat
from trainfuse.graphs import BackwardSync, GraphedModule, GraphPool
from trainfuse.lightning import _compat


def _compiled(module: nn.Module) -> bool:
    return compat.compiled_original(module) is not None  # torch.compile's OptimizedModule


def graph_targets(pl_module: Any) -> list[tuple[str, nn.Module]]:
    """The modules to graph, by name (``"forward"`` for the LightningModule itself), in order."""
    targets = []
    if _compat.is_overridden("forward", pl_module) and not _compiled(pl_module):
        targets.append(("forward", pl_module))
    for name, child in pl_module.named_children():
        if type(child).forward is nn.Module.forward or _compiled(child):
            continue  # a container (ModuleList, ModuleDict), or compiled: torch.compile has its own graphs
        if any(p.requires_grad for p in child.parameters()):
            targets.append((name, child))
    return targets


def install(targets: list[tuple[str, nn.Module]],
            grads: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
            sync: BackwardSync | None = None) -> dict[str, GraphedModule]:
    """Put a GraphedModule in place of each target's forward, all with one memory pool (they run
    on the step's stream, one after another); ``grads``: the kept grads the caller owns, ``sync``:
    its gradient sync (see :class:`~trainfuse.graphs.GraphedModule`)."""
    pool = GraphPool()
    return {name: GraphedModule.install(module, name=name, pool=pool, grads=grads, sync=sync)
            for name, module in targets}


def uninstall(graphed: dict[str, GraphedModule]) -> None:
    """Give every module its forward back and free the graphs."""
    for g in graphed.values():
        g.uninstall()


__all__ = ["graph_targets", "install", "uninstall"]
