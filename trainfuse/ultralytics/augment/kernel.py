"""``RandomPerspective``'s warp, ``RandomHSV``, ``RandomFlip`` and ``Format``'s BGR to RGB swap of
a whole batch in one pass: each output pixel reads its four source pixels, blends them, jitters the
colour and is written once, as the ``(N, 3, H, W)`` uint8 batch ultralytics' collate makes.

The sources are HWC BGR uint8 images packed one after another into one flat buffer. Each output
image reads up to four of them, its *tiles*: rectangles of the pre-warp canvas (the mosaic's four
quadrants, or one resized image) that show a source's pixels; the rest of the canvas is
ultralytics' grey. A tile is a source cropped to the part the warp reads (the loader's workers
paint it), or a whole decoded image (:mod:`trainfuse.ultralytics.augment.decode`), so a batch
moves about 1.3x the bytes of its output instead of 4x a mosaic's (see
:mod:`trainfuse.ultralytics.augment.deferred`).

Per image the kernel takes one row of a float64 table (:func:`tile_table`: the inverse warp, the
flips, whether to swap to RGB, and per tile where its source starts, its size, its rectangle of
the canvas and where that rectangle starts in the source) and the three lookup tables
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

from trainfuse._runtime import precompile
from trainfuse._runtime.backend import interpreting, use_triton
from trainfuse._runtime.launch import cdiv
from trainfuse.ultralytics.augment.color import _tables, bgr_to_hsv, hsv_to_bgr

BORDER = 114
GPU_BLOCK = 256
# under the Triton interpreter a program's every operation costs Python overhead whatever its size:
# whole images a program (numpy does the pixels), where the GPU takes 256 pixels a program
INTERPRETER_BLOCK = 16384
TILES = 4  # tiles per output image at most (ultralytics' mosaic of four)
TILE = 9  # per tile: source start, height, width; canvas x1a, y1a, x2a, y2a; source x1b, y1b
TABLE = 12 + TILES * TILE  # per image: inverse (9), flip v, flip h, swap to RGB, then the tiles


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
def _pick(row, X, Y):
    """Where canvas pixel (X, Y) is in the packed sources: the flat index of its first channel in
    the last tile that holds it (tiles are painted in order), -1 where none does (grey)."""
    addr = tl.zeros_like(X).to(tl.int64) - 1
    for k in tl.static_range(4):
        t = row + 12 + 9 * k
        x1a = tl.load(t + 3).to(tl.int32)
        y1a = tl.load(t + 4).to(tl.int32)
        x2a = tl.load(t + 5).to(tl.int32)
        y2a = tl.load(t + 6).to(tl.int32)
        inside = (X >= x1a) & (X < x2a) & (Y >= y1a) & (Y < y2a)
        sy = (Y - y1a + tl.load(t + 8).to(tl.int32)).to(tl.int64)
        sx = (X - x1a + tl.load(t + 7).to(tl.int32)).to(tl.int64)
        addr = tl.where(inside, tl.load(t).to(tl.int64) + (sy * tl.load(t + 2).to(tl.int64) + sx) * 3, addr)
    return addr


@triton.jit
def _blend(src, a00, a01, a10, a11, live, c, w00, w01, w10, w11):
    """Channel ``c`` of the bilinear blend of four neighbours (grey outside), rounded as OpenCV."""
    acc = tl.load(src + a00 + c, mask=live & (a00 >= 0), other=114).to(tl.float32) * w00
    acc += tl.load(src + a01 + c, mask=live & (a01 >= 0), other=114).to(tl.float32) * w01
    acc += tl.load(src + a10 + c, mask=live & (a10 >= 0), other=114).to(tl.float32) * w10
    acc += tl.load(src + a11 + c, mask=live & (a11 >= 0), other=114).to(tl.float32) * w11
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
    xw = tl.where(tl.load(row + 10) != 0.0, W - 1 - x, x)
    x = xw.to(tl.float64)
    y = tl.where(tl.load(row + 9) != 0.0, H - 1 - y, y).to(tl.float64)
    sx = tl.load(row + 0) * x + tl.load(row + 1) * y + tl.load(row + 2)
    sy = tl.load(row + 3) * x + tl.load(row + 4) * y + tl.load(row + 5)
    if PERSPECTIVE:
        z = tl.load(row + 6) * x + tl.load(row + 7) * y + tl.load(row + 8)
        z = tl.where(z != 0.0, 1.0 / z, 0.0)
        sx = sx * z
        sy = sy * z
    sx = _clamp_q(sx)
    sy = _clamp_q(sy)
    fx0 = tl.floor(sx)
    fy0 = tl.floor(sy)
    fx = (sx - fx0).to(tl.float32)
    fy = (sy - fy0).to(tl.float32)
    w00 = (1.0 - fx) * (1.0 - fy)
    w01 = fx * (1.0 - fy)
    w10 = (1.0 - fx) * fy
    w11 = fx * fy
    x0 = fx0.to(tl.int32)  # the four neighbours on the canvas
    y0 = fy0.to(tl.int32)
    a00 = _pick(row, x0, y0)
    a01 = _pick(row, x0 + 1, y0)
    a10 = _pick(row, x0, y0 + 1)
    a11 = _pick(row, x0 + 1, y0 + 1)
    b = _blend(src, a00, a01, a10, a11, live, 0, w00, w01, w10, w11)
    g = _blend(src, a00, a01, a10, a11, live, 1, w00, w01, w10, w11)
    r = _blend(src, a00, a01, a10, a11, live, 2, w00, w01, w10, w11)
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
    swap = tl.load(row + 11) != 0.0
    first = tl.where(swap, r, b)
    last = tl.where(swap, b, r)
    plane = out + n.to(tl.int64) * 3 * H * W + offs
    tl.store(plane, first.to(tl.uint8), mask=live)
    tl.store(plane + H * W, g.to(tl.uint8), mask=live)
    tl.store(plane + 2 * H * W, last.to(tl.uint8), mask=live)


def tile_table(shapes: list[tuple[int, int]], tiles: list[list[tuple[int, ...]]], inverse: torch.Tensor,
               flips: torch.Tensor, swaps: torch.Tensor) -> torch.Tensor:
    """The kernel's per-image table, ``(N, TABLE)`` float64 (whole numbers are exact in it), for
    sources of ``shapes`` packed one after another (HWC, 3 channels) in this order.

    Args:
        shapes: ``(h, w)`` of each source (0 for an empty one).
        tiles: per output image, up to :data:`TILES` tiles ``(source, x1a, y1a, x2a, y2a, x1b, y1b)``:
            the canvas rectangle ``[y1a:y2a, x1a:x2a]`` shows ``source[y1b:, x1b:]``; a later tile
            covers an earlier one where they overlap.
        inverse: ``(N, 9)``, the inverse of each warp (output pixel ``(x, y, 1)`` to the canvas's),
            row-major.
        flips: ``(N, 2)``, whether to flip each output vertically, horizontally.
        swaps: ``(N,)``, whether to write the channels as RGB (ultralytics' ``Format``).
    """
    n = len(tiles)
    parts = {"inverse": (inverse, (n, 9)), "flips": (flips, (n, 2)), "swaps": (swaps, (n,))}
    for name, (t, shape) in parts.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"tile_table: {name} must have shape {shape} for {n} images, got "
                             f"{tuple(t.shape)}")
    starts, at = [], 0
    for h, w in shapes:
        starts.append(at)
        at += int(h) * int(w) * 3
    rows = torch.zeros(n, TILES, TILE, dtype=torch.float64)
    for i, image_tiles in enumerate(tiles):
        if len(image_tiles) > TILES:
            raise ValueError(f"tile_table: image {i} has {len(image_tiles)} tiles, at most {TILES}")
        for k, (src, x1a, y1a, x2a, y2a, x1b, y1b) in enumerate(image_tiles):
            h, w = shapes[src]
            if not (0 <= x1b and 0 <= y1b and x1b + max(x2a - x1a, 0) <= w and y1b + max(y2a - y1a, 0) <= h):
                raise ValueError(f"tile_table: image {i} tile {k} reads outside source {src} of {h}x{w}")
            rows[i, k] = torch.tensor([starts[src], h, w, x1a, y1a, x2a, y2a, x1b, y1b], dtype=torch.float64)
    columns = [t.reshape(n, shape[1] if len(shape) > 1 else 1).double() for t, shape in parts.values()]
    return torch.cat([*columns, rows.reshape(n, TILES * TILE)], 1)


def pack_crops(crops: list[torch.Tensor], inverse: torch.Tensor, origins: torch.Tensor,
               flips: torch.Tensor, swaps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's inputs for a batch of one crop per image: the crops' pixels one after another
    (flat uint8) and the table (:func:`tile_table`, each crop the one tile of its image).

    Args:
        crops: N uint8 tensors ``(h, w, 3)``, BGR, contiguous (``h`` or ``w`` may be 0: an image
            the warp never reads).
        inverse: as :func:`tile_table`'s.
        origins: ``(N, 2)``, where each crop starts on its canvas (x, y).
        flips, swaps: as :func:`tile_table`'s.
    """
    n = len(crops)
    for i, c in enumerate(crops):
        if c.dtype != torch.uint8 or c.dim() != 3 or c.shape[2] != 3:
            raise ValueError(f"pack_crops: crops[{i}] must be uint8 (h, w, 3), got {c.dtype} "
                             f"{tuple(c.shape)}")
    if tuple(origins.shape) != (n, 2):
        raise ValueError(f"pack_crops: origins must have shape {(n, 2)} for {n} crops, got "
                         f"{tuple(origins.shape)}")
    shapes = [tuple(c.shape[:2]) for c in crops]
    tiles = [[(i, ox, oy, ox + w, oy + h, 0, 0)]
             for i, ((h, w), (ox, oy)) in enumerate(zip(shapes, origins.int().tolist()))]
    table = tile_table(shapes, tiles, inverse, flips, swaps)
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
    x = torch.where(table[:, 10:11] != 0, w_out - 1 - xs.reshape(1, -1), xs.reshape(1, -1))
    y = torch.where(table[:, 9:10] != 0, h_out - 1 - ys.reshape(1, -1), ys.reshape(1, -1))
    m = table[:, 0:9].reshape(n, 9, 1)
    sx = m[:, 0] * x + m[:, 1] * y + m[:, 2]
    sy = m[:, 3] * x + m[:, 4] * y + m[:, 5]
    if perspective:
        z = m[:, 6] * x + m[:, 7] * y + m[:, 8]
        z = torch.where(z != 0, 1.0 / z, torch.zeros_like(z))
        sx, sy = sx * z, sy * z
    sx, sy = sx.clamp(-(2.0 ** 24), 2.0 ** 24), sy.clamp(-(2.0 ** 24), 2.0 ** 24)
    fx0, fy0 = torch.floor(sx), torch.floor(sy)
    fx, fy = (sx - fx0).float(), (sy - fy0).float()
    tiles = table[:, 12:].reshape(n, TILES, TILE, 1).long()

    def pick(cx, cy):  # the flat index of canvas pixel (cx, cy)'s first channel, -1 for grey
        addr = torch.full_like(cx, -1)
        for k in range(TILES):
            base, _, w, x1a, y1a, x2a, y2a, x1b, y1b = tiles[:, k].unbind(1)
            inside = (cx >= x1a) & (cx < x2a) & (cy >= y1a) & (cy < y2a)
            addr = torch.where(inside, base + ((cy - y1a + y1b) * w + (cx - x1a + x1b)) * 3, addr)
        return addr

    x0, y0 = fx0.long(), fy0.long()
    flat = packed.reshape(-1).long()
    acc = []
    for c in range(3):
        total = torch.zeros_like(fx)
        for dy, dx, weight in ((0, 0, (1 - fx) * (1 - fy)), (0, 1, fx * (1 - fy)),
                               (1, 0, (1 - fx) * fy), (1, 1, fx * fy)):
            addr = pick(x0 + dx, y0 + dy)
            inside = addr >= 0
            index = torch.where(inside, addr + c, torch.zeros_like(addr))
            value = torch.where(inside, flat[index] if flat.numel() else index, torch.full_like(addr, BORDER))
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
    swap = (table[:, 11] != 0).view(n, 1, 1, 1)
    return torch.where(swap, img.flip(1), img)


def augment_images(packed: torch.Tensor, table: torch.Tensor, luts: torch.Tensor | None,
                   size: tuple[int, int], perspective: bool = False, vector_block: int = 0) -> torch.Tensor:
    """Warp, colour-jitter, flip and channel-swap a packed batch: a new ``(N, 3, H, W)`` uint8 tensor.

    Args:
        packed: uint8, the images' HWC BGR pixels one after another (any shape; read flat).
        table: ``(N, TABLE)`` float64, per image its warp, flips, channel order and tiles
            (:func:`tile_table`).
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
        raise ValueError(f"augment_images: table must be float64 (N, {TABLE}) (tile_table), got "
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
    block = INTERPRETER_BLOCK if interpreting() else GPU_BLOCK
    grid = (cdiv(h_out * w_out, block), n)
    args = (packed.reshape(-1) if packed.numel() else packed.new_zeros(1), table.contiguous(),
            luts.contiguous() if luts is not None else packed.new_zeros(1), sdiv, hdiv, out,
            h_out, w_out, w_out - w_out % vector_block if vector_block > 0 else 0)
    consts = {"TABLE": TABLE, "HSV": luts is not None, "PERSPECTIVE": bool(perspective), "BLOCK": block}
    with precompile.first_launch(_augment_kernel, args, 4, consts):  # a 2-d grid: no CachedLauncher
        _augment_kernel[grid](*args, num_warps=4, **consts)
    return out


__all__ = ["BORDER", "TABLE", "TILE", "TILES", "augment_images", "augment_images_reference", "pack_crops",
           "tile_table"]
