"""The changes FusedDetectionTrainer makes to a run, one small object each
(:class:`~trainfuse.ultralytics.changes.base.Change`), in the order it makes them; it undoes them in
reverse. Adding one is its class and one line in :func:`changes`."""

from __future__ import annotations

from trainfuse.ultralytics.changes.amp import Casts, Scaler
from trainfuse.ultralytics.changes.averaging import EMASwap
from trainfuse.ultralytics.changes.base import CALLBACKS, Change, Options, Results, Run
from trainfuse.ultralytics.changes.blocks import FuseBlocks
from trainfuse.ultralytics.changes.cache import DeviceCache
from trainfuse.ultralytics.changes.conv_algorithms import ConvAlgorithms
from trainfuse.ultralytics.changes.ddp import FlatGradsDDP
from trainfuse.ultralytics.changes.graphs import Graphs, Phase
from trainfuse.ultralytics.changes.image_input import ImageInput
from trainfuse.ultralytics.changes.loss import Augment, LossSwap
from trainfuse.ultralytics.changes.optimizer import OptimizerSwap
from trainfuse.ultralytics.changes.stem import FoldStem
from trainfuse.ultralytics.changes.upsample import Upsampling
from trainfuse.ultralytics.changes.validator import Validation, ValidationWorkers


def changes(options: Options) -> list[Change]:
    """A run's changes, in the order they are made: the optimizer, the scaler and the EMA (folded
    into the optimizer's step), the loss, how the batches load, the casts, the upsamplings, the stem,
    the uint8 images it reads, the Conv blocks and the convolutions' algorithms, then DDP's flat
    all-reduce, the graphs and the optimizer phase inside them, which need the ones before; and the
    validator's row and its loader's workers; what stays on the device between epochs."""
    made: list[Change] = [OptimizerSwap(), Scaler(), EMASwap(), LossSwap()]
    made += [Augment(), Casts(options.fuse_casts), Upsampling(options.fuse_blocks),
             FoldStem(options.fold_stem), ImageInput(options.raw_images), FuseBlocks(options.fuse_blocks),
             ConvAlgorithms(options.cudnn_benchmark), FlatGradsDDP(), Graphs(), Phase(),
             Validation(), ValidationWorkers(), DeviceCache(options.device_cache)]
    return made


__all__ = ["CALLBACKS", "Augment", "Casts", "Change", "ConvAlgorithms", "DeviceCache", "EMASwap",
           "FlatGradsDDP", "FoldStem", "FuseBlocks", "Graphs", "ImageInput", "LossSwap", "OptimizerSwap",
           "Options", "Phase", "Results", "Run", "Scaler", "Upsampling", "Validation", "ValidationWorkers",
           "changes"]
