"""Benchmarks against torch, run as ``python -m trainfuse.bench <family>``: the harness
(``_common``: timing, report, command line, the list of families), the workloads (``workloads``:
shapes and models), the timers of ultralytics training runs (``yolo_harness``) and one module per
family with ``main(argv)``."""
