"""The launch runtime every kernel family shares: the backend switch (``backend.py``) and the
low-host-cost launcher, per-stream workspaces and CUDA-graph replay of launch lists (``launch.py``).
It knows nothing of optimizers, losses or modules."""
