"""offline_env, as a user's fresh Python process meets it: each run logs into ``runs/`` under the
folder it runs in, whichever folder ran first, and a ``YOLO_CONFIG_DIR`` the user set is theirs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ultralytics")

# what a training run would resolve its save_dir to, and where ultralytics looks for its plots' font
_PROBE = """
import json
from types import SimpleNamespace

from trainfuse.ultralytics.offline import offline_env

folder = offline_env()
from ultralytics.cfg import get_save_dir
from ultralytics.utils import SETTINGS, USER_CONFIG_DIR
from ultralytics.utils.checks import check_font

args = SimpleNamespace(project=None, name="train", task="detect", mode="train", exist_ok=True)
print(json.dumps({"folder": str(folder), "config": str(USER_CONFIG_DIR), "runs_dir": SETTINGS["runs_dir"],
                  "save_dir": str(get_save_dir(args)), "font": str(check_font("Arial.ttf"))}))
"""

# a user's own settings, written by ultralytics itself
_USER_SETTINGS = """
import sys

from ultralytics.utils import SETTINGS

SETTINGS.update(runs_dir=sys.argv[1])
"""


def _python(code: str, cwd: Path, env: dict[str, str], *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def user_env(tmp_path) -> dict[str, str]:
    """A user's environment: no YOLO_CONFIG_DIR, not under pytest, a temporary directory of its own
    that every process started with it shares."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("YOLO_CONFIG_DIR", "YOLO_OFFLINE", "PYTEST_CURRENT_TEST")}
    (tmp_path / "tmp").mkdir()
    env["TMPDIR"] = str(tmp_path / "tmp")
    return env


def _folder(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    return folder.resolve()


def test_each_run_logs_under_its_own_working_directory(tmp_path, user_env):
    first, second = _folder(tmp_path, "clone-a"), _folder(tmp_path, "clone-b")
    runs = [json.loads(_python(_PROBE, cwd, user_env).splitlines()[-1]) for cwd in (first, second, first)]
    shared = (tmp_path / "tmp" / "trainfuse-yolo-config").resolve()
    for run, cwd in zip(runs, (first, second, first)):
        assert run["runs_dir"] == str(cwd / "runs")
        assert run["save_dir"] == str(cwd / "runs" / "detect" / "train")
        # one settings folder for all three, with the font where ultralytics looks for it
        assert Path(run["config"]).resolve().is_relative_to(shared)
        assert run["folder"] == run["config"]
        assert run["font"] == str(Path(run["config"]) / "Arial.ttf")


def test_a_yolo_config_dir_the_user_set_keeps_their_runs_dir(tmp_path, user_env):
    mine, elsewhere, cwd = tmp_path / "my-config", tmp_path / "my-runs", _folder(tmp_path, "work")
    user_env["YOLO_CONFIG_DIR"] = str(mine)
    _python(_USER_SETTINGS, cwd, user_env, str(elsewhere))
    run = json.loads(_python(_PROBE, cwd, user_env).splitlines()[-1])
    assert run["runs_dir"] == str(elsewhere)
    assert run["save_dir"] == str(elsewhere.resolve() / "detect" / "train")
    assert Path(run["config"]).resolve().is_relative_to(mine.resolve())
    assert not (tmp_path / "tmp" / "trainfuse-yolo-config").exists()
