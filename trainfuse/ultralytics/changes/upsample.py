"""The neck's nearest upsamplings in 16 bits under AMP on CUDA (:mod:`trainfuse.nn.upsample`), with
``fuse_blocks=True`` (off by default until measured on a GPU); their own forward back at the end.

Autocast runs ``nn.Upsample`` in float32; the ``Concat`` after it then copies in float32 and the
convolutions that read it cast back (about 2 ms of yolo11m's 24 ms step on an H200, forward and
backward). An upsampling is changed only where the numbers stay stock's bit for bit: every layer
that reads it is a ``Concat``, and every layer that reads those is a block whose forward casts its
input to float16 in a convolution before anything else reads it (``Conv``, the ``C2f`` family,
the ``C3`` family); any other upsampling stays as it is.
"""

from __future__ import annotations

from torch import nn
from typing_extensions import override
from ultralytics.nn.modules.block import C3, C2f
from ultralytics.nn.modules.conv import Concat, Conv

from trainfuse.clients import ON, Row
from trainfuse.nn import upsample
from trainfuse.ultralytics.changes.base import Change, Run

# forwards that read their input only through convolutions first (autocast casts it to 16 bits):
# Conv's act(bn(conv(x))), C2f's cv1(x), C3's cv1(x) and cv2(x)
_CONV_FIRST = (Conv.forward, C2f.forward, C3.forward)


def _readers(layers: nn.Sequential, i: int) -> list[nn.Module]:
    """The layers of an ultralytics model's ``model.model`` that read layer ``i``'s output (by
    their ``f``: -1 the layer before, an index, or a list of both)."""
    out = []
    for j in range(i + 1, len(layers)):
        f = layers[j].f
        sources = f if isinstance(f, (list, tuple)) else [f]
        if any((s == -1 and j == i + 1) or s == i for s in sources):
            out.append(layers[j])
    return out


def _conv_first(layer: nn.Module) -> bool:
    return type(layer).forward in _CONV_FIRST


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
        readers = _readers(layers, i)
        if readers and all(type(r) is Concat and _readers(layers, r.i) and
                           all(_conv_first(rr) for rr in _readers(layers, r.i)) for r in readers):
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
                    f"none of its {total} nearest Upsample layers feeds only a Concat read by convolutions")
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
