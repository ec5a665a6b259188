"""``python -m trainfuse.ultralytics.plot_worker``: draw one figure for
:class:`~trainfuse.ultralytics.plots.PlotWorkers`, then exit.

It imports matplotlib and ultralytics' plotting first (the slow part, done before the figure is
asked for), reads one pickled job from stdin (behind its length:
:func:`~trainfuse.ultralytics.plots.framed`), ``(target, name, args, kwargs, notify, curves)``,
calls ``getattr(target, name)(*args, **kwargs)`` (``target`` a module's name or an object), with
``on_plot`` collecting the files written where ``notify``, and writes ``("ok", files, seconds)``
(the call's time) or
``("error", traceback)`` to stdout, pickled and framed the same way, then exits at once
(``os._exit``: no interpreter teardown). ultralytics logs to stdout: the process's stdout goes to
stderr, the answer through a copy of the original descriptor.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import time
import traceback


def _only_part(module, part: int, parts: int) -> None:
    """Let through every ``parts``-th call of ``module``'s curve functions, from the ``part``-th on."""
    calls = [0]

    def share(fn):
        def drawn_or_skipped(*args, **kwargs):
            index = calls[0]
            calls[0] += 1
            if index % parts == part:
                return fn(*args, **kwargs)
            return None

        return drawn_or_skipped

    for name in ("plot_pr_curve", "plot_mc_curve"):  # what ap_per_class draws (this process only)
        setattr(module, name, share(getattr(module, name)))


def _warm_up() -> None:
    """Draw and save a small figure with text, ahead of the job: the fonts and the renderer's first
    use are paid for while no one waits."""
    import io

    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 1, figsize=(2, 2), tight_layout=True)
    ax.plot([0, 1], [0, 1], label="warm-up")
    ax.set_xlabel("x")
    ax.legend()
    fig.savefig(io.BytesIO(), dpi=50)
    plt.close(fig)


def main() -> int:
    from trainfuse.ultralytics.plots import framed, read_framed

    answer = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    import matplotlib

    matplotlib.use("Agg")
    import ultralytics.utils.metrics as metrics
    import ultralytics.utils.plotting  # noqa: F401 - imported ahead of the job

    _warm_up()

    try:
        job = read_framed(sys.stdin.fileno(), lambda: True)  # to its length: the end may never come
        target, name, args, kwargs, notify, curves = pickle.loads(job)
        if isinstance(target, str):
            target = importlib.import_module(target)
        if curves is not None:
            _only_part(metrics, *curves)
        files: list[str] = []
        if notify:
            kwargs["on_plot"] = lambda path, data=None: files.append(str(path))
        start = time.perf_counter()
        getattr(target, name)(*args, **kwargs)
        result = ("ok", files, time.perf_counter() - start)
    except BaseException:  # noqa: BLE001 - the parent raises it
        result = ("error", traceback.format_exc())
    answer.write(framed(pickle.dumps(result)))
    answer.close()
    sys.stderr.flush()
    # the figure's files are written and closed: no interpreter teardown (a second with torch and
    # matplotlib loaded, which the waiting validator would count)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
