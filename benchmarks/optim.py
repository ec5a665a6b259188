"""Optimizer benchmark (same as ``python -m trainfuse.bench optim``)."""

from trainfuse.bench.optim import main

if __name__ == "__main__":
    main()
