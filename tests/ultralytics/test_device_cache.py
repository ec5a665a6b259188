"""What a run keeps on the device between epochs: the budget's bounds, the decoder's resident set
(images the recent ones push out, decoded once for the run) and the validation batches kept after
their first pass (the same batches, in order, with the loader left alone)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._helpers import cuda
from trainfuse.ultralytics.device_cache import CacheBudget, memory_of
from trainfuse.ultralytics.validate.cached import CachedBatches

cv2 = pytest.importorskip("cv2")
pytest.importorskip("torchvision")

from trainfuse.ultralytics.augment.decode import (  # noqa: E402
    JpegDecoder,
    ResidentIndex,
    pack_sources,
    probe_jpeg,
    stand_in,
)


def test_the_budget_holds_what_fits_and_refuses_the_rest():
    budget = CacheBudget(100)
    assert budget.take(60) and budget.take(40) and budget.used == 100
    assert not budget.take(1) and budget.used == 100 and budget.refused == 1
    budget.give(40)
    assert budget.take(30) and budget.used == 90
    with pytest.raises(ValueError, match="releasing 91 bytes, only 90 are held"):
        budget.give(91)
    with pytest.raises(ValueError, match="limit must be >= 0 bytes, got -1"):
        CacheBudget(-1)
    with pytest.raises(ValueError, match="reserve must be >= 0 bytes, got -2"):
        CacheBudget(1, reserve=-2)
    with pytest.raises(ValueError, match=r"fraction and reserve must be within \[0, 1\], got 2 and 0.2"):
        CacheBudget.for_device("cpu", fraction=2)
    host = CacheBudget.for_device("cpu")
    assert host.limit == int(memory_of(torch.device("cpu")) * 0.1) > 0 and host.reserve == 0


@cuda
def test_on_cuda_the_budget_leaves_the_reserve_free():
    total = torch.cuda.get_device_properties(0).total_memory
    assert CacheBudget(total, "cuda", reserve=1).take(2**20)  # other tests share the GPU: far from the edges
    refused = CacheBudget(total, "cuda", reserve=total)  # the driver never has it all free
    assert not refused.take(1) and refused.used == 0 and refused.refused == 1
    budget = CacheBudget.for_device("cuda")
    assert budget.limit == int(total * 0.1) and budget.reserve == int(total * 0.2)


def _jpegs(tmp_path, n):
    images = []
    for k in range(n):
        rng = np.random.default_rng(k)
        small = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
        path = str(tmp_path / f"{k}.jpg")
        cv2.imwrite(path, cv2.resize(small, (64, 48), interpolation=cv2.INTER_CUBIC))
        data, h, w = probe_jpeg(path)
        images.append((k, data, h, w, path))
    return images


def _pack(decoder, images, size=None):
    stand_ins = [stand_in(*(size or (h, w)), (k, data, h, w)) for k, data, h, w, _ in images]
    return decoder.pack(*pack_sources(stand_ins))


def test_decoded_images_stay_while_the_budget_has_room_and_the_latest_past_it(tmp_path):
    images = _jpegs(tmp_path, 4)
    nbytes = 48 * 64 * 3
    budget = CacheBudget(2 * nbytes)  # room for two of the four
    index = ResidentIndex(4)  # what the loader's workers read
    decoder = JpegDecoder(capacity=1, budget=budget, index=index)
    first = [_pack(decoder, [im]) for im in images]
    assert decoder.decoded == 4 and list(decoder.kept) == [3]
    assert sorted(decoder.resident) == [0, 1] and decoder.resident_bytes == budget.used == 2 * nbytes
    assert [index.sizes(k) for k in range(4)] == [(48, 64, 48, 64)] * 2 + [None] * 2
    assert budget.refused == 2  # images 2 and 3 found no room: the latest of them stays recent
    again = [_pack(decoder, [im]) for im in images]  # 0, 1 resident; 2 decoded again, pushing 3 out
    assert decoder.decoded == 6 and decoder.reused == 2 and list(decoder.kept) == [3]
    for a, b, im in zip(first, again, images):
        want = torch.from_numpy(cv2.imread(im[4])).reshape(-1)
        assert torch.equal(a, want) and torch.equal(b, want)
    resized = _pack(decoder, images[:1], size=(24, 32))  # another size: decoded again, not the resident one
    assert resized.numel() == 24 * 32 * 3 and decoder.decoded == 7
    # its resident copy gave its bytes back, and the resized image took its place, marked at its size
    small = 24 * 32 * 3
    assert sorted(decoder.resident) == [0, 1] and budget.used == decoder.resident_bytes == nbytes + small
    assert [index.sizes(k) for k in range(4)] == [(48, 64, 24, 32), (48, 64, 48, 64), None, None]
    decoder.release()
    assert not decoder.kept and not decoder.resident and budget.used == 0 and decoder.resident_bytes == 0
    assert all(index.sizes(k) is None for k in range(4))


def test_without_a_budget_only_the_recent_images_stay(tmp_path):
    decoder = JpegDecoder(capacity=2)
    for im in _jpegs(tmp_path, 3):
        _pack(decoder, [im])
    assert list(decoder.kept) == [1, 2] and not decoder.resident
    decoder.release()  # nothing to give back
    assert not decoder.kept


class _Loader:
    """Dict batches as ultralytics' validation loader makes them, counting its passes."""

    def __init__(self, n: int, pin: bool = False):
        g = torch.Generator().manual_seed(1)
        self.batches = []
        for i in range(n):
            img = torch.randint(0, 255, (2, 3, 8, 8), dtype=torch.uint8, generator=g)
            self.batches.append({"img": img.pin_memory() if pin else img,
                                 "cls": torch.rand(3, 1, generator=g), "im_file": [f"{i}a.jpg", f"{i}b.jpg"]})
        self.passes, self.dataset = 0, "dataset"

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        self.passes += 1
        for b in self.batches:
            yield {k: v.clone() if torch.is_tensor(v) else list(v) for k, v in b.items()}


def _validate(loader):
    """What a validator's ``preprocess`` does to each batch (values replaced), and what it saw."""
    seen = []
    for batch in loader:
        seen.append({k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()})
        batch["img"] = batch["img"].float() / 255
        batch["padded"] = torch.zeros(1)
    return seen


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_validation_batches_are_kept_after_their_first_pass(device):
    loader = _Loader(3, pin=device == "cuda")
    budget = CacheBudget(10**6, device)
    cached = CachedBatches(loader, torch.device(device), budget)
    assert len(cached) == 3 and cached.dataset == "dataset"
    passes = [_validate(cached) for _ in range(3)]
    assert loader.passes == 1 and budget.used == cached.nbytes == 3 * 2 * 3 * 8 * 8
    for seen in passes:
        for got, want in zip(seen, loader.batches, strict=True):
            assert got["img"].device.type == device and got.keys() == want.keys()
            assert torch.equal(got["img"].cpu(), want["img"]) and torch.equal(got["cls"], want["cls"])
            assert got["im_file"] == want["im_file"]
    cached.release()
    assert budget.used == 0 and cached.batches is None and cached.why_not == ""


def test_a_pass_that_does_not_fit_is_read_from_the_loader_every_time():
    loader = _Loader(3)
    budget = CacheBudget(2 * 384 + 10)  # two batches of three
    cached = CachedBatches(loader, torch.device("cpu"), budget)
    passes = [_validate(cached) for _ in range(2)]
    assert loader.passes == 2 and budget.used == 0 and cached.batches is None
    assert "more than the cache budget has left (10 of 778 bytes, at batch 2)" in cached.why_not
    for seen in passes:
        same = [torch.equal(g["img"], w["img"]) for g, w in zip(seen, loader.batches, strict=True)]
        assert same == [True] * 3


def test_a_pass_stopped_early_is_not_kept():
    loader = _Loader(3)
    budget = CacheBudget(10**6)
    cached = CachedBatches(loader, torch.device("cpu"), budget)
    for _ in zip(range(2), cached):
        pass
    assert cached.batches is None and budget.used == 0 and cached.why_not == ""
    _validate(cached)
    assert cached.batches is not None and loader.passes == 2


def test_batches_without_images_are_passed_through():
    class Plain(_Loader):
        def __iter__(self):
            self.passes += 1
            yield from ([1, 2], [3, 4])

    loader = Plain(2)
    cached = CachedBatches(loader, torch.device("cpu"), CacheBudget(10**6))
    assert list(cached) == [[1, 2], [3, 4]] and list(cached) == [[1, 2], [3, 4]]
    assert loader.passes == 2 and "no 'img' tensor (got list)" in cached.why_not
