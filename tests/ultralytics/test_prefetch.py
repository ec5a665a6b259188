"""DevicePrefetcher: a loader's dict batches arrive on the GPU, equal and in order, the loader's
attributes pass through; off CUDA it refuses to be made."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from tests._helpers import cuda
from trainfuse.ultralytics.augment.decode import HostTensor
from trainfuse.ultralytics.prefetch import DevicePrefetcher


class _Loader:
    """A loader of dict batches with the attributes ultralytics reads (pinned where it can)."""

    def __init__(self, n: int, pin: bool):
        g = torch.Generator().manual_seed(0)
        self.batches = []
        for i in range(n):
            img = torch.randint(0, 255, (2, 3, 8, 8), dtype=torch.uint8, generator=g)
            self.batches.append({"img": img.pin_memory() if pin else img,
                                 "cls": torch.rand(3, 1, generator=g),
                                 "bytes": HostTensor(torch.arange(i + 1, dtype=torch.uint8)),
                                 "im_file": [f"{i}a.jpg", f"{i}b.jpg"], "index": i})
        self.dataset, self.resets = "dataset", 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)

    def reset(self):
        self.resets += 1


def test_refuses_a_device_that_is_not_cuda():
    with pytest.raises(ValueError, match="must be a CUDA device"):
        DevicePrefetcher(_Loader(2, False), torch.device("cpu"))


@cuda
@pytest.mark.parametrize("background", [False, True], ids=["inline", "background"])
@pytest.mark.parametrize("n", [0, 1, 5])
def test_batches_arrive_on_the_gpu_equal_and_in_order(n, background):
    loader = _Loader(n, pin=True)
    device = torch.device("cuda", torch.cuda.current_device())
    seen = []  # what finish sees: the tensors on the GPU, the host's bytes where they were
    pre = DevicePrefetcher(loader, device, background=background,
                           finish=lambda b: seen.append((b["cls"].device.type,
                                                         b["bytes"].tensor.device.type)) or b)
    assert len(pre) == n and pre.dataset == "dataset"
    pre.reset()
    assert loader.resets == 1
    for _ in range(2):  # two epochs
        order = []
        for batch, want in zip(pre, loader.batches, strict=True):
            assert batch["img"].device == device and batch["cls"].device == device
            assert batch["bytes"] is want["bytes"]  # a HostTensor is passed as it is, not copied
            assert torch.equal(batch["img"].cpu(), want["img"])
            assert torch.equal(batch["cls"].cpu(), want["cls"])
            assert batch["im_file"] == want["im_file"]
            assert want["img"].device.type == "cpu"  # the loader's own batch is left as it was
            batch["img"].float().div_(255)  # work on the loop's stream
            order.append(batch["index"])
        assert order == list(range(n))
    assert seen == [("cuda", "cpu")] * 2 * n and len(pre.launch_ms) == 2 * n


class _Failing(_Loader):
    def __iter__(self):
        yield self.batches[0]
        raise RuntimeError("a worker died")


@cuda
def test_background_launches_raise_in_the_loop_and_stop_with_it():
    device = torch.device("cuda", torch.cuda.current_device())
    pre = DevicePrefetcher(_Failing(3, pin=True), device, background=True)
    batches = iter(pre)
    assert next(batches)["index"] == 0
    with pytest.raises(RuntimeError, match="a worker died"):
        next(batches)
    loader = _Loader(6, pin=True)
    pre = DevicePrefetcher(loader, device, background=True, ahead=1)
    batches = iter(pre)
    assert next(batches)["index"] == 0
    assert any(t.name == pre.thread_name for t in threading.enumerate())
    batches.close()  # the loop leaves the epoch after one batch: the thread goes
    del batches
    gc.collect()
    deadline = time.monotonic() + 10
    while any(t.name == pre.thread_name for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == pre.thread_name for t in threading.enumerate())
    with pytest.raises(ValueError, match="ahead must be >= 1"):
        DevicePrefetcher(loader, device, ahead=0)


@cuda
def test_a_batch_that_is_not_a_dict_is_refused():
    pre = DevicePrefetcher([torch.zeros(2)], torch.device("cuda"))
    with pytest.raises(TypeError, match="must be dicts"):
        next(iter(pre))
