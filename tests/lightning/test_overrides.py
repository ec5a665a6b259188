"""Every method of trainfuse.lightning that overrides one of a base class says so (``@override``,
as Lightning's own callbacks mark their hooks): a renamed base hook then shows up in a type checker
instead of silently never being called."""

import importlib
import inspect
import pkgutil

import trainfuse.lightning


def lightning_classes() -> list[type]:
    """The classes defined in the modules of trainfuse.lightning (imported ones excluded)."""
    names = [m.name for m in pkgutil.walk_packages(trainfuse.lightning.__path__, "trainfuse.lightning.")]
    modules = [importlib.import_module(name) for name in ["trainfuse.lightning", *names]]
    return [cls for m in modules for cls in vars(m).values()
            if inspect.isclass(cls) and cls.__module__ == m.__name__]


def overriding_methods(cls: type) -> list[tuple[str, object]]:
    """The functions in ``cls.__dict__`` (no dunders) that a base class other than ``object`` also
    defines."""
    bases = [b for b in cls.__mro__[1:] if b is not object]
    return [(name, fn) for name, fn in vars(cls).items()
            if inspect.isfunction(fn) and not (name.startswith("__") and name.endswith("__"))
            and any(name in vars(b) for b in bases)]


def test_every_override_in_trainfuse_lightning_is_marked():
    classes = lightning_classes()
    assert {"FusedTraining", "MLPFusion", "EMA", "WeightEMA"} <= {c.__name__ for c in classes}
    found = [(cls, name, fn) for cls in classes for name, fn in overriding_methods(cls)]
    # FusedTraining's hooks and the Change subclasses' methods, at the least
    assert {"on_fit_start", "on_save_checkpoint", "why_not", "apply", "restore"} <= {n for _, n, _ in found}
    unmarked = [f"{cls.__module__}.{cls.__qualname__}.{name}" for cls, name, fn in found
                if not getattr(fn, "__override__", False)]
    assert unmarked == []
