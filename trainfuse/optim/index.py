"""The optimizer's params as the step driver sees them (:class:`ParamIndex`), and the check of
every param and grad a step makes before it modifies anything (:meth:`ParamIndex.validate`)."""

from __future__ import annotations

from typing import Any

import torch

from trainfuse._multi_tensor.tables import DTYPE_CODES, is_dense
from trainfuse._runtime.backend import use_triton
from trainfuse.optim.dtensors import is_dtensor, local, shard_group


class ParamIndex:
    """Every param of ``groups`` in order (``params``), its group's index (``group_of``), the
    positions of the params on each device (``devices``), and whether they share one device
    (``single``, with that ``device``; None otherwise). ``dtensors``: whether any param is a
    DTensor (the kernels then address local shards, :mod:`trainfuse.optim.dtensors`), and
    ``shard_group`` the process group they are sharded over (None: not sharded). ``owner`` names
    the optimizer in errors."""

    __slots__ = ("params", "group_of", "devices", "single", "device", "dtensors", "shard_group")

    def __init__(self, groups: list[dict[str, Any]], owner: str = "optimizer") -> None:
        self.params = [p for g in groups for p in g["params"]]
        self.group_of = [gi for gi, g in enumerate(groups) for _ in g["params"]]
        devices: dict[torch.device, list[int]] = {}
        for i, p in enumerate(self.params):
            devices.setdefault(p.device, []).append(i)
        self.devices = devices
        self.single = len(devices) == 1
        self.device = next(iter(devices)) if self.single else None
        self.dtensors = any(map(is_dtensor, self.params))
        self.shard_group = shard_group(self.params, owner) if self.dtensors else None

    def validate(self, client: Any, grads: list[torch.Tensor | None], kernels: bool) -> None:
        """Raise a clear error for the first unusable param/grad of ``client`` (the optimizer;
        ``grads`` aligned with ``params``), before anything is modified. ``kernels``: the params
        the kernels take must also have a dtype and a memory layout they read."""
        client.check_clipping()
        name = type(client).__name__
        if client.max_grad_norm is not None and not self.single and self.params:
            raise ValueError(f"{name}: max_grad_norm needs all params on one device, found "
                             f"{', '.join(map(str, self.devices))}; clip with "
                             "trainfuse.amp.clip_grad_norm_ per device instead")
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if g is None:
                continue
            if g.layout != torch.strided or g.is_sparse:
                self._fail(name, i, "has a sparse gradient; sparse gradients are not supported "
                                    "(use torch.optim.SparseAdam)", RuntimeError)
            if p.is_complex():
                self._fail(name, i, "is complex; complex params are not supported "
                                    "(view them as real with torch.view_as_real)")
            if not p.is_floating_point():
                self._fail(name, i, "is not floating point")
            if g.dtype != p.dtype:
                self._fail(name, i, f"has a {g.dtype} gradient; the gradient must have the param's dtype")
            if g.shape != p.shape:
                self._fail(name, i, f"has a gradient of shape {tuple(g.shape)}; expected the param's shape")
            if g.device != p.device:
                self._fail(name, i, f"has its gradient on {g.device}; expected the param's device")
            if self.dtensors and (is_dtensor(g) != is_dtensor(p) or local(g).shape != local(p).shape):
                what = f"a local shard of shape {tuple(local(g).shape)}" if is_dtensor(g) else "a plain one"
                self._fail(name, i, f"has as gradient {what}; expected a DTensor sharded like the param "
                                    f"(local shard {tuple(local(p).shape)})")
            if kernels and use_triton(p.device):
                if p.dtype not in DTYPE_CODES:
                    self._fail(name, i, "has a dtype the kernels do not take (float32, bfloat16, "
                                        "float16); TRAINFUSE_BACKEND=torch runs the torch path for it",
                               TypeError)
                if not is_dense(local(p)):
                    self._fail(name, i, "is a view with gaps or overlaps in memory; the fused update "
                                        "works over a param's storage, so pass a dense param")

    def _fail(self, owner: str, i: int, what: str, exc: type[Exception] = ValueError) -> None:
        p = self.params[i]
        raise exc(f"{owner}: param {i} (group {self.group_of[i]}, shape {tuple(p.shape)}, {p.dtype}, "
                  f"{p.device}) {what}")


__all__ = ["ParamIndex"]
