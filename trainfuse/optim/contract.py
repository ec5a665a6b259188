"""What the step driver needs of the optimizer it steps, as a type: :class:`OptimizerClient`.

:class:`trainfuse.optim.engine.MultiTensorEngine` and its collaborators (the plan cache, the plan
builder, the torch path, the hyperparameter tables, the sharded statistics) read an optimizer
through these members and no others; :class:`trainfuse.optim._base.FusedOptimizer` provides
them all (``tests/optim/test_contract.py`` checks both). A subclass of ``FusedOptimizer`` adds an
update rule through its own hooks (``state_keys``, ``init_state``, ``step_tensor``,
``validate_group``, ``hparams_row``, ``torch_group_step``, ``chunk_fn``, ``wide16``), which
``FusedOptimizer`` turns into the members below.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from trainfuse.optim.tracked import StateDict


@runtime_checkable
class OptimizerClient(Protocol):
    """The optimizer a :class:`~trainfuse.optim.engine.MultiTensorEngine` steps.

    Attributes:
        param_groups: torch.optim's param groups; each ``group["params"]`` a
            :class:`~trainfuse.optim.tracked.ParamList`.
        state: torch.optim's per-param state, a :class:`~trainfuse.optim.tracked.StateDict`.
        chunk_fn: the ``@triton.jit`` update of one row's chunk (the contract in
            ``trainfuse._multi_tensor.kernels.run``).
        wide16: whether 16-bit rows take blocks twice as long.
        HP_WIDTH: the width of one group's row in the hyperparameter table.
        max_grad_norm: clip the unscaled grads to this global 2-norm in the step, or None.
        max_grad_value: clamp the unscaled grads to ``[-v, v]`` in the step, or None.
        ema_weight: the lerp weight of the attached EMA for this step, or None (no EMA update).
        shard_group: the process group whose ranks hold the other shards of the grads, or None.
        graph_safe: the launches read the EMA weight from device memory (the engine's
            ``write_ema_weight``) instead of taking it as an argument. Read only: the optimizer's
            ``set_graph_safe`` changes it, where its class declares ``capturable``.
    """

    param_groups: list[dict[str, Any]]
    state: StateDict
    chunk_fn: Any
    wide16: bool
    HP_WIDTH: int
    max_grad_norm: float | None
    max_grad_value: float | None
    ema_weight: float | None
    shard_group: Any
    graph_safe: bool

    def track_mutations(self) -> None:
        """Make ``state`` and every group's ``params`` the counting containers of
        :mod:`trainfuse.optim.tracked` (the plan cache's structure check reads their counters)."""

    def plan_key(self, group: dict[str, Any]) -> tuple:
        """What of ``group`` shapes a plan besides addresses (which states a param carries,
        float32 masters): a change drops the plans."""

    def prepare_state(self, p: torch.Tensor, group: dict[str, Any], kernels: bool
                      ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
        """``(states in operand order, step counter, float32 master or None)`` of ``p``, created
        on first use and laid out like ``p`` (``kernels``: for the kernels' layout)."""

    def master_of(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor | None:
        """The float32 master of a 16-bit ``p``, or None."""

    def hparams_row(self, group: dict[str, Any]) -> list[float | torch.Tensor]:
        """``group``'s row of the hyperparameter table (at most ``HP_WIDTH`` values)."""

    def check_hparams(self) -> None:
        """Raise a ValueError naming the hyperparameter when a group's is invalid."""

    def check_clipping(self) -> None:
        """Raise a ValueError naming the argument when ``max_grad_norm``/``max_grad_value`` are
        invalid together or alone."""

    def clip_value_on(self, device: torch.device) -> torch.Tensor:
        """``max_grad_value`` as a 1-element float32 tensor on ``device``."""

    def ema_target(self, p: torch.Tensor) -> torch.Tensor | None:
        """The attached EMA's tensor that follows ``p``, laid out like it, or None."""

    def ema_pairs(self, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(EMA tensor, model tensor)`` pairs of the attached EMA on ``device``."""

    def ema_tensors(self) -> list[torch.Tensor] | None:
        """Every EMA tensor and model tensor of the attached EMA, flat (the same list object
        until the pairs change), or None without an EMA."""

    def torch_group_step(self, group: dict[str, Any], params: list[torch.Tensor],
                         grads: list[torch.Tensor], weights: list[torch.Tensor]) -> None:
        """torch.optim's update of ``params``' states, applied to ``weights`` (the params or
        their float32 masters)."""


__all__ = ["OptimizerClient"]
