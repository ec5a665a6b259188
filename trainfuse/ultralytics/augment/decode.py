"""JPEG decoding on the GPU for the deferred augmentation: the loader's workers read a training
image's bytes instead of decoding it, and the GPU decodes the batch's images in one call.

Decoding a 640 x 480 photo takes a loader worker about 2-3 ms, half of what a deferred sample
costs it (:mod:`trainfuse.ultralytics.augment.deferred`). :func:`install` replaces a training
dataset's ``load_image`` by :func:`encoded_load_image`: for a plain JPEG it reads the file's bytes
and the size in its header, and returns an :class:`Encoded` stand-in of the size ultralytics'
``load_image`` would have returned (its resize rule, on the shape only), with ultralytics' own
buffer bookkeeping, so the mosaic draws the very images and parameters it draws on decoded ones.
Any other image (PNG and the rest, progressive or CMYK JPEGs, an EXIF rotation, a ``.npy``
cache) is decoded by ultralytics' ``load_image`` as before, in the worker.

:class:`JpegDecoder` is the GPU's side: it decodes a batch's JPEGs that it has not decoded lately
with ``decode_jpeg`` (nvJPEG on CUDA, libjpeg-turbo on the CPU), resizes them as
ultralytics would have (bilinear), turns them to HWC BGR and keeps them by dataset index. Decoded
images stay for the rest of the run while a
:class:`~trainfuse.ultralytics.device_cache.CacheBudget` has room for them (the resident set): on a
dataset that fits, every epoch after the first decodes nothing. Past the budget, or without one,
the latest images stay (least recently used first out): the mosaic's other three images come from
the workers' recent images, so most tiles of a batch are decoded already. It then packs the batch's sources,
decoded and raw, into the flat buffer that
:func:`~trainfuse.ultralytics.augment.kernel.augment_images` reads. A :class:`ResidentIndex` in
shared memory tells the workers which images are resident, at which sizes: for those they send a
stand-in without bytes, so once every image is resident they read no image file and pass no JPEG
bytes to the training process (each mosaic tile's, about 12 MB a batch of 16 photo-sized
mosaics). ``decode_jpeg`` is TorchCodec's where it is installed, else
torchvision's (deprecated from torchvision 0.29 for TorchCodec's).

nvJPEG's output is not libjpeg-turbo's bit for bit (its chroma upsampling and IDCT differ): pixels
differ by a level or two on average, more on sharp colour edges; on the CPU, both decode as OpenCV
does, exactly.
"""

from __future__ import annotations

import io
from collections import OrderedDict

import numpy as np
import torch

from trainfuse.ultralytics.device_cache import CacheBudget

RAW, JPEG = 0, 1  # the kinds of a batch's sources
SOURCE_COLUMNS = 8  # per source: kind, dataset index, offset, length, h, w (resized), h0, w0 (decoded)


class Encoded(np.ndarray):
    """A stand-in image: zero-cost pixels (strides 0) of the shape ultralytics' transforms read,
    and in ``source`` what the GPU decodes: ``(dataset index, JPEG bytes, decoded h, decoded w)``."""

    source: tuple | None = None

    def __array_finalize__(self, obj):
        self.source = getattr(obj, "source", None)


class HostTensor:
    """A batch's tensor that stays on the host: the DataLoader's pinning passes it by (``pin_memory``
    returns it as it is) and the prefetcher does not copy it. The JPEG bytes are read on the host by
    the decoder; pinning them, 10 MB a batch on the loader's one pinning thread, held its rate to
    about half of what the workers made."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def pin_memory(self, device=None) -> HostTensor:
        return self


def stand_in(h: int, w: int, source: tuple) -> Encoded:
    """An :class:`Encoded` (h, w, 3) image of ``source``."""
    im = np.broadcast_to(np.zeros((1, 1, 3), np.uint8), (h, w, 3)).view(Encoded)
    im.source = source
    return im


def probe_jpeg(path: str) -> tuple[np.ndarray, int, int] | None:
    """``(bytes, height, width)`` of a JPEG that decodes on the GPU as OpenCV decodes it on the CPU:
    baseline, 8-bit greyscale or YCbCr, no EXIF rotation (OpenCV applies it); None for any other
    file."""
    from PIL import Image

    try:
        data = np.fromfile(path, np.uint8)
        with Image.open(io.BytesIO(data.tobytes())) as im:
            if (im.format != "JPEG" or im.mode not in ("RGB", "L") or im.info.get("progressive")
                    or im.info.get("progression") or im.getexif().get(0x0112, 1) != 1):
                return None
            w, h = im.size
    except Exception:  # unreadable here (ultralytics' patched Image.open may raise anything): stock reads it
        return None
    return data, h, w


NO_BYTES = np.zeros(0, np.uint8)  # an Encoded source's bytes where the image is resident


class ResidentIndex:
    """Which of a dataset's images a :class:`JpegDecoder` keeps for good, and at which sizes, in
    shared memory: the training process marks them, the loader's workers (forked after it was
    made, or spawned: it pickles as shared memory) read it. A row per image: kept (0 or 1), the
    decoded height and width, the resized height and width; the sizes are written before the
    flag."""

    def __init__(self, n: int) -> None:
        self.table = torch.zeros((n, 5), dtype=torch.int32).share_memory_()

    def mark(self, index: int, h0: int, w0: int, h: int, w: int) -> None:
        row = self.table[index]
        row[1:] = torch.tensor((h0, w0, h, w), dtype=torch.int32)
        row[0] = 1

    def unmark(self, index: int) -> None:
        self.table[index, 0] = 0

    def clear(self) -> None:
        self.table[:, 0] = 0

    def sizes(self, index: int) -> tuple[int, int, int, int] | None:
        """``(h0, w0, h, w)`` of a resident image, or None."""
        if not 0 <= index < len(self.table):
            return None
        flag, h0, w0, h, w = self.table[index].tolist()
        return (h0, w0, h, w) if flag else None


def encoded_load_image(dataset, i: int, rect_mode: bool = True, resize_short: bool = False,
                       resident: ResidentIndex | None = None):
    """ultralytics' ``BaseDataset.load_image`` for ``dataset``, with a plain JPEG not decoded: an
    :class:`Encoded` stand-in of the resized shape in its place (see the module); without its
    bytes, and without reading the file, where ``resident`` says the decoder keeps it at that
    shape."""
    if dataset.ims[i] is not None:
        return dataset.ims[i], dataset.im_hw0[i], dataset.im_hw[i]
    from trainfuse.ultralytics import compat

    if resident is not None and (sizes := resident.sizes(i)) is not None:
        h0, w0, rh, rw = sizes
        h, w = compat.resized_shape(dataset, h0, w0, rect_mode, resize_short)
        if (h, w) == (rh, rw):
            im = stand_in(h, w, (i, NO_BYTES, h0, w0))
            compat.keep_loaded(dataset, i, im, (h0, w0), (h, w))
            return im, (h0, w0), (h, w)
    probed = None if dataset.npy_files[i].exists() else probe_jpeg(dataset.im_files[i])
    if probed is None:
        return type(dataset).load_image(dataset, i, rect_mode, resize_short)
    data, h0, w0 = probed
    h, w = compat.resized_shape(dataset, h0, w0, rect_mode, resize_short)
    im = stand_in(h, w, (i, data, h0, w0))
    compat.keep_loaded(dataset, i, im, (h0, w0), (h, w))  # ultralytics' buffer, as load_image keeps it
    return im, (h0, w0), (h, w)


class _EncodedLoad:
    """A dataset's ``load_image``: :func:`encoded_load_image` (picklable, for spawned workers)."""

    def __init__(self, dataset, resident: ResidentIndex | None = None):
        self.dataset = dataset
        self.resident = resident

    def __call__(self, i, rect_mode=True, resize_short=False):
        return encoded_load_image(self.dataset, i, rect_mode, resize_short, self.resident)


def install(dataset, resident: ResidentIndex | None = None) -> None:
    """Leave ``dataset``'s plain JPEGs to the GPU (see the module); ``resident``: the decoder's
    index of the images it keeps, which the workers then send without their bytes."""
    dataset.load_image = _EncodedLoad(dataset, resident)


def pack_sources(sources: list, resident: ResidentIndex | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch's sources, in order, as the loader hands them over: the ``(M, SOURCE_COLUMNS)``
    int64 table and the JPEG bytes one after another (flat uint8), each in a :class:`HostTensor`,
    and the raw pixels one after another (flat uint8). Each source: an HWC uint8 array (raw
    pixels), or an :class:`Encoded` whose ``source`` the GPU decodes; its bytes left out where
    ``resident`` says the decoder keeps it at its sizes (a worker's buffered stand-ins, loaded
    before that, still hold them)."""
    rows, raw, jpeg, at_raw, at_jpeg = [], [], [], 0, 0
    for s in sources:
        h, w = s.shape[:2]
        if isinstance(s, Encoded):
            index, data, h0, w0 = s.source
            if data.size and resident is not None and resident.sizes(index) == (h0, w0, h, w):
                data = NO_BYTES
            rows.append((JPEG, index, at_jpeg, data.size, h, w, h0, w0))
            jpeg.append(torch.from_numpy(data))
            at_jpeg += data.size
        else:
            rows.append((RAW, -1, at_raw, h * w * 3, h, w, h, w))
            raw.append(torch.from_numpy(np.ascontiguousarray(s)).reshape(-1))
            at_raw += h * w * 3
    table = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), SOURCE_COLUMNS)
    empty = torch.zeros(0, dtype=torch.uint8)
    return HostTensor(table), torch.cat(raw) if raw else empty, HostTensor(torch.cat(jpeg) if jpeg else empty)


def why_not_gpu_decoding() -> str:
    """Why the GPU cannot decode the training JPEGs here ("" when it can): torchvision's
    ``decode_jpeg`` (deprecated from torchvision 0.29 in favour of TorchCodec) is missing. The
    workers then decode, and the rest of the deferred augmentation runs on the GPU as before."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg  # noqa: F401
    except ImportError as e:
        return f"torchvision.io has no decode_jpeg here ({e}): the loader's workers decode the JPEGs"
    return ""


class JpegDecoder:
    """Decodes the JPEG sources of deferred batches on their device and keeps the decoded images.

    Args:
        capacity: recent decoded images kept past the budget (least recently used first out);
            ultralytics' workers keep their last ``max_buffer_length`` images each for the mosaic,
            so about ``workers * max_buffer_length`` keeps every tile decoded once; 0 keeps none.
        budget: where decoded images stay for good while it has room (the resident set); None
            keeps none for good.
        index: the shared :class:`ResidentIndex` of the dataset's images, marked as they become
            resident (the workers then send them without their bytes); None: none is marked.

    Attributes:
        decoded: images decoded so far; ``reused``: images a batch found decoded already;
            ``received``: the JPEG bytes the batches brought.
        kept: the recent images by dataset index; ``resident``: the images kept for good.
    """

    def __init__(self, capacity: int = 1024, budget: CacheBudget | None = None,
                 index: ResidentIndex | None = None) -> None:
        if capacity < 0:
            raise ValueError(f"JpegDecoder: capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.budget = budget
        self.index = index
        self.kept: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.resident: dict[int, torch.Tensor] = {}
        self.resident_bytes = 0
        self.decoded = 0
        self.reused = 0
        self.received = 0

    def release(self) -> None:
        """Drop every decoded image (the recent and the resident ones) and give their bytes back."""
        self.kept.clear()
        self.resident.clear()
        if self.index is not None:
            self.index.clear()
        if self.budget is not None:
            self.budget.give(self.resident_bytes)
        self.resident_bytes = 0

    def _find(self, index: int, h: int, w: int) -> torch.Tensor | None:
        """Image ``index`` decoded and resized to (h, w) before, or None."""
        img = self.kept.get(index)
        if img is not None:
            self.kept.move_to_end(index)
        else:
            img = self.resident.get(index)
        if img is None or tuple(img.shape[:2]) != (h, w):  # another size (a new image size): decoded again
            return None
        return img

    def pack(self, sources: HostTensor | torch.Tensor, raw: torch.Tensor, jpeg: HostTensor | torch.Tensor
             ) -> torch.Tensor:
        """The batch's sources packed (flat uint8, HWC BGR, in ``sources``' order) on ``raw``'s
        device, for :func:`~trainfuse.ultralytics.augment.kernel.augment_images`.

        Args:
            sources: the :func:`pack_sources` table, on the CPU.
            raw: the raw pixels, on the batch's device.
            jpeg: the JPEG bytes, on the CPU.
        """
        device = raw.device
        sources = sources.tensor if isinstance(sources, HostTensor) else sources
        jpeg = jpeg.tensor if isinstance(jpeg, HostTensor) else jpeg
        self.received += jpeg.numel()
        rows = sources.tolist()
        todo, ready = {}, {}
        for row in rows:
            index = row[1]
            if row[0] != JPEG or index in ready or index in todo:
                continue
            # taken before this batch's decodes may push it out
            if (img := self._find(index, row[4], row[5])) is not None:
                ready[index] = img
                self.reused += 1
            elif row[3] == 0:
                raise ValueError(f"JpegDecoder: image {index} came without its bytes, as one kept for good, "
                                 f"and none is kept at {(row[4], row[5])}")
            else:
                todo[index] = row
        if todo:
            images = self._decode([jpeg[r[2]:r[2] + r[3]] for r in todo.values()], device)
            for (index, (_, _, _, _, h, w, h0, w0)), img in zip(todo.items(), images):
                if tuple(img.shape[1:]) != (h0, w0):
                    raise ValueError(f"JpegDecoder: image {index} decoded to {tuple(img.shape[1:])}, its "
                                     f"header said {(h0, w0)}")
                ready[index] = img = _to_hwc_bgr(img, h, w)
                self._keep(index, img, h0, w0)
            self.decoded += len(todo)
        parts = []
        for kind, index, offset, length, *_ in rows:
            if kind == RAW:
                parts.append(raw[offset:offset + length])
                continue
            parts.append(ready[index].reshape(-1))
        if not parts:
            return torch.zeros(0, dtype=torch.uint8, device=device)
        return torch.cat(parts)

    def _decode(self, data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        try:  # TorchCodec (from 0.16) holds the image decoders torchvision deprecates from 0.29
            from torchcodec.decoders import decode_jpeg
        except (ImportError, OSError, RuntimeError):  # not installed, or its libraries do not load
            import warnings

            from torchvision.io import ImageReadMode, decode_jpeg

            # torchvision >= 0.29 warns on each call that TorchCodec supersedes it. A filter, not
            # catch_warnings: the prefetcher decodes in a thread of its own, and catch_warnings is
            # not thread-safe.
            warnings.filterwarnings("ignore", "The image decoding and encoding capabilities of TorchVision "
                                    "are deprecated", DeprecationWarning)
            return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
        return decode_jpeg(data, mode="RGB", device=device)

    def _keep(self, index: int, img: torch.Tensor, h0: int, w0: int) -> None:
        if self.capacity == 0:
            return
        if (stale := self.resident.pop(index, None)) is not None:  # decoded again at another size
            self.resident_bytes -= stale.nbytes
            self.budget.give(stale.nbytes)
            if self.index is not None:
                self.index.unmark(index)
        if self.budget is not None and self.budget.take(img.nbytes):  # for good
            self.kept.pop(index, None)
            self.resident[index] = img
            self.resident_bytes += img.nbytes
            if self.index is not None:
                self.index.mark(index, h0, w0, *img.shape[:2])
            return
        self.kept[index] = img
        self.kept.move_to_end(index)
        while len(self.kept) > self.capacity:
            self.kept.popitem(last=False)


def _to_hwc_bgr(img: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """A decoded (3, h0, w0) RGB image resized to (h, w) as ``cv2.resize(INTER_LINEAR)`` does
    (bilinear, pixel centres aligned, rounded; OpenCV's 11-bit fixed-point weights put about 1 pixel
    in 200 a level or two apart), as a contiguous (h, w, 3) BGR image."""
    if tuple(img.shape[1:]) != (h, w):
        img = torch.nn.functional.interpolate(img[None].float(), size=(h, w), mode="bilinear",
                                              align_corners=False)[0].round_().clamp_(0, 255).to(torch.uint8)
    return img.flip(0).permute(1, 2, 0).contiguous()


__all__ = ["Encoded", "HostTensor", "JPEG", "JpegDecoder", "NO_BYTES", "RAW", "ResidentIndex",
           "SOURCE_COLUMNS", "encoded_load_image", "install", "pack_sources", "probe_jpeg", "stand_in",
           "why_not_gpu_decoding"]
