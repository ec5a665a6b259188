"""Multi-tensor tables: one int64 row per tensor and one work item per (tensor, chunk), so that a
single launch walks every tensor of a list (``tables.py``), and the Triton helpers the kernels that
read them are written with (``kernels.py``). Clients: the optimizers, FusedEMA and clipping."""
