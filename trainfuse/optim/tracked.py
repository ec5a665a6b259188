"""Containers that count their own mutations, so the step driver can tell in O(1) that the
optimizer's state or a group's param list changed since its tables were built.

``FusedOptimizer.state`` is a :class:`StateDict` (a ``defaultdict(dict)`` whose per-param entries
are :class:`StateEntry` dicts) and every ``group["params"]`` is a :class:`ParamList`. Each keeps a
``version`` that any mutation bumps: ``state.clear()``, ``state[p] = {...}``, ``del state[p]``,
``state[p]["exp_avg"] = t``, ``group["params"].append(q)``, ``group["params"][0] = q`` and so on.
Replacing a container outright (``opt.state = defaultdict(dict)``, ``group["params"] = [...]``) is
seen by identity. Copies and pickles of them are plain dicts and lists.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any


class StateEntry(dict):
    """One param's state: a dict that bumps its owner's version when it changes."""

    __slots__ = ("owner",)

    def __init__(self, owner: StateDict, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.owner = owner

    def _bump(self) -> None:
        self.owner.version += 1

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self._bump()

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        self._bump()

    def clear(self) -> None:
        super().clear()
        self._bump()

    def pop(self, *args):
        self._bump()
        return super().pop(*args)

    def popitem(self):
        self._bump()
        return super().popitem()

    def setdefault(self, key, default=None):
        if key not in self:
            self._bump()
        return super().setdefault(key, default)

    def update(self, *args, **kwargs) -> None:
        super().update(*args, **kwargs)
        self._bump()

    def __ior__(self, other):
        self.update(other)
        return self

    def __reduce__(self):
        return dict, (dict(self),)


class StateDict(defaultdict):
    """``defaultdict(dict)`` of :class:`StateEntry` with a mutation counter (``version``)."""

    def __init__(self, items: Any = ()) -> None:
        super().__init__(dict)
        self.version = 0
        for key, value in dict(items).items():
            self[key] = value

    def __missing__(self, key):
        entry = StateEntry(self)
        dict.__setitem__(self, key, entry)
        self.version += 1
        return entry

    def __setitem__(self, key, value) -> None:
        if not isinstance(value, StateEntry) or value.owner is not self:
            value = StateEntry(self, value)
        super().__setitem__(key, value)
        self.version += 1

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        self.version += 1

    def clear(self) -> None:
        super().clear()
        self.version += 1

    def pop(self, *args):
        self.version += 1
        return super().pop(*args)

    def popitem(self):
        self.version += 1
        return super().popitem()

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = {} if default is None else default
        return self[key]

    def update(self, *args, **kwargs) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __ior__(self, other):
        self.update(other)
        return self

    def __copy__(self):
        return StateDict(self)

    def __reduce__(self):
        return StateDict, ({k: dict(v) for k, v in self.items()},)


class ParamList(list):
    """A group's ``params`` list with a mutation counter (``version``)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.version = 0

    def _bump(self) -> None:
        self.version += 1

    def __setitem__(self, index, value) -> None:
        super().__setitem__(index, value)
        self._bump()

    def __delitem__(self, index) -> None:
        super().__delitem__(index)
        self._bump()

    def __iadd__(self, other):
        self._bump()
        return super().__iadd__(other)

    def __imul__(self, n):
        self._bump()
        return super().__imul__(n)

    def __reduce__(self):
        return list, (list(self),)


def _bumping(name: str):
    method = getattr(list, name)

    def wrapper(self, *args, **kwargs):
        self._bump()
        return method(self, *args, **kwargs)

    wrapper.__name__ = name
    return wrapper


for _name in ("append", "extend", "insert", "remove", "pop", "clear", "sort", "reverse"):
    setattr(ParamList, _name, _bumping(_name))


def snapshot(optimizer) -> tuple:
    """The optimizer's state container, its param lists and each group's ``plan_key``, with the
    containers' mutation counters, as they are now."""
    groups = optimizer.param_groups
    lists = [g["params"] for g in groups]
    return (optimizer.state, optimizer.state.version, groups, len(groups), lists,
            [lst.version for lst in lists], [optimizer.plan_key(g) for g in groups])


def changed(snap: tuple, optimizer) -> bool:
    """True when anything :func:`snapshot` covers changed since ``snap``: O(groups)."""
    state, version, groups, ngroups, lists, versions, keys = snap
    if optimizer.state is not state or state.version != version:
        return True
    if optimizer.param_groups is not groups or len(groups) != ngroups:
        return True
    for g, lst, ver, key in zip(groups, lists, versions, keys):
        params = g["params"]
        if params is not lst or params.version != ver or optimizer.plan_key(g) != key:
            return True
    return False


__all__ = ["ParamList", "StateDict", "StateEntry", "changed", "snapshot"]
