"""Every method of the ultralytics client (trainfuse.ultralytics) and of the layer both clients
share (trainfuse.clients) that overrides one of a base class says so (``@override``), as the
Lightning client's do (tests/lightning/test_overrides.py)."""

import importlib
import pkgutil

import pytest

from tests.lightning.test_overrides import overriding_methods


def classes_of(package) -> list[type]:
    """The classes defined in the modules of ``package`` (imported ones excluded)."""
    names = [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
    modules = [importlib.import_module(name) for name in [package.__name__, *names]]
    return [cls for m in modules for cls in vars(m).values()
            if isinstance(cls, type) and cls.__module__ == m.__name__]


def test_every_override_of_the_ultralytics_client_and_the_shared_layer_is_marked():
    pytest.importorskip("ultralytics")
    import trainfuse.ultralytics

    classes = classes_of(trainfuse.ultralytics) + classes_of(trainfuse.clients)
    assert {"FusedDetectionTrainer", "OptimizerSwap", "Graphs", "TrainerHooks", "FlatAllReduce"} <= {
        c.__name__ for c in classes}
    found = [(cls, name, fn) for cls in classes for name, fn in overriding_methods(cls)]
    assert {"optimizer_step", "build_dataset", "after_setup", "why_not", "apply", "restore"} <= {
        n for _, n, _ in found}
    unmarked = [f"{cls.__module__}.{cls.__qualname__}.{name}" for cls, name, fn in found
                if not getattr(fn, "__override__", False)]
    assert unmarked == []
