"""Benchmarks against torch, run as ``python -m trainfuse.bench <family>``: the harness
(``_common``: timing, report, command line), the workloads (``workloads``: shapes and models) and
one module per family with ``main(argv)``."""
