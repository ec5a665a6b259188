"""GraphPool off CUDA: pool ids only (no capture). A pool starts from the id it is given, keeps it
while a holder of its graphs lives, and hands out a new one once none does or after a renew."""

from __future__ import annotations

import gc

import torch

from trainfuse.graphs import GraphPool


class Holder:
    """A stand-in for what holds captured graphs (a GraphPair, a CapturedStep's entry)."""


def test_a_pool_starts_from_the_handle_given():
    given = torch.cuda.graph_pool_handle()
    pool = GraphPool(given)
    assert pool.handle() == given == pool.handle()


def test_a_pool_is_kept_while_a_holder_lives_and_replaced_once_none_does():
    pool = GraphPool()
    first = pool.handle()
    a, b = Holder(), Holder()
    pool.hold(a)
    pool.hold(b)
    del a
    gc.collect()
    assert pool.handle() == first  # b still holds graphs captured into it
    del b
    gc.collect()
    second = pool.handle()
    assert second != first and pool.handle() == second


def test_renew_hands_out_a_new_handle_even_while_graphs_live():
    pool = GraphPool()
    holder = Holder()
    first = pool.handle()
    pool.hold(holder)
    pool.renew()
    assert pool.handle() != first
