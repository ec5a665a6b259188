"""``FusedMLP`` (an ``nn.Sequential`` of Linear / activation / Dropout whose forward and backward
run on :class:`trainfuse.nn.mlp.function.FusedMLPFunction`) and ``fuse_mlps``, which swaps such
chains into a model."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from trainfuse._runtime import compat
from trainfuse._runtime.backend import backend, use_triton
from trainfuse._runtime.function import applier
from trainfuse.nn.mlp.activations import ACTIVATIONS, Layer
from trainfuse.nn.mlp.function import FusedMLPFunction
from trainfuse.nn.mlp.library import LibraryMLPFunction, eligible

_apply_mlp = applier(FusedMLPFunction)
_apply_library = applier(LibraryMLPFunction)

_STREAMS = (1, 2, "auto")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_AUTO_ALIGN = 16  # TRAINFUSE_BACKEND=auto: feature sizes the kernels take (16-byte rows, full MMA tiles)
_AUTO_MIN_ROWS = 64  # and batches below this take torch's path (one cuBLAS call wins there)
# "auto" streams: the side stream pays where a layer's matmuls are too narrow to fill the GPU alone
# (H200, 4 x 256-wide layers at 65536 rows: 3 % less GPU time); for 1024 and 4096 wide layers it
# saves 0-5 % of GPU time and costs more than that in host time
_AUTO_TWO_STREAMS_WIDTH = 512


def _activation_name(m: nn.Module) -> str | None:
    """Our name for an activation module, or None if the kernels do not have it."""
    if type(m) is nn.ReLU:
        return "relu"
    if type(m) is nn.GELU:
        return "gelu" if m.approximate == "none" else "gelu_tanh"
    if type(m) is nn.SiLU:
        return "silu"
    if type(m) is nn.Identity:
        return "none"
    return None


def _make_activation(name: str) -> nn.Module | None:
    return {"relu": nn.ReLU, "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
            "silu": nn.SiLU, "none": lambda: None}[name]()


def _parse(children: Sequence[tuple[str, nn.Module]]) -> list[tuple[nn.Linear, str, nn.Dropout | None]]:
    """``[(linear, activation, dropout)]`` for a run of Linear [activation] [Dropout] children;
    raises ValueError saying which child does not fit."""
    layers: list[list] = []
    for name, m in children:
        act = _activation_name(m)
        if type(m) is nn.Linear:
            if layers and layers[-1][0].out_features != m.in_features:
                raise ValueError(f"child {name}: Linear({m.in_features}, ...) does not take the "
                                 f"{layers[-1][0].out_features} features of the layer before it")
            layers.append([m, "none", None])
        elif not layers:
            raise ValueError(f"child {name} ({type(m).__name__}) comes before the first Linear")
        elif type(m) is nn.Dropout:
            if layers[-1][2] is not None:
                raise ValueError(f"child {name}: a second Dropout after one Linear")
            if m.inplace:
                raise ValueError(f"child {name}: Dropout(inplace=True)")
            layers[-1][2] = m
        elif act is not None:
            if layers[-1][1] != "none" or layers[-1][2] is not None:
                raise ValueError(f"child {name}: {type(m).__name__} after an activation or a Dropout")
            layers[-1][1] = act
        else:
            raise ValueError(f"child {name} ({type(m).__name__}) is not Linear, ReLU, GELU, SiLU, "
                             "Identity or Dropout")
    if not layers:
        raise ValueError("no Linear layer")
    return [tuple(layer) for layer in layers]


class FusedMLP(nn.Sequential):
    r"""A chain of ``Linear(+bias) -> activation [-> Dropout]`` layers that runs each layer's
    forward, input grad and weight grad as one Triton matmul with the bias, activation (and its
    grad) and dropout in the epilogue; the weight grads run on a second CUDA stream, overlapped
    with the input grads.

    It *is* the ``nn.Sequential(Linear, act, [Dropout,] Linear, act, ...)`` it replaces: the same
    children, the same ``state_dict`` keys, and the plain ``nn.Sequential`` forward where the
    kernels do not apply (CPU tensors, float64, feature sizes that are not multiples of 16,
    batches under 64 rows, forward hooks on the children).

    Args:
        sizes: feature sizes ``[in, hidden..., out]``: ``len(sizes) - 1`` Linear layers.
        activation: ``"relu"``, ``"gelu"``, ``"gelu_tanh"``, ``"silu"`` or ``"none"``.
        last_activation: whether the last Linear is followed by the activation (and dropout).
        dropout: probability of the Dropout after each activation (0: no Dropout modules).
        bias: Linear biases.
        streams: 2 runs weight grads on a side stream, 1 keeps one stream, ``"auto"`` = 2 on CUDA
            for layers at most 512 wide (where the overlap measured worth its host cost).
        recompute: GELU/SiLU only: instead of keeping each layer's activation derivative (a
            batch x width tensor) from the forward to the backward, the backward runs the layer's
            forward matmul again for it, just before its use. Same results, bit for bit; one
            more matmul per layer. (ReLU keeps nothing beyond the outputs either way.)
        fuse_grad_accumulation: the backward writes the weight and bias grads into their
            ``.grad`` itself, adding to a grad already there inside the weight-grad kernel (one
            pass over it, where autograd's AccumulateGrad would run an add kernel per param after
            it): for gradient accumulation, or any backward onto existing grads. Only where autograd
            would do the same and nothing could tell the difference; otherwise (a process group is
            initialized, as under DDP/FSDP, whose hooks on the params' AccumulateGrad nodes Python
            cannot see; ``create_graph``; ``autograd.grad`` or ``backward(inputs=...)`` leaving
            the param out; torch.compile; params with hooks; grads that are not dense and
            row-major) the grads go back through autograd as usual. False: always through
            autograd. The sum is formed in the float32 accumulator: for float32 params not
            autograd's bits (as close to the exact sum), for 16-bit ones rounded once (autograd
            rounds the new grad, then the sum).
        library: ReLU chains without dropout on cuBLAS's matmuls (below): True, False, or None
            (``trainfuse.nn.mlp.config.library``).

    On CUDA, from the third call with the same launches (shapes, addresses: what a training loop
    repeats) the forward and a one-stream backward each replay as one CUDA graph, bit for bit
    what the launches would do (``trainfuse.nn.mlp.config.graphs = False`` turns it off).
    ``library=True`` (None: ``trainfuse.nn.mlp.config.library``, off by default) runs ReLU chains
    without dropout on cuBLAS's matmuls instead, with the ReLU mask and the bias grad fused into
    one pass of ours: less GPU time, more host time (docs/design/mlp.md, "The cuBLAS path"), the
    path for a step captured in a CUDA graph (``FusedTraining(cuda_graphs=True)`` sets it on the
    chains of the module it graphs).

    Example:
        >>> mlp = FusedMLP([32, 64, 64, 8], activation="gelu")
        >>> [type(m).__name__ for m in mlp]
        ['Linear', 'GELU', 'Linear', 'GELU', 'Linear']
        >>> mlp(torch.randn(5, 32)).shape
        torch.Size([5, 8])
    """

    def __init__(self, sizes: Sequence[int], activation: str = "relu", last_activation: bool = False,
                 dropout: float = 0.0, bias: bool = True, streams: int | str = "auto",
                 recompute: bool = False, fuse_grad_accumulation: bool = True, library: bool | None = None,
                 device=None, dtype=None) -> None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"FusedMLP: activation must be one of {', '.join(ACTIVATIONS)}, "
                             f"got {activation!r}")
        if len(sizes) < 2:
            raise ValueError(f"FusedMLP: sizes needs at least [in, out], got {list(sizes)}")
        if not 0.0 <= dropout <= 1.0:
            raise ValueError(f"FusedMLP: dropout must be in [0, 1], got {dropout}")
        modules: list[nn.Module] = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            modules.append(nn.Linear(fan_in, fan_out, bias=bias, device=device, dtype=dtype))
            if i < len(sizes) - 2 or last_activation:
                act = _make_activation(activation)
                if act is not None:
                    modules.append(act)
                if dropout > 0.0:
                    modules.append(nn.Dropout(dropout))
        super().__init__(*modules)
        self._setup(streams, recompute, fuse_grad_accumulation, library)

    @classmethod
    def from_sequential(cls, seq: nn.Sequential, streams: int | str = "auto", recompute: bool = False,
                        fuse_grad_accumulation: bool = True, library: bool | None = None) -> FusedMLP:
        """A FusedMLP holding ``seq``'s own children (same Parameter objects, same keys).

        Raises:
            ValueError: ``seq`` is not a chain of Linear [ReLU|GELU|SiLU|Identity] [Dropout].
        """
        obj = cls.__new__(cls)
        nn.Sequential.__init__(obj, OrderedDict(seq.named_children()))
        obj._setup(streams, recompute, fuse_grad_accumulation, library)
        return obj

    def _setup(self, streams: int | str, recompute: bool, fuse_grad_accumulation: bool,
               library: bool | None) -> None:
        if streams not in _STREAMS:
            raise ValueError(f"FusedMLP: streams must be 1, 2 or 'auto', got {streams!r}")
        if library is not None and not isinstance(library, bool):
            raise TypeError(f"FusedMLP: library must be True, False or None, got {library!r}")
        for name, value in (("recompute", recompute), ("fuse_grad_accumulation", fuse_grad_accumulation)):
            if not isinstance(value, bool):
                raise TypeError(f"FusedMLP: {name} must be a bool, got {type(value).__name__}")
        self.streams = streams
        self.recompute = recompute
        self.fuse_grad_accumulation = fuse_grad_accumulation
        self.library = library
        self._chain = _parse(list(self.named_children()))
        self._narrow = max(lin.out_features for lin, _, _ in self._chain) <= _AUTO_TWO_STREAMS_WIDTH

    def extra_repr(self) -> str:
        return (f"streams={self.streams!r}, recompute={self.recompute}, "
                f"fuse_grad_accumulation={self.fuse_grad_accumulation}, "
                f"library={self.__dict__.get('library')}")

    def _kernel_dtype(self, x: torch.Tensor, params: list[torch.Tensor]) -> torch.dtype | None:
        """The compute dtype if the kernels take this call, else None (torch's path)."""
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != self._chain[0][0].in_features:
            return None
        device = x.device
        if any(p.device != device or p.dtype not in _DTYPES for p in params) or x.dtype not in _DTYPES:
            return None
        if x.numel() == 0 or not use_triton(device):
            return None
        kind = device.type
        if torch.is_autocast_enabled(kind):
            cd = torch.get_autocast_dtype(kind)
            if cd not in (torch.bfloat16, torch.float16):
                return None
        else:
            cd = x.dtype
            if any(p.dtype != cd for p in params):
                return None  # torch's path raises its own dtype-mismatch error
        for lin, _, _ in self._chain:
            if compat.module_hooks(lin, ("forward", "forward_pre")):
                return None
        rows = x.numel() // x.shape[-1]
        if any(d is not None and d.p > 0.0 and d.training for _, _, d in self._chain):
            widest = max(lin.out_features for lin, _, _ in self._chain)
            if rows * widest >= 2**31:  # the dropout mask is indexed by a 32-bit element number
                return None
        if backend() == "auto":
            dims = [self._chain[0][0].in_features] + [lin.out_features for lin, _, _ in self._chain]
            if any(d % _AUTO_ALIGN for d in dims) or rows < _AUTO_MIN_ROWS:
                return None
        return cd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # what ``lin.weight`` returns (Module.__getattr__ reads _parameters), without its detour
        weights = [compat.parameters_of(lin)["weight"] for lin, _, _ in self._chain]
        biases = [compat.parameters_of(lin)["bias"] for lin, _, _ in self._chain]
        cd = self._kernel_dtype(x, weights + [b for b in biases if b is not None])
        if cd is None:
            return super().forward(x)
        # each Dropout child's own mode, as nn.Sequential would run it
        drops = tuple(d.p if d is not None and d.training else 0.0 for _, _, d in self._chain)
        # Layer lists by dropout p and recompute, made on first use (a module unpickled without
        # the cache gets it here)
        made = self.__dict__.setdefault("_layers", {})
        layers = made.get((drops, self.recompute))
        if layers is None:
            layers = [Layer(ACTIVATIONS[act], p, self.recompute)
                      for (_, act, _), p in zip(self._chain, drops)]
            made[(drops, self.recompute)] = layers
        x2 = x.reshape(-1, x.shape[-1])
        if eligible(layers, cd, self.__dict__.get("library")):  # (a module unpickled from before: None)
            out = _apply_library(x2, layers, cd, self.fuse_grad_accumulation, *weights, *biases)
            return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])
        seed = int(torch.randint(0, 2**31 - 2**16, (1,))) if any(layer.p > 0 for layer in layers) else 0
        self._last_seed = seed
        streams = self.streams
        if streams == "auto":
            streams = 2 if x.device.type == "cuda" and self._narrow else 1
        # no autocast context needed around it: a custom Function's forward casts nothing unless
        # asked to, and ours runs no autocast-eligible op
        out = _apply_mlp(x2, layers, cd, seed, streams, self.fuse_grad_accumulation, *weights, *biases)
        return out.reshape(*x.shape[:-1], out.shape[-1])


@dataclasses.dataclass
class FuseReport:
    """What :func:`fuse_mlps` did: ``swapped`` module names, ``skipped`` (name, reason) pairs."""

    swapped: list[str] = dataclasses.field(default_factory=list)
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"fuse_mlps: {len(self.swapped)} swapped, {len(self.skipped)} skipped"]
        lines += [f"  swapped {name}" for name in self.swapped]
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped]
        return "\n".join(lines)


def fuse_mlps(model: nn.Module, streams: int | str = "auto", recompute: bool = False,
              fuse_grad_accumulation: bool = True, library: bool | None = None) -> FuseReport:
    """Swap every ``nn.Sequential`` of ``model`` that is a Linear [activation] [Dropout] chain
    for a :class:`FusedMLP` holding the same children, in place.

    The Parameter objects stay the same (optimizers built before keep working) and so do the
    state_dict keys. Only whole Sequentials are swapped: a chain mixed with other modules would
    change the keys. ``model`` itself, if it is the chain, cannot be swapped in place: use
    ``FusedMLP.from_sequential(model)``. ``streams``, ``recompute``, ``fuse_grad_accumulation``
    and ``library`` are the FusedMLP arguments every swapped chain gets.

    Returns:
        A :class:`FuseReport`: what was swapped, what was skipped and why.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten())
        >>> net.head = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        >>> print(fuse_mlps(net))
        fuse_mlps: 1 swapped, 0 skipped
          swapped head
        >>> type(net.head).__name__
        'FusedMLP'
    """
    report = FuseReport()
    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is not nn.Sequential or not any(type(m) is nn.Linear for m in child.children()):
                continue
            reason = _why_not(child)
            if reason is not None:
                report.skipped.append((full, reason))
                continue
            setattr(parent, child_name, FusedMLP.from_sequential(child, streams, recompute,
                                                                 fuse_grad_accumulation, library))
            report.swapped.append(full)
    if type(model) is nn.Sequential and _why_not(model) is None:
        report.skipped.append(("(the model itself)", "a chain itself: use FusedMLP.from_sequential(model)"))
    return report


def _why_not(seq: nn.Sequential) -> str | None:
    """Why ``seq`` cannot become a FusedMLP, or None if it can."""
    try:
        chain = _parse(list(seq.named_children()))
    except ValueError as e:
        return str(e)
    for lin, _, _ in chain:
        if compat.module_hooks(lin, ("forward", "forward_pre", "backward")):
            return "a Linear child has hooks (the fused forward would not call them)"
    return None


__all__ = ["FuseReport", "FusedMLP", "fuse_mlps"]
