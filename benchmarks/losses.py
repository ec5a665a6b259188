"""Loss benchmark (same as ``python -m trainfuse.bench losses``)."""

from trainfuse.bench.losses import main

if __name__ == "__main__":
    main()
