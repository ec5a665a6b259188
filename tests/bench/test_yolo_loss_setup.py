"""``python -m trainfuse.bench yolo-loss``'s setup on the CPU, for a one-branch head (yolov5n) and an
end-to-end one (yolo26n) at a tiny size (batch 2, 64 px, 3 classes: 84 anchors): the predictions
have the structure the loss takes in training with every boxes and scores tensor a leaf, the stock
loss (``v8DetectionLoss``, ``E2ELoss``) and the fused one (FusedDetectionLoss, FusedE2ELoss: the
torch path on CPU) run forward + backward on them, and their items and every leaf's grad agree as
the benchmark measures them. The setup seeds itself, so the inputs are the same on every run."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from trainfuse.ultralytics.offline import offline_env

offline_env(Path(tempfile.gettempdir()) / "trainfuse-tests-yolo-config")
pytest.importorskip("ultralytics")

from trainfuse.bench.yolo_loss import _agreement, _criteria, _fwd_bwd, _leaves, _setup, family  # noqa: E402
from trainfuse.losses.detection.targets import PADDED_KEY  # noqa: E402

BRANCH = {"boxes", "scores", "feats"}
# model: (its head's train-mode output keys, the leaves, the stock and fused losses)
MODELS = {
    "yolov5n.yaml": (BRANCH, ["boxes", "scores"], ("v8DetectionLoss", "FusedDetectionLoss")),
    "yolo26n.yaml": ({"one2many", "one2one"},
                     ["one2many.boxes", "one2many.scores", "one2one.boxes", "one2one.scores"],
                     ("E2ELoss", "FusedE2ELoss")),
}


@pytest.fixture(scope="module", params=list(MODELS))
def setup(request):
    model = request.param
    return model, _setup(model, batch=2, imgsz=64, nc=3, dtype=torch.float32, device="cpu")


def test_predictions_are_the_train_mode_structure_with_boxes_and_scores_as_leaves(setup):
    model, (net, preds, plain, prepared) = setup
    keys, names, _ = MODELS[model]
    assert set(preds) == keys
    branches = [preds] if keys == BRANCH else [preds[b] for b in ("one2many", "one2one")]
    for branch in branches:
        assert set(branch) == BRANCH
        assert branch["boxes"].shape == (2, 4 * net.model[-1].reg_max, 84)
        assert branch["scores"].shape == (2, 3, 84)
        assert not any(f.requires_grad for f in branch["feats"])
    found = _leaves(preds)
    assert list(found) == names
    assert all(t.is_leaf and t.requires_grad and t.device.type == "cpu" for t in found.values())
    assert plain["batch_idx"].numel() == 16 and PADDED_KEY not in plain and PADDED_KEY in prepared


def test_stock_and_fused_losses_are_the_models_and_name_their_rows(setup):
    model, (net, *_) = setup
    stock, fused, names = _criteria(net)
    stock_name, fused_name = MODELS[model][2]
    assert (type(stock).__name__, type(fused).__name__) == (stock_name, fused_name)
    assert names.stock == f"ultralytics {stock_name}"
    assert names.padded == f"trainfuse {fused_name}, labels padded on the CPU"
    assert names.plain == f"trainfuse {fused_name}, plain batch (one sync)"


def test_stock_and_fused_agree_in_items_and_every_leafs_grad(setup):
    """Items within 1e-4 relative, each leaf's grad within 1e-5 of the stock grad's largest, and
    every stock grad nonzero (the agreement is not one of zeros)."""
    model, (net, preds, plain, prepared) = setup
    stock, fused, _ = _criteria(net)
    want, got, diffs = _agreement(stock, fused, preds, plain, prepared, amp=False)
    names = MODELS[model][1]
    assert set(diffs) == {f"{n}_grad" for n in names} | {"items_rel"}
    assert want.shape == got.shape == (3,) and (want > 0).all()
    assert diffs["items_rel"] < 1e-4
    for name in names:
        assert diffs[f"{name}_grad"] < 1e-5, name
    stock_grads = _fwd_bwd(stock, preds, plain, amp=False).captured()
    assert all(g.abs().max() > 0 for g in stock_grads)


def test_every_timed_step_runs_forward_and_backward_into_each_leaf(setup):
    """The three rows' steps (stock on the plain batch, fused on the padded and on the plain one)
    each fill every leaf's ``.grad``; the fused steps give the same grads."""
    _, (net, preds, plain, prepared) = setup
    stock, fused, _ = _criteria(net)
    grads = []
    for criterion, batch in ((stock, plain), (fused, prepared), (fused, plain)):
        _fwd_bwd(criterion, preds, batch, amp=False)()
        grads.append([t.grad.clone() for t in _leaves(preds).values()])
        assert all(torch.isfinite(g).all() and g.abs().max() > 0 for g in grads[-1])
    for padded, one_sync in zip(grads[1], grads[2]):
        torch.testing.assert_close(one_sync, padded, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("model, name", [("yolov5n.yaml", "yolo-loss"), ("yolo26n.yaml", "yolo-loss-yolo26n"),
                                         ("cfg/yolov10n.yaml", "yolo-loss-yolov10n")])
def test_results_are_named_for_the_model(model, name):
    assert family(model) == name
