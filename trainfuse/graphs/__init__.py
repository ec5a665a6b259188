"""CUDA graphs for training: whole steps captured per input shape (:class:`CapturedStep`), a
module's forward and backward inside an eager step (:class:`GraphedModule`), or a fused
optimizer's phase (:class:`GraphedOptimizerStep`), with eager fallback."""

from trainfuse.graphs.cache import Action, ShapeCache
from trainfuse.graphs.module import BackwardLaunch, BackwardSync, GraphedModule
from trainfuse.graphs.optimizer_step import GraphedOptimizerStep
from trainfuse.graphs.pool import GraphPool
from trainfuse.graphs.stats import StepStats
from trainfuse.graphs.step import CapturedStep

__all__ = ["Action", "BackwardLaunch", "BackwardSync", "CapturedStep", "GraphPool", "GraphedModule",
           "GraphedOptimizerStep", "ShapeCache", "StepStats"]
