"""EMA benchmark (same as ``python -m trainfuse.bench ema``)."""

from trainfuse.bench.ema import main

if __name__ == "__main__":
    main()
