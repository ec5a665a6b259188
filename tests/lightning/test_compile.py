"""FusedTraining with torch.compile: a compiled child module, and ``trainer.fit(torch.compile(model))``.

Compiled code calls the modules it wrapped and dynamo traces what a forward calls, so the modules
torch.compile compiled stay stock (``skipped`` rows with the reason) and the run trains as the
stock compiled run does. The compile backend is ``"eager"``: dynamo traces the same Python as under
inductor (the trace is where a swapped Triton launch failed), without inductor's C++ code generation,
which takes half a minute per fit on this suite's CPU runs.
"""

import pytest
import torch
from torch import nn

from tests.lightning.helpers import PACKAGES, fit, make_module, package
from tests.lightning.test_training import KERNEL_TOL
from trainfuse._runtime import compat
from trainfuse.lightning import FusedTraining, _compat
from trainfuse.losses import BCEWithLogitsLoss
from trainfuse.nn import FusedMLP

BACKEND = "eager"


def rows_of(cb) -> dict[tuple[str, str], tuple[str, str]]:
    return {(r.kind, r.name): (r.action, r.detail) for r in cb.report}


def fused_modules(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, (FusedMLP, BCEWithLogitsLoss))]


def with_compiled_child(pl, child: str):
    module = make_module(pl)
    setattr(module, child, torch.compile(getattr(module, child), backend=BACKEND))
    return module


@pytest.mark.parametrize(("child", "kind", "other"), [("body", "mlp", "loss"), ("crit", "loss", "mlp")])
def test_compiled_child_stays_stock_and_trains_as_the_stock_run(torch_path, child, kind, other):
    """A ``torch.compile``'d child keeps its own modules (the compiled code would not call a swapped
    one); the other fusion still applies, and the run's losses are the stock compiled run's."""
    pl = package()
    stock, ours = with_compiled_child(pl, child), with_compiled_child(pl, child)
    fit(pl, stock, 3)
    cb = FusedTraining(verbose=False)
    fit(pl, ours, 3, callbacks=[cb])
    rows = rows_of(cb)
    action, detail = rows[(kind, child)]
    assert action == "skipped"
    assert detail.startswith(f"{child} is torch.compile'd: dynamo compiled it")
    assert rows[(other, "crit" if other == "loss" else "body")][0] == "swapped"
    assert [name for k, name in rows if k == kind] == [child]  # named as the user's model names it
    compiled = compat.compiled_original(getattr(ours, child))
    assert type(compiled) in (nn.Sequential, nn.BCEWithLogitsLoss)
    assert not fused_modules(compiled)
    assert torch.equal(torch.stack(ours.losses), torch.stack(stock.losses))


def test_compiled_lightning_module_skips_module_swaps_and_trains_as_the_stock_compiled_run(kernels):
    """``trainer.fit(torch.compile(model))``: Lightning runs forward and training_step through
    dynamo, which would trace a fused module's Triton launch. The module swaps and the graphs are
    skipped with that reason; the optimizer, stepping outside the compiled code, is swapped."""
    pl = package()
    stock, ours = make_module(pl), make_module(pl)
    fit(pl, torch.compile(stock, backend=BACKEND), 3)
    cb = FusedTraining(verbose=False, cuda_graphs=True)
    fit(pl, torch.compile(ours, backend=BACKEND), 3, callbacks=[cb])
    rows = rows_of(cb)
    for row in (("mlp", "body"), ("loss", "crit"), ("graphs", "cuda_graphs")):
        action, detail = rows[row]
        assert action == "skipped", row
        assert detail.startswith("the LightningModule is compiled (trainer.fit(torch.compile(model)))"), row
    assert rows[("optimizer", "optimizer 0 (AdamW)")][0] == "swapped"
    assert not fused_modules(ours)
    assert len(ours.losses) == len(stock.losses) == 3
    tol = KERNEL_TOL["32-true"]  # the fused AdamW kernel against torch's, as in test_training
    torch.testing.assert_close(torch.stack(ours.losses), torch.stack(stock.losses), atol=tol, rtol=0)


@pytest.mark.parametrize("pkg", PACKAGES)
def test_compiled_by_trainer_sees_the_module_lightning_unwrapped(pkg):
    """``_compat.compiled_by_trainer`` reads Lightning's private ``_compiler_ctx``: true inside a fit
    of ``torch.compile(model)``, false in a fit of the plain module."""
    pl = package(pkg)
    seen = []

    class Probe(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            seen.append(_compat.compiled_by_trainer(pl_module))

    module = make_module(pl)
    assert not _compat.compiled_by_trainer(module)
    fit(pl, torch.compile(module, backend=BACKEND), 1, callbacks=[Probe()])
    fit(pl, make_module(pl), 1, callbacks=[Probe()])
    assert seen == [True, False]
