"""Plain-torch references for the optimizer tests: torch.optim itself, run in float64 on copies
of our tensors, so each fused step is checked against one exact step (no drift between runs)."""

from __future__ import annotations

import inspect
import random

import torch

from trainfuse.optim.registry import COUNTERPARTS, by_fused

# every fused optimizer of the registry that takes vectors too (Muon takes matrices only: its own
# tests, test_muon.py), and the stock class it is checked against
OPTIMIZERS = [c.fused_class for c in COUNTERPARTS if not c.matrices]
TORCH_CLASS = {c.fused_class: c.stock_class for c in COUNTERPARTS}

# Our math is float32 rounded once to the storage dtype; the reference is float64 rounded once.
# They may land one storage ulp apart, never more.
TOL = {
    torch.float32: dict(rtol=2e-5, atol=1e-6),
    torch.bfloat16: dict(rtol=2**-7, atol=1e-5),
    torch.float16: dict(rtol=2**-10, atol=1e-6),
}

SHAPES = [(0,), (1,), (7, 13), (3, 5, 7), (300,), (2, 3, 1, 1), (130, 3)]


def random_hparams(cls, rng: random.Random) -> dict:
    """One random point of the optimizer's hyperparameter space: a draw from its registry
    examples that the stock constructor accepts (SGD's nesterov needs momentum and no dampening)."""
    counterpart = by_fused(cls)
    probe = [torch.nn.Parameter(torch.zeros((1, 1) if counterpart.matrices else 1))]
    for _ in range(100):
        hp = {k: rng.choice(v) for k, v in counterpart.examples.items()}
        try:
            counterpart.stock_class(probe, **hp)
        except ValueError:
            continue
        return hp
    raise AssertionError(f"no valid draw from {counterpart.name}'s examples in 100 tries")


def snapshot(opt) -> tuple[list[torch.Tensor], list[dict]]:
    params = [p for g in opt.param_groups for p in g["params"]]
    states = [{k: v.detach().clone() if torch.is_tensor(v) else v for k, v in opt.state.get(p, {}).items()}
              for p in params]
    return [p.detach().clone() for p in params], states


def reference_step(opt, params_before, states_before, grads):
    """What torch.optim computes in float64 for one step from the given params/states/grads."""
    tcls = next(t for c, t in TORCH_CLASS.items() if type(opt) is c)
    qs = [p.double().clone() for p in params_before]
    groups, k = [], 0
    for g in opt.param_groups:
        n = len(g["params"])
        opts = {key: v for key, v in g.items() if key not in ("params", "fused", "foreach")}
        if torch.is_tensor(opts["lr"]):
            opts["lr"] = float(opts["lr"])
        groups.append(dict(opts, params=qs[k : k + n]))
        k += n
    # torch's single-tensor path (the one float64 reference); a stock class without the option
    # (an optimizer from another package) has one path
    topt = tcls(groups, **({"foreach": False} if "foreach" in inspect.signature(tcls).parameters else {}))
    for q, st, g in zip(qs, states_before, grads):
        if st:
            topt.state[q] = {key: (torch.tensor(float(v), dtype=torch.float64) if key == "step"
                                   else v.double().clone()) for key, v in st.items()}
        q.grad = None if g is None else g.double()
    topt.step()
    return qs, [topt.state[q] for q in qs]


def assert_step_matches(opt, params_before, states_before, grads, dtype, msg=""):
    exp_params, exp_states = reference_step(opt, params_before, states_before, grads)
    params = [p for g in opt.param_groups for p in g["params"]]
    tol = TOL[dtype]
    for i, (p, q) in enumerate(zip(params, exp_params)):
        torch.testing.assert_close(p.detach().cpu().float(), q.to(dtype).cpu().float(), **tol,
                                   msg=lambda m, i=i: f"{msg} param {i}: {m}")
        for key, v in exp_states[i].items():
            ours = opt.state[p][key]
            if key == "step":
                assert float(ours) == float(v), f"{msg} param {i} step {float(ours)} != {float(v)}"
                continue
            assert ours.dtype == p.dtype and ours.shape == p.shape
            torch.testing.assert_close(ours.cpu().float(), v.to(dtype).cpu().float(), **tol,
                                       msg=lambda m, i=i, key=key: f"{msg} param {i} {key}: {m}")
