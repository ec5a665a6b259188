"""AMP benchmark (same as ``python -m trainfuse.bench amp``)."""

from trainfuse.bench.amp import main

if __name__ == "__main__":
    main()
