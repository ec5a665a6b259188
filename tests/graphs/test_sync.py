"""The watched first call of a step sees only its own host syncs: a background thread that
synchronizes under ``background_syncs`` (a checkpoint's copies), or without it (ultralytics'
plotting threads), is not taken for it."""

from __future__ import annotations

import threading

import pytest
import torch

from trainfuse.graphs.sync import background_syncs, watching_syncs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_a_background_sync_is_not_the_watched_calls():
    device = torch.device("cuda")
    x = torch.randn(1 << 20, device=device)
    stop = threading.Event()
    copies = []

    def background():
        while not stop.is_set():
            with background_syncs:
                copies.append(float(x[:4].sum()))  # a device-to-host copy: a sync

    thread = threading.Thread(target=background)
    thread.start()
    try:
        for _ in range(50):
            _, sync = watching_syncs(device, lambda: (x * 2).sum())
            assert sync is None, sync
    finally:
        stop.set()
        thread.join()
    assert copies, "the background thread never ran"
    _, sync = watching_syncs(device, lambda: float(x.sum()))
    assert sync is not None  # the call's own sync is still seen


def test_another_threads_sync_without_the_lock_is_not_the_watched_calls():
    device = torch.device("cuda")
    x = torch.randn(1 << 20, device=device)
    stop, started = threading.Event(), threading.Event()
    copies = []

    def plotting():  # as ultralytics' threaded plot_images: .cpu() of a batch, no lock
        while not stop.is_set():
            copies.append(float(x[:4].sum()))
            started.set()

    thread = threading.Thread(target=plotting)
    thread.start()
    started.wait(10)
    try:
        for _ in range(50):
            _, sync = watching_syncs(device, lambda: (x * 2).sum())
            assert sync is None, sync
    finally:
        stop.set()
        thread.join()
    _, sync = watching_syncs(device, lambda: float(x.sum()))
    assert sync is not None and "test_sync.py" in sync  # the call's own sync is still seen, and where
