"""The changes FusedTraining makes to a run, one small object each (:class:`Change`), in the
order the callback applies them; it undoes them in reverse."""

from trainfuse.lightning.changes.averaging import EMA, EvaluateOnEMA
from trainfuse.lightning.changes.base import Change, Run
from trainfuse.lightning.changes.ddp import FlatAllReduce
from trainfuse.lightning.changes.graphs import Graphs
from trainfuse.lightning.changes.modules import BatchNormSiLUFusion, LossFusion, MLPFusion
from trainfuse.lightning.changes.optimizer import Clipping, OptimizerSwap
from trainfuse.lightning.changes.phase import OptimizerPhase
from trainfuse.lightning.changes.precision import Casts, Scaler
from trainfuse.lightning.changes.scope import PRECISIONS, Backend, Precision, Strategy

__all__ = ["EMA", "PRECISIONS", "Backend", "BatchNormSiLUFusion", "Casts", "Change", "Clipping",
           "EvaluateOnEMA", "FlatAllReduce", "Graphs", "LossFusion", "MLPFusion", "OptimizerPhase",
           "OptimizerSwap", "Precision", "Run", "Scaler", "Strategy"]
