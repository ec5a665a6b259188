"""Argument and output structures of a graphed call, and the leaves its backward reaches."""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any

import torch


class _Tensor:
    """Where a tensor sits in an argument or output structure."""


_TENSOR = _Tensor()
_VALUE = "value"  # the tag of a value other than a tensor, kept in the structure as it is


def flatten(obj: Any, tensors: list[torch.Tensor]) -> Hashable:
    """The structure of ``obj`` (tuples, lists and dicts nested), with its tensors appended to
    ``tensors`` and left as :data:`_TENSOR`; other values stay in the structure as they are.
    Dicts and lists come back plain, named tuples as their own type, other tuples as tuples."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _TENSOR
    if isinstance(obj, dict):
        return (dict, tuple(obj), tuple(flatten(v, tensors) for v in obj.values()))
    if isinstance(obj, list):
        return (list, tuple(flatten(v, tensors) for v in obj))
    if isinstance(obj, tuple):
        return (type(obj) if hasattr(obj, "_fields") else tuple, tuple(flatten(v, tensors) for v in obj))
    return (_VALUE, obj)


def unflatten(structure: Hashable, tensors: Iterator[torch.Tensor]) -> Any:
    """What :func:`flatten` took apart, with the next of ``tensors`` at each tensor's place."""
    if structure is _TENSOR:
        return next(tensors)
    kind = structure[0]
    if kind is _VALUE:
        return structure[1]
    if kind is dict:
        return {k: unflatten(v, tensors) for k, v in zip(structure[1], structure[2])}
    items = [unflatten(v, tensors) for v in structure[1]]
    if kind is list:
        return items
    return tuple(items) if kind is tuple else kind(*items)


def constants(structure: Hashable, where: str) -> Iterator[tuple[str, Any]]:
    """The values other than tensors that ``structure`` keeps as they are, in :func:`flatten`'s
    order, each with its place written as an index into ``where`` (``where[1]['loss']``)."""
    if structure is _TENSOR:
        return
    kind = structure[0]
    if kind is _VALUE:
        yield where, structure[1]
    elif kind is dict:
        for k, v in zip(structure[1], structure[2]):
            yield from constants(v, f"{where}[{k!r}]")
    else:
        for i, v in enumerate(structure[1]):
            yield from constants(v, f"{where}[{i}]")


def reached_leaves(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The leaf tensors a backward from ``outputs`` accumulates into, in a fixed order."""
    found: dict[int, torch.Tensor] = {}
    seen: set = set()
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # AccumulateGrad
        if leaf is not None:
            found.setdefault(id(leaf), leaf)
        else:
            stack.extend(n for n, _ in node.next_functions)
    return list(found.values())


__all__ = ["constants", "flatten", "reached_leaves", "unflatten"]
