"""The EMA FusedTraining keeps: a FusedEMA over the LightningModule's floating-point params and
buffers, with Lightning's EMAWeightAveraging semantics.

EMAWeightAveraging (``AveragedModel`` with ``get_ema_avg_fn(decay)``, buffers included) copies the
weights on its first update and then moves ``ema <- decay * ema + (1 - decay) * w`` after every
optimizer step. The same decay schedule drives the FusedEMA here (0 on update 1, ``decay`` after),
so the two differ only by rounding (lerp against multiply-add). A step GradScaler skips still moves
the EMA toward the unchanged weights in both (the fused kernel folds the EMA on skipped steps too).
The FusedEMA is built over a holder module whose entries are the LightningModule's own tensors: no
copy of the module object (its Trainer, datasets, metrics), only of its tensors.

Also as EMAWeightAveraging: validation inside the fit runs on the average, the module holds it
after the fit, and checkpoints save it as their ``state_dict`` (see
:mod:`trainfuse.lightning.checkpoint`).
"""

from __future__ import annotations

import torch
from torch import nn

from trainfuse.optim import FusedEMA

_SEP = "/"  # module names may not contain ".": state_dict keys are stored with "/" instead


class _Tensors(nn.Module):
    """The floating-point entries of a module's state_dict, the same tensor objects, flat."""

    def __init__(self, module: nn.Module):
        super().__init__()
        for key, t in module.state_dict(keep_vars=True).items():
            if not t.is_floating_point():
                continue
            if isinstance(t, nn.Parameter):
                self.register_parameter(key.replace(".", _SEP), t)
            else:
                self.register_buffer(key.replace(".", _SEP), t)


class WeightEMA:
    """An EMA of ``module``'s float params and buffers with EMAWeightAveraging's schedule.

    Args:
        module: the LightningModule (its params still float32: build this before casting them).
        decay: the EMA decay, in (0, 1).
    """

    def __init__(self, module: nn.Module, decay: float):
        self.decay = decay
        self.holder = _Tensors(module)
        self.fused = FusedEMA(self.holder, decay=decay)
        # EMAWeightAveraging's schedule: update 1 copies the weights, every later one uses decay
        self.fused.decay = lambda k: 0.0 if k <= 1 else decay
        ema = self.fused.ema.state_dict(keep_vars=True)
        src = self.holder.state_dict(keep_vars=True)
        # tied tensors (a head sharing the embedding's weight) are one tensor under several keys:
        # averaged once, swapped and saved under every key, so that no alias keeps another value
        tied: dict[int, tuple[list[str], torch.Tensor, torch.Tensor]] = {}
        for k, e in ema.items():
            tied.setdefault(id(e), ([], e, src[k]))[0].append(k.replace(_SEP, "."))
        # (every state_dict key of the tensor, its average, the module's tensor)
        self.pairs: list[tuple[tuple[str, ...], torch.Tensor, torch.Tensor]] = [
            (tuple(keys), e, w) for keys, e, w in tied.values()]
        self._saved: list[torch.Tensor] | None = None

    @property
    def updates(self) -> int:
        """EMA updates done (optimizer steps since the start, skipped ones included)."""
        return self.fused.updates

    def update(self) -> None:
        """One update toward the current weights (a no-op while attached to an optimizer)."""
        self.fused.update(self.holder)

    # ---- evaluation on the averaged weights ---------------------------------------------------
    def _current(self, module: nn.Module) -> list[torch.Tensor]:
        """``module``'s tensors under the averaged keys, looked up now: moving a module between
        devices or dtypes (Lightning's teardown ``.cpu()``, the ``.to(device)`` of a later
        validate/test) keeps its Parameter objects but replaces its buffers, so the tensors
        paired at fit start may no longer be the module's."""
        current = module.state_dict(keep_vars=True)
        missing = [k for keys, _, _ in self.pairs for k in keys if k not in current]
        if missing:
            raise KeyError(f"FusedTraining: the module has no {missing[0]} (and {len(missing) - 1} more "
                           "averaged entries): the EMA was made for another model")
        return [current[keys[0]] for keys, _, _ in self.pairs]

    @torch.no_grad()
    def swap_in(self, module: nn.Module) -> bool:
        """Put the EMA values into ``module``'s tensors, keeping the live ones aside. Nothing
        happens before the first update (there is no average yet). Returns whether it swapped."""
        if self._saved is not None or self.updates == 0:
            return False
        tensors = self._current(module)
        self._saved = [w.detach().clone() for w in tensors]
        for (_, e, _), w in zip(self.pairs, tensors):
            w.copy_(e)
        return True

    @torch.no_grad()
    def swap_out(self, module: nn.Module) -> None:
        """Put the live values back into ``module``'s tensors (after :meth:`swap_in`)."""
        if self._saved is None:
            return
        for w, saved in zip(self._current(module), self._saved):
            w.copy_(saved)
        self._saved = None

    def live_values(self) -> dict[str, torch.Tensor]:
        """While the EMA is swapped in: state_dict key -> the live value it displaced (else empty)."""
        if self._saved is None:
            return {}
        return {k: saved for (keys, _, _), saved in zip(self.pairs, self._saved) for k in keys}

    @torch.no_grad()
    def copy_to(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Put the EMA values into ``module``'s tensors for good, as EMAWeightAveraging does when
        training ends (nothing before the first update). Returns state_dict key -> the live value
        each one displaced (copies)."""
        if self.updates == 0:
            return {}
        displaced = {}
        for (keys, e, _), w in zip(self.pairs, self._current(module)):
            displaced.update(dict.fromkeys(keys, w.detach().clone()))
            w.copy_(e)
        return displaced

    # ---- checkpoint ----------------------------------------------------------------------------
    def values(self) -> dict[str, torch.Tensor]:
        """The averaged tensors under the module's own state_dict keys, each alias of a tied tensor
        included (copies, float32; one copy per tensor, shared by its keys as in ``state_dict()``)."""
        values = {}
        for keys, e, _ in self.pairs:
            values.update(dict.fromkeys(keys, e.detach().clone()))
        return values

    @torch.no_grad()
    def load(self, values: dict[str, torch.Tensor], updates: int) -> None:
        """Continue from a saved average: ``values`` under the module's state_dict keys (a
        checkpoint's ``state_dict`` in EMAWeightAveraging's layout), after ``updates`` updates. A
        tied tensor takes the value of its last key, as ``load_state_dict`` gives the module."""
        missing = [k for keys, _, _ in self.pairs for k in keys if k not in values]
        if missing:
            raise KeyError(f"FusedTraining: the checkpoint's average lacks {missing[0]} (and "
                           f"{len(missing) - 1} more): it was saved from another model")
        for keys, e, _ in self.pairs:
            e.copy_(values[keys[-1]])
        self.fused.updates = int(updates)


__all__ = ["WeightEMA"]
