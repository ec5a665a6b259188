"""``python -m trainfuse.bench <family> [options] [--out DIR]``: the one entry point of the
benchmarks. Each family is a module with ``main(argv)``; ``--help`` after the family lists its
options, and every family writes ``<out>/<family>.json`` (trainfuse/bench/_common.py)."""

import sys


def main() -> None:
    families = {"optim": "trainfuse.bench.optim", "amp": "trainfuse.bench.amp",
                "ema": "trainfuse.bench.ema", "losses": "trainfuse.bench.losses",
                "mlp": "trainfuse.bench.mlp",
                "yolo-loss": "trainfuse.bench.yolo_loss",
                "yolo": "trainfuse.bench.yolo",
                "lightning": "trainfuse.bench.lightning"}
    if len(sys.argv) < 2 or sys.argv[1] not in families:
        print(f"usage: python -m trainfuse.bench {{{','.join(families)}}} [options]")
        raise SystemExit(2)
    import importlib

    importlib.import_module(families[sys.argv[1]]).main(sys.argv[2:])


if __name__ == "__main__":
    main()
