"""What the Lightning and ultralytics clients share: the change protocol (:class:`Change`, one small
object per thing a client changes, made and undone by :class:`AppliedChanges`), swapping a user's
optimizer for its fused counterpart, the GradScaler swap, the state of fused casts, grads flat for
one all-reduce (or a few buckets overlapping the backward), and the report rows that say what was
changed and why not. A client only says when to do each; what each
means is written here once.

Below both clients in the dependency order (``optim``, ``amp`` <- ``clients`` <- ``lightning``,
``ultralytics``); imports neither Lightning nor ultralytics.
"""

from trainfuse.clients.cast_state import CastState
from trainfuse.clients.change import AppliedChanges, Change
from trainfuse.clients.flat_all_reduce import FlatAllReduce
from trainfuse.clients.flat_grads import FlatGrads
from trainfuse.clients.grad_buckets import BucketLaunch, GradBuckets
from trainfuse.clients.report import OFF, ON, SKIPPED, SWAPPED, Report, Row, SkipError, format_rows
from trainfuse.clients.scaler import fused_scaler, hand_back_scaler
from trainfuse.clients.swap import repoint_schedulers, sparse_grad_params, swap_optimizer, why_not_swappable

__all__ = ["OFF", "ON", "SKIPPED", "SWAPPED", "AppliedChanges", "BucketLaunch", "CastState", "Change",
           "FlatAllReduce", "FlatGrads", "GradBuckets", "Report", "Row", "SkipError", "format_rows",
           "fused_scaler", "hand_back_scaler", "repoint_schedulers", "sparse_grad_params", "swap_optimizer",
           "why_not_swappable"]
