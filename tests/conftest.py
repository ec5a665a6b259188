"""Test setup: without a CUDA GPU every kernel runs through the Triton interpreter.

The interpreter must be switched on before triton decorates the kernels, so this happens at import
time, before any test module imports trainfuse. On a GPU machine the same tests run the compiled
kernels on CUDA tensors.

Under pytest-xdist (``-n logical`` in the README's test command) every worker process runs this
file: each gets its share of the CPU threads and its own ultralytics config folder, so no two
workers write the same file.
"""

import collections
import os
import random
import shutil
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    from tests import _interpreter

    INTERPRETER_KEPT = _interpreter.install()

# xdist sets this in each worker: N workers with torch's default thread count each would run N
# times more threads than there are cores
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // _WORKERS))

# ultralytics writes its settings (and offline_env a font) into YOLO_CONFIG_DIR when first
# imported; one folder per test process, removed at the end
_YOLO_CONFIG = None
if "YOLO_CONFIG_DIR" not in os.environ:
    _YOLO_CONFIG = tempfile.mkdtemp(prefix="trainfuse-tests-yolo-config-")
    os.environ["YOLO_CONFIG_DIR"] = _YOLO_CONFIG

# fifteen test processes would each start Triton compile workers for every trainer they build; the
# tests of that (tests/_runtime/test_precompile.py) turn it back on; the machine's manifests of
# what tests launched stay out of the user's cache
os.environ.setdefault("TRAINFUSE_PRECOMPILE", "0")
_CACHE = None
if "TRAINFUSE_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="trainfuse-tests-cache-")
    os.environ["TRAINFUSE_CACHE_DIR"] = _CACHE

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _fresh_seed():
    """Fresh random inputs every run; the seed is printed so a failure can be replayed with
    TRAINFUSE_TEST_SEED (which CI, ``.ci/run``, sets to one fixed value)."""
    seed = int(os.environ.get("TRAINFUSE_TEST_SEED", random.randrange(2**31)))
    torch.manual_seed(seed)
    print(f"TRAINFUSE_TEST_SEED={seed}")
    yield


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def kernels(monkeypatch):
    """Force the Triton kernels (the interpreter on CPU) with a small chunk size, so that tensors
    of a few hundred elements already span several work items."""
    from trainfuse._multi_tensor.tables import config, master_config
    from trainfuse.losses import _common

    monkeypatch.setenv("TRAINFUSE_BACKEND", "triton")
    if DEVICE.type == "cpu":
        for cfg in (config, master_config, _common.config, _common.config16, _common.box_config):
            monkeypatch.setattr(cfg, "block", 32)
            monkeypatch.setattr(cfg, "unroll", 2)
    return config


# TRAINFUSE_KERNEL_MANIFEST=DIR: write the kernel specializations the interpreter launches to DIR,
# for python -m trainfuse._runtime.cross_compile DIR (tests/_kernel_record.py)
KERNEL_MANIFEST = os.environ.get("TRAINFUSE_KERNEL_MANIFEST")


def pytest_configure(config):
    if KERNEL_MANIFEST:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise pytest.UsageError("TRAINFUSE_KERNEL_MANIFEST records the Triton interpreter's launches: "
                                    "run the tests on a machine without CUDA")
        from tests import _kernel_record

        os.makedirs(KERNEL_MANIFEST, exist_ok=True)
        _kernel_record.install()


def pytest_report_header(config):
    import triton

    return (f"trainfuse tests on {DEVICE} | torch {torch.__version__} | triton {triton.__version__}"
            f" | TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}")


def pytest_terminal_summary(terminalreporter):
    """How many tests were skipped for each reason, most frequent first (``-rs`` lists each test)."""
    reasons = collections.Counter()
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.section(f"{sum(reasons.values())} skipped, by reason", sep="-")
        for reason, count in reasons.most_common():
            terminalreporter.write_line(f"{count:5d}  {reason}")


def pytest_unconfigure(config):
    if KERNEL_MANIFEST:
        from tests import _kernel_record

        _kernel_record.save(KERNEL_MANIFEST)
    for folder in (_YOLO_CONFIG, _CACHE):
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
