"""FusedTraining's report, what it skips and why, strict mode, both Lightning packages, bad input."""

import logging
import re

import pytest
import torch
from lightning_utilities.core import rank_zero as lightning_rank_zero
from torch import nn

import trainfuse
from tests.conftest import DEVICE
from tests.lightning.helpers import PACKAGES, fit, float16_mixed, make_module, package
from trainfuse.lightning import FusedTraining, Row, SkipError
from trainfuse.lightning.changes import Run


def rows_of(cb):
    return {(r.kind, r.name): r for r in cb.report}


class Messages(logging.Handler):
    """The info messages a logger handles (Lightning's prints them through a handler of its own, or
    through the root logger's where one was set up before it was imported, pytest's)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("pkg", PACKAGES)
def test_report_rows_and_printed_table(torch_path, pkg):
    pl = package(pkg)
    cb = FusedTraining(ema_decay=0.9)
    # every package's rank_zero_info writes to lightning_utilities' one logger (the last package
    # imported names it)
    logger, logged = lightning_rank_zero.log, Messages()
    logger.addHandler(logged)
    try:
        trainer = fit(pl, make_module(pl), 2, callbacks=[cb], clip=1.0)
    finally:
        logger.removeHandler(logged)
    device = str(trainer.strategy.root_device)  # the device with its index: "cuda:0", "cpu"
    assert all(isinstance(r, Row) for r in cb.report)
    assert [(r.kind, r.name, r.action) for r in cb.report] == [
        ("backend", device, "on"),
        ("mlp", "body", "swapped"),
        ("loss", "crit", "swapped"),
        ("optimizer", "optimizer 0 (AdamW)", "swapped"),
        ("clipping", "gradient_clip_val=1.0, algorithm=norm", "on"),
        ("ema", "decay=0.9", "on"),
        ("casts", "32-true", "off"),
        ("graphs", "cuda_graphs", "off"),
        ("optimizer_graph", "optimizer step", "off"),
    ]
    detail = rows_of(cb)[("backend", device)].detail
    assert detail.startswith("no GPU: torch path" if DEVICE.type == "cpu" else "torch path for cuda tensors")
    (printed,) = [m for m in logged.messages if m.startswith("FusedTraining:")]
    assert printed.startswith("FusedTraining: 3 swapped, 0 skipped\n")
    for r in cb.report:
        assert r.detail in printed


# what the rows of the kernel path promise, and torch's path does not do
KERNEL_WORDS = ("kernel", "launch", "no host sync", "one pass")


@pytest.mark.parametrize("path", ["torch_path", "kernels"])
def test_rows_describe_what_runs_on_the_backend(request, path):
    """On torch's path (no GPU, or TRAINFUSE_BACKEND=torch) no row promises kernels, launches or
    the absence of host syncs: each says what runs there, torch's own math."""
    request.getfixturevalue(path)
    pl = package()
    cb = FusedTraining(verbose=False, ema_decay=0.9)
    fit(pl, make_module(pl), 1, callbacks=[cb], clip=1.0, plugins=[float16_mixed(pl)])
    rows = {r.kind: r for r in cb.report}
    kinds = ("mlp", "loss", "optimizer", "clipping", "ema", "scaler")
    assert [rows[k].action for k in kinds] == ["swapped", "swapped", "swapped", "on", "on", "swapped"]
    for k in kinds:
        promised = [w for w in KERNEL_WORDS if w in rows[k].detail]
        if path == "kernels":
            assert promised, (k, rows[k].detail)
        else:
            assert not promised and "torch" in rows[k].detail, (k, rows[k].detail)
    assert rows["backend"].detail.startswith("Triton kernels" if path == "kernels" else
                                             ("no GPU: torch path" if DEVICE.type == "cpu" else "torch path"))


def test_mixing_packages_is_accepted_by_both_trainers():
    """One FusedTraining instance is a Callback of every installed package."""
    cb = FusedTraining(verbose=False)
    for name in PACKAGES:
        assert isinstance(cb, package(name).Callback)


def test_unsupported_optimizer_is_skipped_with_its_reason_and_clipping_left_to_lightning(torch_path):
    pl = package()
    ref, ours = make_module(pl, "rmsprop"), make_module(pl, "rmsprop")
    fit(pl, ref, 2, clip=0.3)
    cb = FusedTraining(verbose=False)
    trainer = fit(pl, ours, 2, callbacks=[cb], clip=0.3)
    rows = rows_of(cb)
    assert rows[("optimizer", "optimizer 0 (RMSprop)")].action == "skipped"
    assert "RMSprop has no fused counterpart" in rows[("optimizer", "optimizer 0 (RMSprop)")].detail
    assert rows[("clipping", "gradient_clip_val=0.3, algorithm=norm")].action == "skipped"
    assert type(trainer.optimizers[0]) is torch.optim.RMSprop
    for k, v in ref.state_dict().items():
        assert torch.equal(v, ours.state_dict()[k]), k


def test_strict_raises_instead_of_skipping():
    pl = package()
    with pytest.raises(SkipError, match="optimizer 0 \\(RMSprop\\): RMSprop has no fused counterpart"):
        fit(pl, make_module(pl, "rmsprop"), 1, callbacks=[FusedTraining(verbose=False, strict=True)])


def test_optimizer_with_step_hooks_and_overridden_clipping_are_skipped():
    pl = package()
    module = make_module(pl)
    configure = module.configure_optimizers

    def hooked():
        opt = configure()
        opt.register_step_post_hook(lambda *a: None)
        return opt

    module.configure_optimizers = hooked
    cb = FusedTraining(verbose=False)
    fit(pl, module, 1, callbacks=[cb])
    assert "step hooks" in rows_of(cb)[("optimizer", "optimizer 0 (AdamW)")].detail

    class OwnClip(type(make_module(pl))):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                        gradient_clip_algorithm=None):
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    cb = FusedTraining(verbose=False)
    fit(pl, OwnClip(), 1, callbacks=[cb], clip=0.5)
    row = rows_of(cb)[("optimizer", "optimizer 0 (AdamW)")]
    assert "configure_gradient_clipping is overridden" in row.detail


def test_manual_optimization_without_a_grad_scaler_is_swapped():
    """32-true: the module steps the fused optimizer itself (16-mixed's GradScaler keeps it stock:
    tests/lightning/test_muon.py, on a GPU)."""
    pl = package()

    class Manual(type(make_module(pl))):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, i):
            opt = self.optimizers()
            loss = self.crit(self(batch[0]), batch[1])
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

    cb = FusedTraining(verbose=False)
    trainer = fit(pl, Manual(), 1, callbacks=[cb])
    assert rows_of(cb)[("optimizer", "optimizer 0 (AdamW)")].action == "swapped"
    assert type(trainer.optimizers[0]).__name__ == "FusedAdamW"


def test_modules_with_hooks_or_parametrizations_are_skipped():
    pl = package()
    module = make_module(pl)
    module.second = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    module.third = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    torch.nn.utils.prune.random_unstructured(module.second[0], "weight", amount=0.5)  # a forward pre-hook
    torch.nn.utils.parametrizations.weight_norm(module.third[0])
    module.crit.register_forward_hook(lambda *a: None)
    cb = FusedTraining(verbose=False)
    fit(pl, module, 1, callbacks=[cb])
    rows = rows_of(cb)
    assert rows[("mlp", "body")].action == "swapped"
    assert rows[("mlp", "second")].action == "skipped"
    assert "forward pre hooks" in rows[("mlp", "second")].detail
    assert "parametrized" in rows[("mlp", "third")].detail
    assert "forward hooks" in rows[("loss", "crit")].detail
    assert type(module.second) is nn.Sequential and type(module.crit) is nn.BCEWithLogitsLoss


def test_module_fusion_keeps_parameters_and_keys_and_can_be_turned_off():
    pl = package()
    ids = {}

    class Probe(pl.Callback):  # listed before FusedTraining: on_fit_start sees the module unchanged
        def on_fit_start(self, trainer, pl_module):
            ids["before"] = {k: id(v) for k, v in pl_module.state_dict(keep_vars=True).items()}

        def on_train_start(self, trainer, pl_module):
            ids["after"] = {k: id(v) for k, v in pl_module.state_dict(keep_vars=True).items()}

    module = make_module(pl)
    param_ids = {k: id(p) for k, p in module.named_parameters()}
    fit(pl, module, 1, callbacks=[Probe(), FusedTraining(verbose=False)])
    assert type(module.body) is trainfuse.nn.FusedMLP
    # the same tensors under the same keys, compared on the Trainer's device (moving the module
    # there, and back at teardown, replaces its buffers but keeps its Parameter objects)
    assert ids["after"] == ids["before"]
    assert {k: id(p) for k, p in module.named_parameters()} == param_ids
    module = make_module(pl)
    cb = FusedTraining(verbose=False, mlp=False, losses=False, fuse_casts=False)
    fit(pl, module, 1, callbacks=[cb], precision="bf16-mixed")
    assert type(module.body) is nn.Sequential and type(module.crit) is nn.BCEWithLogitsLoss
    assert not any(r.kind in ("mlp", "loss") for r in cb.report)
    assert rows_of(cb)[("casts", "bf16-mixed")].detail.startswith("fuse_casts=False")


def test_casts_on_the_torch_path_are_skipped_with_the_reason(torch_path):
    pl = package()
    cb = FusedTraining(verbose=False)
    fit(pl, make_module(pl), 1, callbacks=[cb], precision="bf16-mixed")
    row = rows_of(cb)[("casts", "bf16-mixed")]
    assert row.action == "skipped" and "torch path" in row.detail


def test_unknown_precision_changes_nothing_and_says_so():
    pl = package()
    module = make_module(pl).double()
    cb = FusedTraining(verbose=False)
    trainer = fit(pl, module, 1, callbacks=[cb], precision="64-true")
    row = rows_of(cb)[("precision", "precision='64-true'")]
    assert row.action == "skipped" and "nothing changed" in row.detail
    assert type(trainer.optimizers[0]) is torch.optim.AdamW and type(module.body) is nn.Sequential
    with pytest.raises(SkipError, match="precision='64-true'"):
        fit(pl, make_module(pl).double(), 1, callbacks=[FusedTraining(strict=True)], precision="64-true")


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5, 1.5, float("nan"), "0.9", True])
def test_bad_ema_decay(decay):
    with pytest.raises(ValueError, match="ema_decay must be a number in \\(0, 1\\)"):
        FusedTraining(ema_decay=decay)


@pytest.mark.parametrize("name", ["fuse_casts", "mlp", "losses", "strict", "log_grad_norm", "verbose"])
def test_bad_flags(name):
    with pytest.raises(TypeError, match=f"FusedTraining: {name} must be a bool"):
        FusedTraining(**{name: 1})


def test_docstring_lists_the_changes_in_the_order_they_are_made():
    """FusedTraining's docstring numbers its changes by kind, in the order it makes them in a run
    that has every one (DDP under 16-mixed, with an EMA), and names the strategies it takes."""
    run = Run(trainer=None, module=None, device=torch.device("cpu"), kernels=False, precision="16-mixed",
              strategy="ddp")
    made = [change.kind for change in FusedTraining(ema_decay=0.9)._changes(run)]
    listed = re.findall(r"^ +(\d+)\. ``(\w+)``", FusedTraining.__doc__, re.MULTILINE)
    assert [int(n) for n, _ in listed] == list(range(1, len(made) + 1))
    assert [kind for _, kind in listed] == made
    strategies = FusedTraining.__doc__.split("3. ``strategy``:")[1].split("4. ``mlp``")[0]
    for taken in ("single-device", "DDP", "FSDPStrategy(use_orig_params=True)", "ModelParallelStrategy"):
        assert taken in strategies
