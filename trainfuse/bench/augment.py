"""Augmentation benchmark: the warp, HSV jitter, flip and RGB swap of a YOLO training batch (16
images, 640 px, from mosaic-sized crops as ultralytics' default ``scale=0.5`` leaves them), three
ways:

- ultralytics' own transforms on the CPU, one image after another on one core, as one loader
  worker runs them (``cv2.warpAffine``, ``RandomHSV``, ``np.fliplr``, the channel swap): the anchor;
- the torch reference of the kernel on the GPU (:func:`~trainfuse.ultralytics.augment.kernel.
  augment_images_reference`);
- the Triton kernel (:func:`~trainfuse.ultralytics.augment.kernel.augment_images`), with its
  bandwidth floor: the crops read once and the batch written once over the copy bandwidth.

GPU rows: the median of ``triton.testing.do_bench``; the CPU row: wall ms per batch.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from trainfuse.bench._common import (
    add_row,
    bench_parser,
    kernel_ms,
    parse_and_start,
    print_table,
    save_report,
)


def _batch(n: int, imgsz: int, seed: int = 0) -> dict:
    """``n`` mosaic-sized crops (the part of a 2x canvas a warp of scale 0.5-1.5 reads), their
    matrices, flips and HSV tables, drawn as ultralytics' defaults draw them."""
    from trainfuse.ultralytics.augment.color import hsv_luts

    rng = np.random.default_rng(seed)
    crops, matrices, flips, gains = [], [], [], []
    for _ in range(n):
        s = rng.uniform(0.5, 1.5)
        side = min(2 * imgsz, int(math.ceil(imgsz / s)) + 2)
        crops.append(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))
        t = rng.uniform(0.4, 0.6, 2) * imgsz
        m = np.array([[s, 0, t[0] - s * side / 2], [0, s, t[1] - s * side / 2], [0, 0, 1]], dtype=np.float32)
        matrices.append(m)
        flips.append((False, bool(rng.random() < 0.5)))
        gains.append(rng.uniform(-1, 1, 3) * (0.015, 0.7, 0.4))
    luts = hsv_luts(torch.tensor(np.array(gains)))
    return {"crops": crops, "matrices": matrices, "flips": flips, "gains": np.array(gains), "luts": luts}


def _packed(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch as the kernel takes it (:func:`~trainfuse.ultralytics.augment.kernel.pack_crops`):
    whole crops (origin 0), written as RGB."""
    from trainfuse.ultralytics.augment.kernel import pack_crops

    n = len(batch["crops"])
    inverse = np.stack([np.linalg.inv(m.astype(np.float64)) for m in batch["matrices"]]).reshape(n, 9)
    return pack_crops([torch.from_numpy(c) for c in batch["crops"]], torch.from_numpy(inverse),
                      torch.zeros(n, 2), torch.tensor(batch["flips"]), torch.ones(n))


def _cpu_ms(batch: dict, imgsz: int, repeats: int = 3) -> float:
    """ultralytics' CPU transforms on the batch, one image at a time (one worker's work)."""
    import cv2
    from ultralytics.data.augment import RandomHSV

    cv2.setNumThreads(0)
    hsv = RandomHSV(0.015, 0.7, 0.4)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for img, m, (_, fl) in zip(batch["crops"], batch["matrices"], batch["flips"]):
            out = cv2.warpAffine(img, m[:2], (imgsz, imgsz), borderValue=(114, 114, 114))
            np.random.seed(0)  # RandomHSV draws its own gains: the work, not these numbers, is timed
            out = hsv.apply_image({"img": out})["img"]
            out = np.fliplr(out) if fl else out
            np.ascontiguousarray(out.transpose(2, 0, 1)[::-1])
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> dict | None:
    parser = bench_parser("augment", __doc__)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--imgsz", type=int, default=640)
    started = parse_and_start(parser, argv, "augment")
    if started is None:
        return None
    args, report, bandwidth = started
    from trainfuse.ultralytics.augment.color import opencv_vector_block
    from trainfuse.ultralytics.augment.kernel import augment_images, augment_images_reference

    report["headline"] = "do_bench_ms"
    batch = _batch(args.batch, args.imgsz)
    packed, table = _packed(batch)
    packed, table, luts = packed.cuda(), table.cuda(), batch["luts"].cuda()
    size, block = (args.imgsz, args.imgsz), opencv_vector_block()
    kernel = kernel_ms(lambda: augment_images(packed, table, luts, size, False, block))
    reference = kernel_ms(lambda: augment_images_reference(packed, table, luts, size, False, block))
    cpu = _cpu_ms(batch, args.imgsz)
    moved = packed.numel() + args.batch * 3 * args.imgsz ** 2  # the crops read, the batch written
    floor = moved / bandwidth * 1e3  # bandwidth: bytes/s, read + write
    workload = (f"warp + HSV + flip + RGB, batch {args.batch}, {args.imgsz} px, from crops of "
                f"{packed.numel() / args.batch / 3 / args.imgsz ** 2:.2f}x the output")
    add_row(report, workload, "ultralytics on the CPU (one worker)", trainfuse=False, wall_ms=cpu)
    add_row(report, workload, "torch reference (GPU)", trainfuse=False, do_bench_ms=reference)
    add_row(report, workload, "augment_images (Triton)", trainfuse=True, do_bench_ms=kernel, floor_ms=floor)
    report["summary_skip"] = [workload]  # a kernel against its own reference: the docs' table only
    print_table(workload, ["implementation", "ms per batch", "% of floor"],
                [["ultralytics on the CPU (one worker)", f"{cpu:.2f}", ""],
                 ["torch reference (GPU)", f"{reference:.3f}", ""],
                 ["augment_images (Triton)", f"{kernel:.3f}", f"{100 * floor / kernel:.0f}%"]])
    save_report(report, args.out, "augment")
    return report


__all__ = ["main"]
