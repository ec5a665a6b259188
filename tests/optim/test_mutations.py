"""The cached tables never outlive what they point at: every mutation a user can make between
steps (state reset, param list edits, grads set to None, moved storage, layout changes,
load_state_dict, hyperparameters that need new state) is followed exactly as torch.optim follows
it. On CPU the kernels run through the Triton interpreter, which reads raw addresses: a stale
pointer reads or writes freed memory and the comparison with torch fails. On a GPU the same test
runs under ``compute-sanitizer --tool memcheck`` with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``.

``TRAINFUSE_FUZZ_SEQUENCES`` sets the number of random sequences (default 200).
"""

from __future__ import annotations

import copy
import os
import pickle
import random
from collections import defaultdict

import pytest
import torch

import trainfuse
from tests.optim.reference import TORCH_CLASS

CLASSES = [trainfuse.FusedAdamW, trainfuse.FusedAdam, trainfuse.FusedSGD]
SHAPES = [(5,), (3, 7), (2, 3, 2, 2), (33,), (1, 2, 3, 3)]
TOL = dict(rtol=2e-5, atol=2e-6)


def _hparams(cls, rng: random.Random) -> dict:
    if cls is trainfuse.FusedSGD:
        return dict(lr=rng.choice([0.01, 0.1]), momentum=rng.choice([0.0, 0.9]),
                    weight_decay=rng.choice([0.0, 0.01]))
    return dict(lr=rng.choice([0.01, 0.03]), weight_decay=rng.choice([0.0, 0.05]),
                amsgrad=rng.random() < 0.3)


class Twin:
    """Our optimizer and torch's, on identical copies of the same params, mutated alike."""

    def __init__(self, cls, rng: random.Random, device):
        self.rng, self.device = rng, device
        self.cls, self.tcls = cls, TORCH_CLASS[cls]
        hp = _hparams(cls, rng)
        ours = [self._new_param() for _ in range(rng.randint(1, 3))]
        theirs = [p.detach().clone().requires_grad_() for p in ours]
        self.ours = cls(ours, **hp)
        self.torch = self.tcls(theirs, foreach=False, **hp)

    def _new_param(self) -> torch.nn.Parameter:
        shape = self.rng.choice(SHAPES)
        return torch.nn.Parameter(torch.randn(shape, device=self.device))

    def pairs(self):
        ours = [p for g in self.ours.param_groups for p in g["params"]]
        theirs = [p for g in self.torch.param_groups for p in g["params"]]
        return list(zip(ours, theirs))

    def check(self, what: str) -> None:
        for i, (p, q) in enumerate(self.pairs()):
            assert p.shape == q.shape
            torch.testing.assert_close(p.detach(), q.detach(), **TOL,
                                       msg=lambda m, i=i: f"after {what}: param {i}: {m}")

    # ---- mutations, applied to both ---------------------------------------------------------
    def step(self) -> str:
        for p, q in self.pairs():
            if self.rng.random() < 0.2:
                p.grad = q.grad = None
            else:
                g = torch.randn_like(q)
                p.grad = g.clone().contiguous(memory_format=_format_of(p))
                q.grad = g.clone().contiguous(memory_format=_format_of(q))
        errors = []
        for opt in (self.ours, self.torch):
            try:
                opt.step()
                errors.append(None)
            except KeyError:  # amsgrad turned on over existing state: torch raises it too
                errors.append(KeyError)
        assert errors[0] == errors[1], f"ours raised {errors[0]}, torch raised {errors[1]}"
        return "step"

    def clear_state(self) -> str:
        self.ours.state.clear()
        self.torch.state.clear()
        return "state.clear()"

    def replace_state(self) -> str:
        self.ours.state = defaultdict(dict)
        self.torch.state = defaultdict(dict)
        return "state = defaultdict(dict)"

    def drop_one_state(self) -> str:
        pairs = self.pairs()
        p, q = pairs[self.rng.randrange(len(pairs))]
        self.ours.state.pop(p, None)
        self.torch.state.pop(q, None)
        return "state.pop(p)"

    def append_param(self) -> str:
        p = self._new_param()
        self.ours.param_groups[0]["params"].append(p)
        self.torch.param_groups[0]["params"].append(p.detach().clone().requires_grad_())
        return "params.append"

    def replace_param(self) -> str:
        params = self.ours.param_groups[0]["params"]
        j = self.rng.randrange(len(params))
        p = self._new_param()
        # the replaced param's state goes too (torch's state_dict cannot pack a stray entry)
        self.ours.state.pop(params[j], None)
        self.torch.state.pop(self.torch.param_groups[0]["params"][j], None)
        params[j] = p
        self.torch.param_groups[0]["params"][j] = p.detach().clone().requires_grad_()
        return "params[j] = new"

    def move_storage(self) -> str:
        for p, q in self.pairs():
            if self.rng.random() < 0.5:
                p.data = p.data.clone()
                q.data = q.data.clone()
        return "p.data = clone"

    def change_layout(self) -> str:
        for p, q in self.pairs():
            if p.dim() == 4:
                fmt = self.rng.choice([torch.channels_last, torch.contiguous_format])
                p.data = p.data.contiguous(memory_format=fmt)
                q.data = q.data.contiguous(memory_format=fmt)
        return "layout change"

    def load_torch_state(self) -> str:
        # torch's state (and params, as a checkpoint restores both) into ours
        for p, q in self.pairs():
            p.data.copy_(q.data)
        self.ours.load_state_dict(copy.deepcopy(self.torch.state_dict()))
        return "load_state_dict"

    def change_hparams(self) -> str:
        og, tg = self.ours.param_groups[0], self.torch.param_groups[0]
        if self.cls is trainfuse.FusedSGD and self.rng.random() < 0.7:
            og["momentum"] = tg["momentum"] = 0.9 if og["momentum"] == 0 else 0.0
            return f"momentum={og['momentum']}"
        if self.cls is not trainfuse.FusedSGD and self.rng.random() < 0.5:
            og["amsgrad"] = tg["amsgrad"] = not og["amsgrad"]
            return f"amsgrad={og['amsgrad']}"
        og["lr"] = tg["lr"] = self.rng.choice([0.005, 0.02])
        return f"lr={og['lr']}"


def _format_of(t: torch.Tensor):
    return torch.channels_last if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) \
        and not t.is_contiguous() else torch.contiguous_format


MUTATIONS = ["clear_state", "replace_state", "drop_one_state", "append_param", "replace_param",
             "move_storage", "change_layout", "load_torch_state", "change_hparams"]


def test_random_mutations_between_steps_follow_torch(kernels, device):
    # 80 random sequences a run (a fresh seed each local run; TRAINFUSE_FUZZ_SEQUENCES for more)
    sequences = int(os.environ.get("TRAINFUSE_FUZZ_SEQUENCES", "80"))
    rng = random.Random(torch.initial_seed())
    for seq in range(sequences):
        twin = Twin(rng.choice(CLASSES), rng, device)
        history = []
        history.append(twin.step())
        twin.check(" ; ".join(history))
        for _ in range(rng.randint(2, 4)):
            history.append(getattr(twin, rng.choice(MUTATIONS))())
            history.append(twin.step())
            twin.check(f"sequence {seq}: " + " ; ".join(history))


# ---- each defect on its own ----------------------------------------------------------------------
@pytest.mark.parametrize("reset", ["clear", "new dict"])
def test_state_reset_restarts_like_torch_and_leaves_other_tensors_alone(reset, kernels, device):
    p = torch.randn(50, device=device, requires_grad=True)
    q = p.detach().clone().requires_grad_()
    ours, theirs = trainfuse.FusedAdamW([p]), torch.optim.AdamW([q], foreach=False)
    for _ in range(3):
        g = torch.randn(50, device=device)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
        if reset == "clear":
            ours.state.clear()
            theirs.state.clear()
        else:
            ours.state = defaultdict(dict)
            theirs.state = defaultdict(dict)
        # tensors of the old states' size, allocated right after the reset, must stay untouched
        bystanders = [torch.full((50,), 7.0, device=device) for _ in range(4)]
        torch.testing.assert_close(p, q, **TOL)
        ours.step()
        theirs.step()
        torch.testing.assert_close(p, q, **TOL)
        for b in bystanders:
            assert torch.equal(b, torch.full_like(b, 7.0))
        assert len(ours.state) == len(theirs.state) == 1


def test_momentum_turned_on_mid_training_matches_torch(kernels, device):
    p = torch.randn(40, device=device, requires_grad=True)
    q = p.detach().clone().requires_grad_()
    ours, theirs = trainfuse.FusedSGD([p], lr=0.1), torch.optim.SGD([q], lr=0.1, foreach=False)
    for step in range(5):
        if step == 2:
            ours.param_groups[0]["momentum"] = theirs.param_groups[0]["momentum"] = 0.9
        g = torch.randn(40, device=device)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
        torch.testing.assert_close(p, q, **TOL)
    torch.testing.assert_close(ours.state[p]["momentum_buffer"], theirs.state[q]["momentum_buffer"], **TOL)


def test_amsgrad_turned_on_over_existing_state_raises_keyerror_like_torch(kernels, device):
    p = torch.randn(40, device=device, requires_grad=True)
    q = p.detach().clone().requires_grad_()
    ours, theirs = trainfuse.FusedAdam([p]), torch.optim.Adam([q], foreach=False)
    p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
    ours.step()
    theirs.step()
    ours.param_groups[0]["amsgrad"] = theirs.param_groups[0]["amsgrad"] = True
    before = p.detach().clone()
    with pytest.raises(KeyError):
        theirs.step()
    with pytest.raises(KeyError, match="amsgrad"):
        ours.step()
    assert torch.equal(p.detach(), before)


@pytest.mark.parametrize("edit", ["append", "replace", "new list"])
def test_edited_param_list_is_followed_like_torch(edit, kernels, device):
    ps = [torch.randn(30, device=device, requires_grad=True) for _ in range(2)]
    qs = [p.detach().clone().requires_grad_() for p in ps]
    ours, theirs = trainfuse.FusedSGD(ps, lr=0.1, momentum=0.9), torch.optim.SGD(qs, lr=0.1, momentum=0.9)
    for step in range(4):
        if step == 1:
            new = torch.randn(17, device=device, requires_grad=True)
            twin = new.detach().clone().requires_grad_()
            if edit == "append":
                ours.param_groups[0]["params"].append(new)
                theirs.param_groups[0]["params"].append(twin)
            elif edit == "replace":
                ours.param_groups[0]["params"][0] = new
                theirs.param_groups[0]["params"][0] = twin
            else:
                ours.param_groups[0]["params"] = [*ours.param_groups[0]["params"], new]
                theirs.param_groups[0]["params"] = [*theirs.param_groups[0]["params"], twin]
        pairs = list(zip(ours.param_groups[0]["params"], theirs.param_groups[0]["params"]))
        for p, q in pairs:
            g = torch.randn_like(p)
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
        for p, q in pairs:
            torch.testing.assert_close(p, q, **TOL)


@pytest.mark.parametrize("clip", ["max_grad_norm", "max_grad_value"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_keep_clipping_and_train_identically(how, clip, kernels, device):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3).to(device)
    opt = trainfuse.FusedAdamW(model.parameters(), lr=0.05, **{clip: 0.01})
    x = torch.randn(8, 6, device=device)
    model(x).square().sum().backward()
    opt.step()
    if how == "deepcopy":
        model2, opt2 = copy.deepcopy((model, opt))
    else:
        model2, opt2 = pickle.loads(pickle.dumps((model, opt)))
    assert (opt2.max_grad_norm, opt2.max_grad_value) == (opt.max_grad_norm, opt.max_grad_value)
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).square().sum().backward()
        o.step()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(p.grad, q.grad)
    if clip == "max_grad_norm":
        torch.testing.assert_close(opt2.grad_norm, opt.grad_norm, rtol=0, atol=0)
    else:  # the clamp bit: the grads left in .grad reach the bound
        assert all(float(p.grad.abs().max()) == pytest.approx(0.01) for p in model.parameters())


def test_copies_keep_an_attached_ema_folded_in(kernels, device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).to(device)
    opt = trainfuse.FusedSGD(model.parameters(), lr=0.1, momentum=0.9)
    ema = trainfuse.FusedEMA(model, decay=0.9, tau=2)
    opt.attach_ema(ema)
    x = torch.randn(8, 4, device=device)
    model(x).sum().backward()
    opt.step()
    model2, opt2, ema2 = copy.deepcopy((model, opt, ema))
    assert ema2.attached is opt2
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).sum().backward()
        o.step()
    for a, b in zip(ema.ema.state_dict().values(), ema2.ema.state_dict().values()):
        assert torch.equal(a, b)
    assert ema2.updates == ema.updates == 2


def test_grad_norm_is_none_when_no_step_computed_a_norm(kernels, device):
    p = torch.randn(20, device=device, requires_grad=True)
    opt = trainfuse.FusedSGD([p], lr=0.1)
    scaler = trainfuse.amp.GradScaler(device.type, init_scale=2.0**4)
    scaler.scale((p * 2).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert opt.grad_norm is None
    clipped = trainfuse.FusedSGD([p], lr=0.1, max_grad_norm=1.0)
    assert clipped.grad_norm is None
    p.grad = torch.full_like(p, 3.0)
    clipped.step()
    torch.testing.assert_close(clipped.grad_norm.cpu(), torch.linalg.vector_norm(torch.full((20,), 3.0)))


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_state_dict_is_plain_and_loads_with_weights_only(cls, kernels, device):
    import io

    p = torch.randn(10, device=device, requires_grad=True)
    opt = cls([p], lr=0.1, **({"momentum": 0.9} if cls is trainfuse.FusedSGD else {}))
    p.grad = torch.randn_like(p)
    opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert all(type(v) is dict for v in loaded["state"].values())
    theirs = TORCH_CLASS[cls]([p.detach().clone().requires_grad_()], lr=0.1)
    theirs.load_state_dict(loaded)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_max_grad_norm_on_the_torch_path_clips_like_torch(cls, monkeypatch):
    monkeypatch.setenv("TRAINFUSE_BACKEND", "torch")
    p = torch.randn(30, requires_grad=True)
    q = p.detach().clone().requires_grad_()
    ours = cls([p], lr=0.1, max_grad_norm=0.5)
    theirs = TORCH_CLASS[cls]([q], lr=0.1, foreach=False)
    for _ in range(3):
        g = torch.randn(30) * 10
        p.grad, q.grad = g.clone(), g.clone()
        norm = torch.nn.utils.clip_grad_norm_([q], 0.5)
        ours.step()
        theirs.step()
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        torch.testing.assert_close(ours.grad_norm, norm, rtol=0, atol=0)
