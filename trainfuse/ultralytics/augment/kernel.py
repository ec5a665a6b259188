"""``RandomPerspective``'s warp, ``RandomHSV``, ``RandomFlip`` and ``Format``'s BGR to RGB swap of
a whole batch in one pass: each output pixel reads its four source pixels, blends them, jitters the
colour and is written once, as the ``(N, 3, H, W)`` uint8 batch ultralytics' collate makes.

The sources are the loader's pre-warp images (a mosaic, or one resized image), each cropped to the
part the warp reads and packed one after another, HWC BGR uint8, into one flat buffer: a batch
moves about 1.3x the bytes of its output instead of 4x a mosaic's (see
:mod:`trainfuse.ultralytics.augment.deferred`).

Per image the kernel takes one row of a float64 table (:func:`pack_crops`: where the crop is, the
inverse warp, the crop's origin, the flips, whether to swap to RGB) and the three lookup tables
``RandomHSV`` built.

Arithmetic, as OpenCV's for uint8 images:

- ``warpAffine`` / ``warpPerspective`` with ``INTER_LINEAR``, as OpenCV 5 computes them: the
  source point in float64 (not rounded to 1/32 pixel as OpenCV 4's fixed-point path did), the four
  weights and the blend in float32, rounded half to even, ultralytics' grey (114) for each
  neighbour outside the image. On OpenCV 5.0 the affine warp matches ``cv2.warpAffine`` exactly in
  our tests; against OpenCV 4 a pixel may differ by a few levels where neighbours differ a lot.
- ``COLOR_BGR2HSV``: OpenCV's integer formula and 12-bit reciprocal tables, exactly.
- ``COLOR_HSV2BGR``: its float formula (the torch path's
  :func:`~trainfuse.ultralytics.augment.color.hsv_to_bgr`), rounded half to even as OpenCV's
  scalar path rounds, or down in the columns its vectorized path covers on OpenCV 5
  (``vector_block``; the loader asks the installed OpenCV,
  :func:`~trainfuse.ultralytics.augment.color.opencv_vector_block`).

:func:`augment_images` runs the Triton kernel on CUDA tensors (or under ``TRAINFUSE_BACKEND=triton``)
and :func:`augment_images_reference`, the same arithmetic in torch, elsewhere; the tests hold
both against each other and against ultralytics' transforms.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from trainfuse._runtime.backend import use_triton
from trainfuse.ultralytics.augment.color import _tables, bgr_to_hsv, hsv_to_bgr

BORDER = 114
_BLOCK = 256
TABLE = 17  # per image: start, height, width, inverse (9), origin x, y, flip v, h, swap to RGB


@functools.cache
def _hsv_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    sdiv, hdiv = _tables(device)
    return sdiv.to(torch.int32), hdiv.to(torch.int32)


@triton.jit
def _clamp_q(q):
    """A coordinate clamped far outside any image (there all four neighbours are the border)."""
    return tl.minimum(tl.maximum(q, -(2.0 ** 24)), 2.0 ** 24)


@triton.jit
def _rint(x):
    """Round half to even (``torch.round``, OpenCV's ``cvRound``)."""
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r.to(tl.int32) & 1) == 1
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _hsv_channel(sector, v, p, q, t, which: tl.constexpr):
    """Channel ``which`` (0 b, 1 g, 2 r) of OpenCV's HSV2BGR sector table, from the values v, p =
    v(1-s), q = v(1-sf), t = v(1-s(1-f))."""
    if which == 0:  # b: p p t v v q
        out = tl.where(sector < 2, p, tl.where(sector == 2, t, tl.where(sector < 5, v, q)))
    elif which == 1:  # g: t v v q p p
        out = tl.where(sector == 0, t, tl.where(sector < 3, v, tl.where(sector == 3, q, p)))
    else:  # r: v q p p t v
        out = tl.where(sector == 0, v,
                       tl.where(sector == 1, q, tl.where(sector < 4, p, tl.where(sector == 4, t, v))))
    return out


@triton.jit
def _blend(src, row0, row1, c, m00, m01, m10, m11, w00, w01, w10, w11):
    """Channel ``c`` of the bilinear blend of four neighbours (grey outside), rounded as OpenCV."""
    acc = tl.load(src + row0 + c, mask=m00, other=114).to(tl.float32) * w00
    acc += tl.load(src + row0 + 3 + c, mask=m01, other=114).to(tl.float32) * w01
    acc += tl.load(src + row1 + c, mask=m10, other=114).to(tl.float32) * w10
    acc += tl.load(src + row1 + 3 + c, mask=m11, other=114).to(tl.float32) * w11
    return tl.minimum(tl.maximum(_rint(acc), 0.0), 255.0).to(tl.int32)


@triton.jit
def _augment_kernel(src, table, luts, sdiv, hdiv, out, H, W,
                    vector_end, TABLE: tl.constexpr, HSV: tl.constexpr, PERSPECTIVE: tl.constexpr,
                    BLOCK: tl.constexpr):
    n = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < H * W
    y = offs // W
    x = offs % W
    # the flips: this output pixel shows the warped image's pixel (xw, yw)
    row = table + TABLE * n
    xw = tl.where(tl.load(row + 15) != 0.0, W - 1 - x, x)
    x = xw.to(tl.float64)
    y = tl.where(tl.load(row + 14) != 0.0, H - 1 - y, y).to(tl.float64)
    start = tl.load(row + 0).to(tl.int64)
    h = tl.load(row + 1).to(tl.int32)
    w = tl.load(row + 2).to(tl.int32)
    m = row + 3
    sx = tl.load(m + 0) * x + tl.load(m + 1) * y + tl.load(m + 2)
    sy = tl.load(m + 3) * x + tl.load(m + 4) * y + tl.load(m + 5)
    if PERSPECTIVE:
        z = tl.load(m + 6) * x + tl.load(m + 7) * y + tl.load(m + 8)
        z = tl.where(z != 0.0, 1.0 / z, 0.0)
        sx = sx * z
        sy = sy * z
    sx = _clamp_q(sx)
    sy = _clamp_q(sy)
    fx0 = tl.floor(sx)
    fy0 = tl.floor(sy)
    fx = (sx - fx0).to(tl.float32)
    fy = (sy - fy0).to(tl.float32)
    # in the crop's pixels (the origin is whole pixels: exact)
    x0 = fx0.to(tl.int32) - tl.load(row + 12).to(tl.int32)
    y0 = fy0.to(tl.int32) - tl.load(row + 13).to(tl.int32)
    w00 = (1.0 - fx) * (1.0 - fy)
    w01 = fx * (1.0 - fy)
    w10 = (1.0 - fx) * fy
    w11 = fx * fy
    in_x0 = (x0 >= 0) & (x0 < w)
    in_x1 = (x0 + 1 >= 0) & (x0 + 1 < w)
    in_y0 = (y0 >= 0) & (y0 < h)
    in_y1 = (y0 + 1 >= 0) & (y0 + 1 < h)
    row0 = start + (y0.to(tl.int64) * w + x0) * 3
    row1 = row0 + w.to(tl.int64) * 3
    m00 = live & in_y0 & in_x0
    m01 = live & in_y0 & in_x1
    m10 = live & in_y1 & in_x0
    m11 = live & in_y1 & in_x1
    b = _blend(src, row0, row1, 0, m00, m01, m10, m11, w00, w01, w10, w11)
    g = _blend(src, row0, row1, 1, m00, m01, m10, m11, w00, w01, w10, w11)
    r = _blend(src, row0, row1, 2, m00, m01, m10, m11, w00, w01, w10, w11)
    if HSV:
        v = tl.maximum(tl.maximum(b, g), r)
        diff = v - tl.minimum(tl.minimum(b, g), r)
        s = (diff * tl.load(sdiv + v) + 2048) >> 12
        hh = tl.where(v == r, g - b, tl.where(v == g, b - r + 2 * diff, r - g + 4 * diff))
        hh = (hh * tl.load(hdiv + diff) + 2048) >> 12
        hh = tl.where(hh < 0, hh + 180, hh)
        lut = luts + 768 * n
        hh = tl.load(lut + hh, mask=live, other=0).to(tl.float32)
        sf = tl.load(lut + 256 + s, mask=live, other=0).to(tl.float32) * (1.0 / 255.0)
        vf = tl.load(lut + 512 + v, mask=live, other=0).to(tl.float32) * (1.0 / 255.0)
        hf = hh * (6.0 / 180.0)
        hf = hf - 6.0 * tl.floor(hf / 6.0)
        sector = tl.minimum(tl.maximum(tl.floor(hf), 0.0), 5.0)
        f = hf - tl.floor(hf)
        sector = sector.to(tl.int32)
        p = vf * (1.0 - sf)
        q = vf * (1.0 - sf * f)
        t = vf * (1.0 - sf * (1.0 - f))
        grey = sf == 0.0
        b = tl.where(grey, vf, _hsv_channel(sector, vf, p, q, t, 0)) * 255.0
        g = tl.where(grey, vf, _hsv_channel(sector, vf, p, q, t, 1)) * 255.0
        r = tl.where(grey, vf, _hsv_channel(sector, vf, p, q, t, 2)) * 255.0
        down = xw < vector_end  # OpenCV 5's vectorized columns round down, the rest half to even
        b = tl.where(down, tl.floor(b), _rint(b))
        g = tl.where(down, tl.floor(g), _rint(g))
        r = tl.where(down, tl.floor(r), _rint(r))
        b = tl.minimum(tl.maximum(b, 0.0), 255.0).to(tl.int32)
        g = tl.minimum(tl.maximum(g, 0.0), 255.0).to(tl.int32)
        r = tl.minimum(tl.maximum(r, 0.0), 255.0).to(tl.int32)
    swap = tl.load(row + 16) != 0.0
    first = tl.where(swap, r, b)
    last = tl.where(swap, b, r)
    plane = out + n.to(tl.int64) * 3 * H * W + offs
    tl.store(plane, first.to(tl.uint8), mask=live)
    tl.store(plane + H * W, g.to(tl.uint8), mask=live)
    tl.store(plane + 2 * H * W, last.to(tl.uint8), mask=live)


def pack_crops(crops: list[torch.Tensor], inverse: torch.Tensor, origins: torch.Tensor,
               flips: torch.Tensor, swaps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's inputs for a batch: the crops' pixels one after another (flat uint8) and the
    per-image table, ``(N, TABLE)`` float64 (whole numbers are exact in it).

    Args:
        crops: N uint8 tensors ``(h, w, 3)``, BGR, contiguous (``h`` or ``w`` may be 0: an image
            the warp never reads).
        inverse: ``(N, 9)``, the inverse of each warp (output pixel ``(x, y, 1)`` to the pre-warp
            image's pixel), row-major.
        origins: ``(N, 2)``, where each crop starts in its pre-warp image (x, y).
        flips: ``(N, 2)``, whether to flip each output vertically, horizontally.
        swaps: ``(N,)``, whether to write the channels as RGB (ultralytics' ``Format``).
    """
    n = len(crops)
    for i, c in enumerate(crops):
        if c.dtype != torch.uint8 or c.dim() != 3 or c.shape[2] != 3:
            raise ValueError(f"pack_crops: crops[{i}] must be uint8 (h, w, 3), got {c.dtype} "
                             f"{tuple(c.shape)}")
    parts = {"inverse": (inverse, (n, 9)), "origins": (origins, (n, 2)), "flips": (flips, (n, 2)),
             "swaps": (swaps, (n,))}
    for name, (t, shape) in parts.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"pack_crops: {name} must have shape {shape} for {n} crops, "
                             f"got {tuple(t.shape)}")
    sizes = torch.tensor([c.numel() for c in crops], dtype=torch.float64)
    dims = torch.tensor([c.shape[:2] for c in crops], dtype=torch.float64).reshape(n, 2)
    columns = [t.reshape(n, shape[1] if len(shape) > 1 else 1).double() for t, shape in parts.values()]
    table = torch.cat([(torch.cumsum(sizes, 0) - sizes).reshape(n, 1), dims, *columns], 1)
    packed = torch.cat([c.reshape(-1) for c in crops]) if n else torch.zeros(0, dtype=torch.uint8)
    return packed, table


def augment_images_reference(packed: torch.Tensor, table: torch.Tensor, luts: torch.Tensor | None,
                             size: tuple[int, int], perspective: bool = False, vector_block: int = 0
                             ) -> torch.Tensor:
    """:func:`augment_images` in torch, the kernel's arithmetic op for op (any device)."""
    w_out, h_out = size
    n = table.shape[0]
    device = packed.device
    table = table.double()
    ys, xs = torch.meshgrid(torch.arange(h_out, device=device, dtype=torch.float64),
                            torch.arange(w_out, device=device, dtype=torch.float64), indexing="ij")
    x = torch.where(table[:, 15:16] != 0, w_out - 1 - xs.reshape(1, -1), xs.reshape(1, -1))
    y = torch.where(table[:, 14:15] != 0, h_out - 1 - ys.reshape(1, -1), ys.reshape(1, -1))
    m = table[:, 3:12].reshape(n, 9, 1)
    sx = m[:, 0] * x + m[:, 1] * y + m[:, 2]
    sy = m[:, 3] * x + m[:, 4] * y + m[:, 5]
    if perspective:
        z = m[:, 6] * x + m[:, 7] * y + m[:, 8]
        z = torch.where(z != 0, 1.0 / z, torch.zeros_like(z))
        sx, sy = sx * z, sy * z
    sx, sy = sx.clamp(-(2.0 ** 24), 2.0 ** 24), sy.clamp(-(2.0 ** 24), 2.0 ** 24)
    fx0, fy0 = torch.floor(sx), torch.floor(sy)
    fx, fy = (sx - fx0).float(), (sy - fy0).float()
    x0, y0 = fx0.long() - table[:, 12:13].long(), fy0.long() - table[:, 13:14].long()
    h, w, base = table[:, 1:2].long(), table[:, 2:3].long(), table[:, 0:1].long()
    flat = packed.reshape(-1).long()
    acc = []
    for c in range(3):
        total = torch.zeros_like(fx)
        for dy, dx, weight in ((0, 0, (1 - fx) * (1 - fy)), (0, 1, fx * (1 - fy)),
                               (1, 0, (1 - fx) * fy), (1, 1, fx * fy)):
            xx, yy = x0 + dx, y0 + dy
            inside = (xx >= 0) & (xx < w) & (yy >= 0) & (yy < h)
            index = torch.where(inside, base + (yy * w + xx) * 3 + c, torch.zeros_like(xx))
            value = torch.where(inside, flat[index] if flat.numel() else index, torch.full_like(xx, BORDER))
            total += value.float() * weight
        acc.append(torch.round(total).clamp(0, 255))
    img = torch.stack(acc, 1).view(n, 3, h_out, w_out).to(torch.uint8)  # BGR
    if luts is not None and img.numel():
        hsv = bgr_to_hsv(img).long().view(n, 3, h_out * w_out)
        moved = torch.gather(luts.long(), 2, hsv).view(n, 3, h_out, w_out)
        img = hsv_to_bgr(moved)
        if vector_block > 0:  # rounded down where the warped (unflipped) column is vectorized
            down = x.view(n, 1, h_out, w_out) < w_out - w_out % vector_block
            img = torch.where(down, hsv_to_bgr(moved, vector_block=1), img)
    swap = (table[:, 16] != 0).view(n, 1, 1, 1)
    return torch.where(swap, img.flip(1), img)


def augment_images(packed: torch.Tensor, table: torch.Tensor, luts: torch.Tensor | None,
                   size: tuple[int, int], perspective: bool = False, vector_block: int = 0) -> torch.Tensor:
    """Warp, colour-jitter, flip and channel-swap a packed batch: a new ``(N, 3, H, W)`` uint8 tensor.

    Args:
        packed: uint8, the images' HWC BGR pixels one after another (any shape; read flat).
        table: ``(N, TABLE)`` float64, per image where its pixels are, its warp, flips and channel
            order (:func:`pack_crops`).
        luts: ``(N, 3, 256)`` uint8, ``RandomHSV``'s hue, saturation and value tables, or None
            for no colour change (ultralytics' gains all zero).
        size: the output (width, height).
        perspective: divide by the third coordinate (``warpPerspective``).
        vector_block: HSV back to BGR rounds down in each row's first ``W - W % vector_block``
            columns, as OpenCV 5's vectorized ``COLOR_HSV2BGR`` does, and half to even in the rest
            (:func:`~trainfuse.ultralytics.augment.color.opencv_vector_block` tells; 0: everywhere).
    """
    if packed.dtype != torch.uint8:
        raise ValueError(f"augment_images: packed must be uint8, got {packed.dtype}")
    if table.dim() != 2 or table.shape[1] != TABLE or table.dtype != torch.float64:
        raise ValueError(f"augment_images: table must be float64 (N, {TABLE}) (pack_crops), got "
                         f"{table.dtype} {tuple(table.shape)}")
    n = table.shape[0]
    if luts is not None and (tuple(luts.shape) != (n, 3, 256) or luts.dtype != torch.uint8):
        raise ValueError(f"augment_images: luts must be uint8 ({n}, 3, 256), got {luts.dtype} "
                         f"{tuple(luts.shape)}")
    for name, t in (("table", table), ("luts", luts)):
        if t is not None and t.device != packed.device:
            raise ValueError(f"augment_images: {name} is on {t.device}, packed on {packed.device}")
    w_out, h_out = (int(v) for v in size)
    if w_out < 0 or h_out < 0:
        raise ValueError(f"augment_images: size must be (width, height) >= 0, got {size}")
    if not use_triton(packed.device):
        return augment_images_reference(packed, table, luts, (w_out, h_out), perspective, vector_block)
    out = torch.empty(n, 3, h_out, w_out, dtype=torch.uint8, device=packed.device)
    if out.numel() == 0:
        return out
    sdiv, hdiv = _hsv_tables(packed.device)
    grid = (triton.cdiv(h_out * w_out, _BLOCK), n)
    _augment_kernel[grid](packed.reshape(-1) if packed.numel() else packed.new_zeros(1), table.contiguous(),
                          luts.contiguous() if luts is not None else packed.new_zeros(1), sdiv, hdiv, out,
                          h_out, w_out, w_out - w_out % vector_block if vector_block > 0 else 0, TABLE=TABLE,
                          HSV=luts is not None, PERSPECTIVE=bool(perspective), BLOCK=_BLOCK)
    return out


__all__ = ["BORDER", "TABLE", "augment_images", "augment_images_reference", "pack_crops"]
