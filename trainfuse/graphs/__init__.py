"""Whole training steps captured in CUDA graphs, one per input shape, with eager fallback."""

from trainfuse.graphs.cache import Action, ShapeCache
from trainfuse.graphs.step import CapturedStep, StepStats

__all__ = ["Action", "CapturedStep", "ShapeCache", "StepStats"]
