"""The per-group hyperparameter table the update kernels read (float64, ``HP_WIDTH`` per group)."""

from __future__ import annotations

import torch

from trainfuse._multi_tensor.tables import upload
from trainfuse.optim.contract import OptimizerClient


class HparamTables:
    """``client``'s hyperparameter table on each device it steps on (``by_device``: device ->
    ``(values, table)``, the host values the table was last written from)."""

    def __init__(self, client: OptimizerClient) -> None:
        self.client = client
        self.by_device: dict[torch.device, tuple[list[float], torch.Tensor]] = {}

    def on(self, device: torch.device) -> torch.Tensor:
        """The device table of the groups' current hyperparameters (``hparams_row`` of each
        group, padded to ``HP_WIDTH``): uploaded when new, rewritten in place when a value
        changed (same address), reused as is otherwise. Tensor hyperparameters (a CUDA lr) are
        copied in on the device every call, with no sync."""
        client = self.client
        values: list[float] = []
        tensors = []
        width = client.HP_WIDTH
        for group in client.param_groups:
            row = client.hparams_row(group)
            for v in row:
                if isinstance(v, torch.Tensor):
                    tensors.append((len(values), v))
                    values.append(0.0)
                else:
                    values.append(float(v))
            values.extend([0.0] * (width - len(row)))  # rows are HP_WIDTH wide in the kernel
        cached = self.by_device.get(device)
        if cached is None or cached[0] != values:
            client.check_hparams()
            host = torch.tensor(values, dtype=torch.float64)
            if cached is not None and len(cached[0]) == len(values):
                # in place, stream-ordered after the launches that read it: its address stays, so
                # a step replayed from a CUDA graph reads the new values (refresh)
                hp = cached[1]
                hp.copy_(host if hp.device.type == "cpu" else host.pin_memory(), non_blocking=True)
            else:
                hp = upload(host, device)
            self.by_device[device] = (values, hp)
        else:
            hp = cached[1]
        for k, t in tensors:  # tensor hyperparameters (e.g. a CUDA lr): device copy, no sync
            hp[k : k + 1].copy_(t.reshape(1), non_blocking=True)
        return hp

    def refresh(self) -> None:
        """Write the groups' current hyperparameters into each device's table, in place."""
        for device in list(self.by_device):
            self.on(device)


__all__ = ["HparamTables"]
