"""Run ultralytics without a network: no download attempts, and a local font for its plots.

Ultralytics reads ``YOLO_CONFIG_DIR`` once, when it is first imported, so :func:`offline_env` must
run before anything imports ``ultralytics`` (this module does not import it). With ``YOLO_OFFLINE=1``
its online check answers "offline" at once, so the AMP check's model download fails fast and the
check is skipped with a warning (AMP stays on), as on any offline machine. Its plots look for
``Arial.ttf`` and download it when missing: matplotlib's DejaVuSans, copied in under that name,
is found first.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path


def offline_env(config_dir: str | Path | None = None) -> Path:
    """Set ``YOLO_OFFLINE=1`` and ``YOLO_CONFIG_DIR`` (when not set already) and put a font there.

    Args:
        config_dir: the ultralytics config folder to use when ``YOLO_CONFIG_DIR`` is unset
            (default: ``<tmp>/trainfuse-yolo-config``).

    Returns:
        The config folder in effect.
    """
    os.environ.setdefault("YOLO_OFFLINE", "1")
    if "YOLO_CONFIG_DIR" not in os.environ:
        default = Path(tempfile.gettempdir()) / "trainfuse-yolo-config"
        os.environ["YOLO_CONFIG_DIR"] = str(Path(config_dir) if config_dir is not None else default)
    folder = Path(os.environ["YOLO_CONFIG_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    font = folder / "Arial.ttf"
    if not font.exists():
        try:
            import matplotlib

            source = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"
            shutil.copyfile(source, font)
        except (ImportError, OSError) as exc:  # plots then fail to find a font; training still runs
            print(f"offline_env: no font copied into {folder} ({exc}); pass plots=False", file=sys.stderr)
    if "ultralytics" in sys.modules:
        from ultralytics.utils import USER_CONFIG_DIR

        if Path(USER_CONFIG_DIR).resolve() != folder.resolve():
            print(f"offline_env: ultralytics was imported before, it keeps its config folder "
                  f"{USER_CONFIG_DIR}", file=sys.stderr)
    return folder


__all__ = ["offline_env"]
