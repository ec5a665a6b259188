"""The neck's nearest upsamplings in 16 bits under AMP on CUDA (:mod:`trainfuse.nn.upsample`), with
``fuse_blocks`` (on where the fused blocks are: :func:`trainfuse.ultralytics.changes.blocks.why_off`);
their own forward back at the end.

Autocast runs ``nn.Upsample`` in float32; the ``Concat`` after it then copies in float32 and the
convolutions that read it cast back (about 2 ms of yolo11m's 24 ms step on an H200, forward and
backward). An upsampling is changed only where the numbers stay stock's bit for bit: one layer
reads it, a ``Concat``, and one layer reads that, a block whose forward casts its input to float16
in one convolution before anything else reads it (``Conv``, the ``C2f`` family: C3k2 and the
like). Where two convolutions read it (the ``C3`` family's ``cv1`` and ``cv2``), stock adds their
grads in float32 and the backward would add them in float16, a rounding apart; that upsampling
stays in float32.

Where an upsampling's one reader is a ``Concat`` of it and one other map (every YOLO neck), the
upsampling and the concatenation run as one op each way (:mod:`trainfuse.nn.upsample_concat`): the
``Upsample`` hands its input on as it is and the ``Concat`` upsamples it into its output, in 16
bits where the above holds, else in float32 as autocast computes it (the concatenation in float32
then, as stock's ``cat`` promotes): the same numbers again.
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
from trainfuse.ultralytics.changes import blocks
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
    """The ``Concat`` of two maps that alone reads nearest upsampling ``up`` of ``model.model``, and
    ``up``'s place among its inputs, where the two can run as one op (a 2x nearest upsampling, the
    concatenation along channels), else None."""
    layers = getattr(model, "model", None)
    if not isinstance(layers, nn.Sequential) or not all(hasattr(m, "f") for m in layers):
        return None
    readers = _readings(layers, up.i)
    if len(readers) != 1 or type(readers[0]) is not Concat:
        return None
    concat = readers[0]
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
    op (:func:`trainfuse.nn.upsample_concat.upsample_concat`): the upsampling in its input's dtype,
    or with ``as_autocast`` in the dtype autocast gives it (float32 while autocast is on, and the
    concatenation in float32 with it, as ``cat`` promotes)."""

    def __init__(self, block: nn.Module, up_at: int, as_autocast: bool) -> None:
        super().__init__(block)
        self.up_at, self.as_autocast = up_at, as_autocast

    def __call__(self, x: list[torch.Tensor]) -> torch.Tensor:
        a = x[self.up_at]
        wide = self.as_autocast and torch.is_autocast_enabled(a.device.type)
        return upsample_concat(a, x[1 - self.up_at], up_first=self.up_at == 0,
                               up_dtype=torch.float32 if wide else None)


Pair = tuple[nn.Module, nn.Module, bool]  # (Upsample, Concat, the upsampling in float32 as autocast's)


def install(model: nn.Module) -> tuple[list[nn.Module], list[Pair], int]:
    """Change ``model``'s nearest upsamplings: each of :func:`exact_upsamplings` into the Concat
    :func:`concat_pair` finds for it, in its input's dtype, or alone in its input's dtype; each
    other one with a pair into its Concat as autocast computes it (yolov5's necks, float32 under
    autocast). Returns ``(upsamplings in their input's dtype, pairs, nearest upsamplings in all)``
    for :func:`uninstall`."""
    found, total = exact_upsamplings(model)
    layers = getattr(model, "model", [])
    changed, pairs = [], []
    for m in [m for m in layers if upsample.nearest(m)]:
        pair = concat_pair(model, m)
        if pair is not None:  # upsampled into the Concat's output
            concat, at = pair
            m.forward = _Deferred(m)
            concat.forward = _UpsampleConcat(concat, at, as_autocast=m not in found)
            pairs.append((m, concat, m not in found))
        elif m in found and upsample.install(m):
            changed.append(m)
    return changed, pairs, total


def uninstall(changed: list[nn.Module], pairs: list[Pair]) -> None:
    """Undo :func:`install`: the modules' class forwards back."""
    for m in changed:
        upsample.uninstall(m)
    for up, concat, _ in pairs:
        for module, kind in ((up, _Deferred), (concat, _UpsampleConcat)):
            if isinstance(module.__dict__.get("forward"), kind):
                del module.forward


class Upsampling(Change):
    """The neck's nearest upsamplings in their input's dtype (module docstring)."""

    kind = "upsample"

    def __init__(self, setting: bool | None) -> None:
        self.setting = setting
        self._changed: list[nn.Module] = []
        self._pairs: list[Pair] = []  # run as one op
        self._total = 0

    @override
    def name(self, run: Run) -> str:
        return "Upsample"

    @override
    def why_off(self, run: Run) -> str | None:
        off = blocks.why_off(self.setting, run)
        if off is not None:
            return off
        if not getattr(run.trainer, "amp", False) or run.device.type != "cuda":
            return "no AMP on CUDA: autocast casts nothing"
        if run.trainer.args.compile:
            return "compile is on (it picks its own kernels)"
        found, total = exact_upsamplings(run.model)
        layers = getattr(run.model, "model", [])
        if not found and not any(concat_pair(run.model, m) for m in layers if upsample.nearest(m)):
            return ("the model has no nearest Upsample" if not total else
                    f"none of its {total} nearest Upsample layers feeds one Concat read by one convolution, "
                    "or a Concat of two maps")
        return None

    @override
    def apply(self, run: Run) -> None:
        self._changed, self._pairs, self._total = install(run.model)

    @override
    def rows(self, run: Run) -> list[Row]:
        wide = sum(as_autocast for _, _, as_autocast in self._pairs)
        half = len(self._changed) + len(self._pairs) - wide
        parts = []
        if half:
            parts.append(f"{half} nearest Upsample layers in their input's 16 bits (autocast ran them in "
                         "float32, and the Concat after them copied in float32): the same numbers")
        if self._pairs:
            as_autocast = f", {wide} of them in float32 as autocast computes them" if wide else ""
            parts.append(f"{len(self._pairs)} upsampled straight into the Concat after them, one op each way "
                         f"(trainfuse.nn.upsample_concat){as_autocast}")
        if not parts:
            return []
        left = self._total - len(self._changed) - len(self._pairs)
        rest = f" ({left} other nearest Upsample layers stay as they are)" if left else ""
        return [Row(self.kind, self.name(run), ON, "; ".join(parts) + rest)]

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        uninstall(self._changed, self._pairs)
        self._changed, self._pairs = [], []


__all__ = ["Pair", "Upsampling", "concat_pair", "exact_upsamplings", "install", "uninstall"]
