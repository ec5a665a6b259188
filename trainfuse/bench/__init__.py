"""Benchmarks: ``python -m trainfuse.bench optim`` (one module per op family)."""
