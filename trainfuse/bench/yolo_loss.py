"""YOLO loss benchmark: ultralytics' detection loss against trainfuse's fused one, forward +
backward on fixed predictions of a detection model's batch (default yolov5n at batch 16, 640 px,
80 classes: 8,400 anchors; 8 labels per image), with the kernels each launches (torch.profiler),
the host syncs each makes, and, for one-branch heads, the TaskAlignedAssigner piece by piece.

``--model`` picks the model (a detection yaml). A one-branch head (yolov5n, yolov8n...) compares
``v8DetectionLoss`` with FusedDetectionLoss; an end-to-end head (yolo26n, yolov10n:
``takes_fused_e2e_loss``) compares ``E2ELoss`` with FusedE2ELoss, each on both branches'
predictions (one-to-many and one-to-one), as ``model.init_criterion()`` and FusedDetectionTrainer
pick them. The results are ``yolo-loss.json`` for yolov5n, ``yolo-loss-<model stem>.json`` for
another model.

The predictions come from one train-mode forward of a freshly initialized model under fp16
autocast (what the trainer hands the loss): every tensor detached, the boxes and scores of each
branch made grad-requiring leaves. ``--fp32`` adds the same in float32, where the two must agree
to fp32 tolerance (the agreement of the items and of every leaf's grad is printed and saved). The
fused loss runs twice: with the labels padded on the CPU (``add_padded_targets``, what
FusedDetectionTrainer does: no host sync, CUDA-graph capturable) and on the plain ultralytics
batch (one host sync for the capacity). Needs ultralytics (run offline: ``offline_env``)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from trainfuse.bench._common import (
    add_row,
    bench_parser,
    graph_ms,
    host_ms,
    kernel_ms,
    note,
    parse_and_start,
    print_table,
    save_report,
    wall_ms,
)

LABELS_PER_IMAGE = 8
DEFAULT_MODEL = "yolov5n.yaml"
DIFFERENTIATED = ("boxes", "scores")  # the prediction tensors the loss takes grads of, per branch


class Implementations(NamedTuple):
    """The implementations' names in the rows: stock, fused on padded labels, fused on the plain batch."""

    stock: str
    padded: str
    plain: str


def _implementations(e2e: bool) -> Implementations:
    """The row names of ``E2ELoss`` / FusedE2ELoss for an end-to-end head, else of
    ``v8DetectionLoss`` / FusedDetectionLoss."""
    stock, ours = ("E2ELoss", "FusedE2ELoss") if e2e else ("v8DetectionLoss", "FusedDetectionLoss")
    return Implementations(f"ultralytics {stock}", f"trainfuse {ours}, labels padded on the CPU",
                           f"trainfuse {ours}, plain batch (one sync)")


def family(model: str) -> str:
    """The results' name: ``yolo-loss`` for the default yolov5n, ``yolo-loss-<model stem>`` else."""
    return "yolo-loss" if model == DEFAULT_MODEL else f"yolo-loss-{Path(model).stem}"


def _as_leaves(out, dtype: torch.dtype, key: str | None = None):
    """``out`` (the train-mode forward's dict, nested per branch for an end-to-end head) with every
    tensor detached, and the boxes and scores cast to ``dtype`` as grad-requiring leaves."""
    if isinstance(out, dict):
        return {k: _as_leaves(v, dtype, k) for k, v in out.items()}
    if isinstance(out, (list, tuple)):
        return type(out)(_as_leaves(v, dtype, key) for v in out)
    if key in DIFFERENTIATED:
        return out.detach().to(dtype).requires_grad_()
    return out.detach()


def _leaves(preds: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """The grad-requiring tensors of ``preds`` by their path: ``boxes``, ``scores`` for one branch,
    ``one2many.boxes``, ..., ``one2one.scores`` for an end-to-end head."""
    found = {}
    for k, v in preds.items():
        if isinstance(v, dict):
            found.update(_leaves(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor) and v.requires_grad:
            found[f"{prefix}{k}"] = v
    return found


def _setup(model: str, batch: int, imgsz: int, nc: int, dtype: torch.dtype,
          device: str | torch.device = "cuda"):
    """(model, predictions, ultralytics batch on ``device``, the same with padded labels made on
    the CPU) for the detection yaml ``model``; ultralytics must be importable (``offline_env``
    first). The predictions are :func:`_as_leaves` of one train-mode forward of random images,
    under fp16 autocast for ``dtype=torch.float16``."""
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.modules.head import Detect, v10Detect
    from ultralytics.nn.tasks import DetectionModel

    from trainfuse.ultralytics import add_padded_targets

    device = torch.device(device)
    torch.manual_seed(0)
    net = DetectionModel(model, nc=nc, verbose=False).to(device).train()
    head = type(net.model[-1])
    if head not in (Detect, v10Detect):
        raise ValueError(f"--model {model}: expected a detection model (a Detect or v10Detect head), "
                         f"got a {head.__name__} head")
    net.args = get_cfg()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.float16, enabled=dtype == torch.float16):
        out = net(torch.rand(batch, 3, imgsz, imgsz, device=device))
    preds = _as_leaves(out, dtype)
    n = LABELS_PER_IMAGE * batch
    cpu = {"img": torch.zeros(batch, 1, 1, 1),
           "batch_idx": torch.arange(batch).repeat_interleave(LABELS_PER_IMAGE).float(),
           "cls": torch.randint(0, nc, (n, 1)).float(),
           "bboxes": torch.cat([torch.rand(n, 2) * 0.6 + 0.2, torch.rand(n, 2) * 0.2 + 0.05], 1)}
    plain = {k: v.to(device) for k, v in cpu.items()}
    prepared = {k: v.to(device) for k, v in add_padded_targets(dict(cpu)).items()}
    return net, preds, plain, prepared


def _criteria(model: torch.nn.Module):
    """(stock loss, fused loss, their row names): ultralytics' ``model.init_criterion()``
    (``E2ELoss`` for an end-to-end head, else ``v8DetectionLoss``) and its fused counterpart."""
    from trainfuse.ultralytics import FusedDetectionLoss, FusedE2ELoss, takes_fused_e2e_loss

    e2e = takes_fused_e2e_loss(model)
    fused = FusedE2ELoss(model) if e2e else FusedDetectionLoss(model)
    return model.init_criterion(), fused, _implementations(e2e)


def _fwd_bwd(criterion, preds, batch, amp: bool):
    """One forward + backward of ``criterion`` (grads into every leaf's ``.grad``);
    ``.captured()`` returns the leaves' grads instead (what a CUDA graph captures)."""
    inputs = list(_leaves(preds).values())
    device_type = inputs[0].device.type

    def step():
        for t in inputs:
            t.grad = None
        with torch.autocast(device_type, dtype=torch.float16, enabled=amp):
            loss, _ = criterion(preds, batch)
        loss.sum().backward()

    def captured():
        with torch.autocast(device_type, dtype=torch.float16, enabled=amp):
            loss, _ = criterion(preds, batch)
        return torch.autograd.grad(loss.sum(), inputs)

    step.captured = captured
    return step


def _launches(fn) -> tuple[int, int]:
    """(kernels, memcpy/memset) on the GPU during one call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = sum(n.startswith(("Memcpy", "Memset")) for n in names)
    return len(names) - copies, copies


def _syncs(fn) -> int:
    """Host syncs during one call, as torch's sync debug mode reports them."""
    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def _timings(fn, quick: bool, graph: bool) -> dict:
    reps = dict(warmup=5, rep=20) if quick else {}
    out = {"do_bench_ms": kernel_ms(fn, **reps),
           "wall_ms": wall_ms(fn, iters=10, repeats=2) if quick else wall_ms(fn, iters=50),
           "host_ms": host_ms(fn, iters=10 if quick else 100)}
    if graph:
        try:
            out["graph_ms"] = graph_ms(fn.captured)
        except Exception as e:  # noqa: BLE001 - report a failed capture, keep measuring
            out["graph_ms"] = None
            out["graph_error"] = str(e).splitlines()[0][:100]
    return out


def _agreement(stock, fused, preds, plain, prepared, amp: bool):
    """(stock items, fused items, differences): the loss items of ``stock`` on the plain batch and
    of ``fused`` on the padded one, and their largest relative difference (``items_rel``) and of
    each leaf's grad (``<leaf>_grad``: the largest difference over the stock grad's largest
    magnitude)."""
    device_type = next(iter(_leaves(preds).values())).device.type
    pairs = ((stock, plain), (fused, prepared))
    with torch.no_grad(), torch.autocast(device_type, dtype=torch.float16, enabled=amp):
        items = [torch.stack(list(c(preds, b)[1].values())).float() for c, b in pairs]
    want, got = (_fwd_bwd(c, preds, b, amp).captured() for c, b in pairs)
    diffs = {f"{name}_grad": ((g.float() - w.float()).abs().max() / w.float().abs().max()).item()
             for name, g, w in zip(_leaves(preds), got, want)}
    diffs["items_rel"] = ((items[1] - items[0]).abs() / items[0].abs().clamp(min=1e-12)).max().item()
    return items[0], items[1], diffs


def _loss_rows(report, model, preds, plain, prepared, amp, label, quick):
    stock, fused, names = _criteria(model)
    impls = {names.stock: (_fwd_bwd(stock, preds, plain, amp), False),
             names.padded: (_fwd_bwd(fused, preds, prepared, amp), True),
             names.plain: (_fwd_bwd(fused, preds, plain, amp), True)}
    want, got, diffs = _agreement(stock, fused, preds, plain, prepared, amp)
    report.setdefault("agreement", {})[label] = diffs
    grads = ", ".join(f"{k.removesuffix('_grad')} {v:.2e}" for k, v in diffs.items() if k != "items_rel")
    print(f"\n{label}: items {want.tolist()} (ultralytics) vs {got.tolist()} (trainfuse): "
          f"max rel diff {diffs['items_rel']:.2e}; grads max diff / max grad: {grads}")
    rows, base = [], None
    for name, (fn, ours) in impls.items():
        t = _timings(fn, quick, graph=name == names.padded)
        kernels, copies = _launches(fn)
        syncs = _syncs(fn)
        base = base or t
        add_row(report, f"loss forward + backward, {label}", name, trainfuse=ours,
                **{k: v for k, v in t.items() if k != "graph_error"})
        report.setdefault("launches", {})[f"{label} | {name}"] = {"kernels": kernels, "copies": copies,
                                                                  "syncs": syncs}
        g = t.get("graph_ms")
        rows.append([name, f"{t['do_bench_ms']:.3f}", f"{t['wall_ms']:.3f}", f"{t['host_ms']:.3f}",
                     "" if g is None else f"{g:.3f}", f"{base['do_bench_ms'] / t['do_bench_ms']:.1f}x",
                     f"{kernels} + {copies}", str(syncs)])
        if t.get("graph_error"):
            note(report, f"{label} {name}: CUDA-graph capture failed: {t['graph_error']}")
    print_table(f"Loss forward + backward, {label} (speed-up over ultralytics by do_bench)",
                ["implementation", "do_bench ms", "wall ms", "host ms", "graph ms", "speed-up",
                 "kernels + copies", "syncs"], rows)


def _assigner_rows(report, model, preds, plain, prepared, quick):
    """Each assigner piece, ultralytics' and ours, on the float32 view of the same predictions (of
    a one-branch head)."""
    from ultralytics.utils.loss import v8DetectionLoss
    from ultralytics.utils.tal import make_anchors

    from trainfuse.losses.detection import assigner as tal
    from trainfuse.losses.detection.targets import anchor_grid
    from trainfuse.ultralytics import FusedDetectionLoss

    stock, fused = v8DetectionLoss(model), FusedDetectionLoss(model)
    boxes, scores = preds["boxes"].detach().float(), preds["scores"].detach().float()
    B, _, A = scores.shape
    feats, device = preds["feats"], boxes.device
    # ultralytics' inputs, as get_assigned_targets_and_loss makes them
    anchors, stride_t = make_anchors(feats, stock.stride, 0.5)
    imgsz = torch.tensor(feats[0].shape[2:], device=device, dtype=torch.float32) * stock.stride[0]
    t = torch.cat((plain["batch_idx"].view(-1, 1), plain["cls"].view(-1, 1), plain["bboxes"]), 1)
    t = stock.preprocess(t, B, scale_tensor=imgsz[[1, 0, 1, 0]])
    gt_labels, gt_bboxes = t.split((1, 4), 2)
    mask_gt = gt_bboxes.sum(2, keepdim=True).gt_(0.0)
    pd_scores = scores.permute(0, 2, 1).contiguous().sigmoid()
    pd_bboxes = stock.bbox_decode(anchors, boxes.permute(0, 2, 1).contiguous()) * stride_t
    anc = anchors * stride_t
    a = stock.assigner
    a.bs, a.n_max_boxes = B, gt_bboxes.shape[1]
    in_gts = a.select_candidates_in_gts(anc, gt_bboxes, mask_gt)
    align, ov = a.get_box_metrics(pd_scores, pd_bboxes, gt_labels, gt_bboxes, in_gts * mask_gt)
    topk_mask = mask_gt.expand(-1, -1, a.topk).bool()
    mask_pos, align, ov = a.get_pos_mask(pd_scores, pd_bboxes, gt_labels, gt_bboxes, anc, mask_gt)
    gidx, fg, _ = a.select_highest_overlaps(mask_pos, ov, a.n_max_boxes, align)
    ultra = {
        "in-box test": lambda: a.select_candidates_in_gts(anc, gt_bboxes, mask_gt),
        "CIoU + scores + metric": lambda: a.get_box_metrics(pd_scores, pd_bboxes, gt_labels, gt_bboxes,
                                                            in_gts * mask_gt),
        "top-k": lambda: a.select_topk_candidates(align, topk_mask=topk_mask),
        "resolve (select_highest_overlaps)":
            lambda: a.select_highest_overlaps(mask_pos, ov, a.n_max_boxes, align),
        "targets (get_targets)": lambda: a.get_targets(gt_labels, gt_bboxes, gidx, fg),
        "whole assigner": lambda: a(pd_scores, pd_bboxes, anc, gt_labels, gt_bboxes, mask_gt),
    }
    sizes = tuple((f.shape[2], f.shape[3]) for f in feats)
    strides = tuple(float(s) for s in fused.stride.tolist())
    anchors2, strides2 = anchor_grid(sizes, strides, device)
    strides2 = strides2.view(-1)
    gt = fused.targets(prepared, B, device)
    px = (sizes[0][0] * strides[0], sizes[0][1] * strides[0])
    cfg = fused.assign_config
    m_align, m_ov, m_cand, pa, po = tal.metric(boxes, scores, gt, px, anchors2, strides2, cfg)
    sel = tal.topk_mask(m_align, cfg.topk)
    g2 = tal.resolve(sel, m_cand, m_align, m_ov, pa, po)
    ours = {
        "in-box + CIoU + scores + metric (one kernel, DFL decode included)":
            lambda: tal.metric(boxes, scores, gt, px, anchors2, strides2, cfg),
        "top-k (one kernel: k rounds of argmax per row)": lambda: tal.topk_mask(m_align, cfg.topk),
        "top-k as torch.topk + scatter (not used; for comparison)":
            lambda: tal.topk_mask_torch(m_align, cfg.topk),
        "resolve (one kernel)": lambda: tal.resolve(sel, m_cand, m_align, m_ov, pa, po),
        "target scores + tss (one kernel)": lambda: tal.target_scores(g2, m_align, pa, po, gt, cfg),
        "whole assigner": lambda: tal.assign_kernels(boxes, scores, gt, px, anchors2, strides2, cfg),
    }
    rows = []
    reps = dict(warmup=5, rep=20) if quick else {}
    for impl, pieces in (("ultralytics", ultra), ("trainfuse", ours)):
        for piece, fn in pieces.items():
            k = kernel_ms(fn, **reps)
            w = wall_ms(fn, iters=10, repeats=2) if quick else wall_ms(fn, iters=50)
            add_row(report, f"TaskAlignedAssigner: {piece}", impl, trainfuse=impl == "trainfuse",
                    do_bench_ms=k, wall_ms=w)
            rows.append([impl, piece, f"{k:.3f}", f"{w:.3f}"])
    print_table(f"TaskAlignedAssigner pieces, {B} x {gt.shape[1]} labels x {A} anchors (float32 predictions)",
                ["impl", "piece", "do_bench ms", "wall ms"], rows)


def main(argv=None):
    parser = bench_parser("yolo-loss", __doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="the detection model's yaml: yolov5n.yaml, yolov8n.yaml..., or an end-to-end "
                             "one (yolo26n.yaml, yolov10n.yaml: E2ELoss against FusedE2ELoss)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--nc", type=int, default=80)
    parser.add_argument("--fp32", action="store_true", help="also time float32 predictions without autocast")
    parser.add_argument("--quick", action="store_true", help="few repetitions: a smoke run")
    started = parse_and_start(parser, argv, "yolo-loss")
    if started is None:
        return
    args, report, _ = started
    name = family(args.model)
    report["_bench"] = "yolo-loss"
    from trainfuse.ultralytics.offline import offline_env

    offline_env()  # before ultralytics is imported
    try:
        import ultralytics  # noqa: F401
    except ImportError:
        note(report, "ultralytics is not installed: nothing to compare against")
        save_report(report, args.out, name)
        return
    from trainfuse.ultralytics import takes_fused_e2e_loss

    shape = f"{Path(args.model).stem} batch {args.batch}, {args.imgsz} px, nc {args.nc}"
    report["workload"] = {"model": args.model, "batch": args.batch, "imgsz": args.imgsz, "nc": args.nc,
                          "labels_per_image": LABELS_PER_IMAGE}
    dtypes = [(torch.float16, "AMP fp16 predictions")] + ([(torch.float32, "fp32")] if args.fp32 else [])
    for dtype, label in dtypes:
        model, preds, plain, prepared = _setup(args.model, args.batch, args.imgsz, args.nc, dtype)
        amp = dtype == torch.float16
        _loss_rows(report, model, preds, plain, prepared, amp, f"{shape}, {label}", args.quick)
    if takes_fused_e2e_loss(model):
        note(report, f"{args.model}: no TaskAlignedAssigner piece rows (they time one branch's assigner; "
                     "an end-to-end head runs two, inside the loss rows)")
    else:
        model, preds, plain, prepared = _setup(args.model, args.batch, args.imgsz, args.nc, torch.float32)
        _assigner_rows(report, model, preds, plain, prepared, args.quick)
    save_report(report, args.out, name)


__all__ = ["main"]
