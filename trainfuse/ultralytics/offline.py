"""Run ultralytics without a network: no download attempts, a local font for its plots, and runs
logged under the current folder.

Ultralytics reads ``YOLO_CONFIG_DIR`` and ``YOLO_OFFLINE`` once, when it is first imported, so
:func:`offline_env` sets them and then imports ``ultralytics.utils`` itself: call it before anything
else imports ``ultralytics``. With ``YOLO_OFFLINE=1`` its online check answers "offline" at once, so
the AMP check's model download fails fast and the check is skipped with a warning (AMP stays on), as
on any offline machine. Its plots look for ``Arial.ttf`` in its config folder and download it when
missing: matplotlib's DejaVuSans, copied in under that name, is found first.

Without a ``YOLO_CONFIG_DIR`` of the user's, the settings live in one folder under the temporary
directory that every run shares, and the ``runs_dir`` saved there by the first run (ultralytics'
default: ``runs/`` of the git clone its package is installed in) would hold for all of them: each
call points ``runs_dir`` at ``runs/`` under the current working directory instead. A
``YOLO_CONFIG_DIR`` the user set keeps its settings as they are.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path


def _copy_font(folder: Path) -> None:
    """Put matplotlib's DejaVuSans into ``folder`` as ``Arial.ttf``, unless one is there."""
    font = folder / "Arial.ttf"
    if font.exists():
        return
    try:
        import matplotlib

        source = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"
        shutil.copyfile(source, font)
    except (ImportError, OSError) as exc:  # plots then fail to find a font; training still runs
        print(f"offline_env: no font copied into {folder} ({exc}); pass plots=False", file=sys.stderr)


def offline_env(config_dir: str | Path | None = None) -> Path:
    """Set ``YOLO_OFFLINE=1`` and ``YOLO_CONFIG_DIR`` (when not set already), import ultralytics'
    settings, put a font in its config folder and, in a config folder of ours, set ``runs_dir`` to
    ``<current working directory>/runs``.

    Args:
        config_dir: the ultralytics config folder to use when ``YOLO_CONFIG_DIR`` is unset
            (default: ``<tmp>/trainfuse-yolo-config``).

    Returns:
        The folder ultralytics keeps its settings in (``ultralytics.utils.USER_CONFIG_DIR``).
    """
    os.environ.setdefault("YOLO_OFFLINE", "1")
    ours = "YOLO_CONFIG_DIR" not in os.environ
    if ours:
        default = Path(tempfile.gettempdir()) / "trainfuse-yolo-config"
        os.environ["YOLO_CONFIG_DIR"] = str(Path(config_dir) if config_dir is not None else default)
    requested = Path(os.environ["YOLO_CONFIG_DIR"]).expanduser().resolve()
    from ultralytics.utils import SETTINGS, USER_CONFIG_DIR

    folder = Path(USER_CONFIG_DIR)
    # ultralytics 8.4.190 keeps its settings, and looks for the font, in YOLO_CONFIG_DIR/Ultralytics
    if not folder.resolve().is_relative_to(requested):  # imported before, or the folder is not writable
        print(f"offline_env: ultralytics keeps its settings in {folder}, not in {requested} (imported "
              f"before offline_env, or {requested} is not writable): its font and runs_dir left as they are",
              file=sys.stderr)
        return folder
    _copy_font(folder)
    runs = str(Path.cwd() / "runs")
    if ours and SETTINGS["runs_dir"] != runs:
        SETTINGS.update(runs_dir=runs)
    return folder


__all__ = ["offline_env"]
