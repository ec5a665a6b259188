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
"""

from __future__ import annotations

from torch import nn
from typing_extensions import override
from ultralytics.nn.modules.block import C2f
from ultralytics.nn.modules.conv import Concat, Conv

from trainfuse.clients import ON, Row
from trainfuse.nn import upsample
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


class Upsampling(Change):
    """The neck's nearest upsamplings in their input's dtype (module docstring)."""

    kind = "upsample"

    def __init__(self, on: bool) -> None:
        self.on = on
        self._changed: list[nn.Module] = []
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
        found, self._total = exact_upsamplings(run.model)
        self._changed = [m for m in found if upsample.install(m)]

    @override
    def rows(self, run: Run) -> list[Row]:
        if not self._changed:
            return []
        left = self._total - len(self._changed)
        rest = f" ({left} other nearest Upsample layers stay float32)" if left else ""
        return [Row(self.kind, self.name(run), ON, f"{len(self._changed)} nearest Upsample layers in their "
                    "input's 16 bits (autocast ran them in float32, and the Concat after them copied in "
                    f"float32): the same numbers{rest}")]

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        for m in self._changed:
            upsample.uninstall(m)
        self._changed = []


__all__ = ["Upsampling", "exact_upsamplings"]
