"""``python -m trainfuse.bench <family> [options]``: the one entry point of the benchmarks.

The first argument names the family (:data:`trainfuse.bench._common.FAMILIES`); everything after
it goes to that family's ``main(argv)``, so ``python -m trainfuse.bench <family> --help`` lists
the family's own options. Every family writes ``<out>/<family>.json``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from trainfuse.bench._common import FAMILIES

PROG = "python -m trainfuse.bench"


def _parser() -> argparse.ArgumentParser:
    width = max(map(len, FAMILIES))
    families = "\n".join(f"  {name.ljust(width)}  {what}" for name, (_, what) in FAMILIES.items())
    return argparse.ArgumentParser(
        prog=PROG, usage=f"{PROG} <family> [options]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Time trainfuse against torch on this machine's CUDA GPU and write <out>/<family>.json\n"
                    "(without a GPU a family says so and measures nothing).",
        epilog=f"families:\n{families}\n\n{PROG} <family> --help lists the family's options.")


def main(argv: list[str] | None = None) -> None:
    """Run the family that ``argv[0]`` names with the rest of ``argv``.

    Raises:
        SystemExit: 0 after ``-h``/``--help``; 2 with the help when no family is given, and with a
            message naming the families when ``argv[0]`` is not one of them.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    if not argv:
        parser.print_help(sys.stderr)
        raise SystemExit(2)
    if argv[0] in ("-h", "--help"):
        parser.print_help()
        raise SystemExit(0)
    if argv[0] not in FAMILIES:
        what = "option" if argv[0].startswith("-") else "family"
        parser.error(f"unknown {what} {argv[0]!r}: the first argument is a family, one of "
                     f"{', '.join(FAMILIES)} ({PROG} --help says what each measures)")
    importlib.import_module(FAMILIES[argv[0]][0]).main(argv[1:])


if __name__ == "__main__":
    main()
