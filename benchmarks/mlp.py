"""MLP benchmark (same as ``python -m trainfuse.bench mlp``)."""

from trainfuse.bench.mlp import main

if __name__ == "__main__":
    main()
