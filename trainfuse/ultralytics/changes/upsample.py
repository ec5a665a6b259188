"""The neck's nearest upsamplings in 16 bits under AMP on CUDA (:mod:`trainfuse.nn.upsample`), with
``fuse_blocks=True`` (off by default until measured on a GPU); their own forward back at the end.

Autocast runs ``nn.Upsample`` in float32; the ``Concat`` after it then copies in float32 and the
convolutions that read it cast back (about 2 ms of yolo11m's 24 ms step on an H200, forward and
backward). An upsampling is changed only where the numbers stay stock's bit for bit: one layer
reads it, a ``Concat``, and one layer reads that, a block whose forward casts its input to float16
in one convolution before anything else reads it (``Conv``, the ``C2f`` family: C3k2 and the
like). Where two convolutions read it (the ``C3`` family's ``cv1`` and ``cv2``), stock adds their
grads in float32 and the backward would add them in float16, a rounding apart; that upsampling,
and any other, stays as it is.

Where that ``Concat`` joins the upsampled map with one other (the necks of YOLOv8, 11 and 26), the
upsampling and the concatenation run as one op each way (:mod:`trainfuse.nn.upsample_concat`): the
``Upsample`` hands its input on as it is and the ``Concat`` upsamples it into its output, the same
numbers again.
"""

from __future__ import annotations

import torch
from torch import nn
from typing_extensions import override
from ultralytics.nn.modules.block import C2f
from ultralytics.nn.modules.conv import Concat, Conv

from trainfuse.clients import ON, Row
from trainfuse.nn import upsample
from trainfuse.nn.conv_block import InstanceForward
from trainfuse.nn.upsample_concat import upsample_concat
from trainfuse.ultralytics.changes.base import Change, Run

# forwards that read their input through one convolution first (autocast casts it to 16 bits once):
# Conv's act(bn(conv(x))), C2f's cv1(x)
_ONE_CONV_FIRST = (Conv.forward, C2f.forward)


def _sources(layer: nn.Module, j: int) -> list[int]:
    """The layers that layer ``j`` of ``model.model`` reads, once per time it reads them (its ``f``:
    -1 the layer before, an index, or a list of both)."""
    f = layer.f
    return [j - 1 if s == -1 else s for s in (f if isinstance(f, (list, tuple)) else [f])]


def _readings(layers: nn.Sequential, i: int) -> list[nn.Module]:
    """The layers that read layer ``i``'s output, once per reading (a Concat of it twice: twice)."""
    return [layers[j] for j in range(i + 1, len(layers)) for s in _sources(layers[j], j) if s == i]


def _one_conv_first(layer: nn.Module) -> bool:
    return type(layer).forward in _ONE_CONV_FIRST


def exact_upsamplings(model: nn.Module) -> tuple[list[nn.Module], int]:
    """The nearest ``nn.Upsample`` layers of an ultralytics model whose float16 output changes no
    number (module docstring), and how many nearest upsamplings it has in all."""
    layers = getattr(model, "model", None)
    if not isinstance(layers, nn.Sequential) or not all(hasattr(m, "f") for m in layers):
        return [], 0
    found, total = [], 0
    for i, layer in enumerate(layers):
        if not upsample.nearest(layer):
            continue
        total += 1
        readers = _readings(layers, i)
        if len(readers) == 1 and type(readers[0]) is Concat:
            after = _readings(layers, readers[0].i)
            if len(after) == 1 and _one_conv_first(after[0]):
                found.append(layer)
    return found, total


def _doubles(m: nn.Module) -> bool:
    """Whether nearest ``nn.Upsample`` ``m`` doubles the map's sides (``scale_factor=2``, no size)."""
    factor = m.scale_factor
    factors = factor if isinstance(factor, tuple) else (factor, factor)
    return m.size is None and all(f is not None and float(f) == 2.0 for f in factors) \
        and not m.recompute_scale_factor


def concat_pair(model: nn.Module, up: nn.Module) -> tuple[nn.Module, int] | None:
    """The ``Concat`` of two maps that reads ``up`` (one of :func:`exact_upsamplings`) and ``up``'s
    place among its inputs, where the two can run as one op (a 2x nearest upsampling, the
    concatenation along channels), else None."""
    layers = model.model
    concat = _readings(layers, up.i)[0]
    sources = _sources(concat, concat.i)
    if len(sources) != 2 or sources.count(up.i) != 1 or getattr(concat, "d", None) != 1 or not _doubles(up):
        return None
    if "forward" in concat.__dict__ or type(concat).forward is not Concat.forward:
        return None
    return concat, sources.index(up.i)


class _Deferred(InstanceForward):
    """An upsampling left to the Concat after it: its input as it is."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _UpsampleConcat(InstanceForward):
    """``Concat.forward`` of an upsampled map (its upsampling deferred to here) and another, as one
    op (:func:`trainfuse.nn.upsample_concat.upsample_concat`)."""

    def __init__(self, block: nn.Module, up_at: int) -> None:
        super().__init__(block)
        self.up_at = up_at

    def __call__(self, x: list[torch.Tensor]) -> torch.Tensor:
        return upsample_concat(x[self.up_at], x[1 - self.up_at], up_first=self.up_at == 0)


def install(model: nn.Module) -> tuple[list[nn.Module], list[tuple[nn.Module, nn.Module]], int]:
    """Change ``model``'s :func:`exact_upsamplings`: each one that :func:`concat_pair` takes into
    its Concat, the others in their input's dtype; returns ``(upsamplings in their input's dtype,
    (Upsample, Concat) pairs, nearest upsamplings in all)`` for :func:`uninstall`."""
    found, total = exact_upsamplings(model)
    changed, pairs = [], []
    for m in found:
        pair = concat_pair(model, m)
        if pair is not None and "forward" not in m.__dict__:  # upsampled into the Concat's output
            concat, at = pair
            m.forward = _Deferred(m)
            concat.forward = _UpsampleConcat(concat, at)
            pairs.append((m, concat))
        elif upsample.install(m):
            changed.append(m)
    return changed, pairs, total


def uninstall(changed: list[nn.Module], pairs: list[tuple[nn.Module, nn.Module]]) -> None:
    """Undo :func:`install`: the modules' class forwards back."""
    for m in changed:
        upsample.uninstall(m)
    for up, concat in pairs:
        for module, kind in ((up, _Deferred), (concat, _UpsampleConcat)):
            if isinstance(module.__dict__.get("forward"), kind):
                del module.forward


class Upsampling(Change):
    """The neck's nearest upsamplings in their input's dtype (module docstring)."""

    kind = "upsample"

    def __init__(self, on: bool) -> None:
        self.on = on
        self._changed: list[nn.Module] = []
        self._pairs: list[tuple[nn.Module, nn.Module]] = []  # (Upsample, Concat) run as one op
        self._total = 0

    @override
    def name(self, run: Run) -> str:
        return "Upsample"

    @override
    def why_off(self, run: Run) -> str | None:
        if not self.on:
            return "fuse_blocks=False"
        if not getattr(run.trainer, "amp", False) or run.device.type != "cuda":
            return "no AMP on CUDA: autocast casts nothing"
        if run.trainer.args.compile:
            return "compile is on (it picks its own kernels)"
        found, total = exact_upsamplings(run.model)
        if not found:
            return ("the model has no nearest Upsample" if not total else
                    f"none of its {total} nearest Upsample layers feeds one Concat read by one convolution")
        return None

    @override
    def apply(self, run: Run) -> None:
        self._changed, self._pairs, self._total = install(run.model)

    @override
    def rows(self, run: Run) -> list[Row]:
        changed = len(self._changed) + len(self._pairs)
        if not changed:
            return []
        left = self._total - changed
        rest = f" ({left} other nearest Upsample layers stay float32)" if left else ""
        joined = (f"; {len(self._pairs)} of them upsampled straight into the Concat after them, one op each "
                  "way (trainfuse.nn.upsample_concat)" if self._pairs else "")
        return [Row(self.kind, self.name(run), ON, f"{changed} nearest Upsample layers in their input's 16 "
                    "bits (autocast ran them in float32, and the Concat after them copied in float32): the "
                    f"same numbers{rest}{joined}")]

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        uninstall(self._changed, self._pairs)
        self._changed, self._pairs = [], []


__all__ = ["Upsampling", "concat_pair", "exact_upsamplings", "install", "uninstall"]
