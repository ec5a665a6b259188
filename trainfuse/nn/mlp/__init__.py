"""Linear + bias + activation (+ dropout) chains: one Triton matmul per layer and direction.

For layer ``i`` with weight ``W_i`` (out x in), input ``X_i`` and activation ``f``::

    forward  pre_i = X_i W_i^T + b_i                     matmul, bias in the epilogue
             X_{i+1} = dropout(f(pre_i))                 activation and dropout in the epilogue
    dgrad    dpre_{i-1} = (dpre_i W_i) * f'(.) * keep/(1-p)   the previous layer's activation grad
                                                        (and dropout mask) in the epilogue
    wgrad    dW_i = dpre_i^T X_i,  db_i = sum_rows dpre_i  the bias grad as a second MMA of the
                                                        dpre_i^T tiles with ones, deterministically

The package, by job:

- ``activations.py``: the activations, their grads and dropout's keep mask, as epilogue math,
  and ``Layer``, one layer's epilogue settings.
- ``kernels.py``: the matmul kernel (its epilogue picked by ``EPI``), the last layer's
  activation-grad kernel, the dropout-mask kernel.
- ``tiles.py``: launch shapes: the settings' types, the default tile per problem, launch plans.
- ``launches.py``: launching: :data:`config`, :func:`matmul` and the per-layer calls, and the
  launch sites a chain binds after its first call (recorded and replayed as CUDA graphs).
- ``buffers.py``: the tensors a call makes, carved from one allocation per kind.
- ``grads.py``: where the backward writes param grads into ``.grad`` itself.
- ``function.py``: the autograd Function of a chain.
- ``library.py``: ReLU chains on cuBLAS's matmuls, with the mask and bias-grad pass fused.
- ``module.py``: ``FusedMLP`` and ``fuse_mlps``.

Two launch choices avoid wrong results that triton 3.6's software pipelining gave on Hopper (not
reproducible on CPU: the interpreter does not pipeline), and GPU tests at the benchmark's shapes
guard both: the bias grad is not summed in registers from the MMA's A tile (``kernels._mma``), and
a float32 weight read transposed (the input grad) goes through TMA, or through pointers in at most
2 stages (:func:`trainfuse.nn.mlp.tiles.rounds_weight_transposed`).

``config`` is the launch settings object: ``trainfuse.nn.mlp.config.graphs = False`` launches
each kernel every call instead of replaying repeated launch lists as CUDA graphs;
``config.library`` picks where ReLU chains run on cuBLAS (``library.py``). Set its fields;
it is :data:`trainfuse.nn.mlp.launches.config`, which the launches read.
"""

from trainfuse.nn.mlp.activations import ACTIVATIONS, Layer
from trainfuse.nn.mlp.function import FusedMLPFunction
from trainfuse.nn.mlp.kernels import EPI_ACT_GRAD, EPI_FORWARD, EPI_PLAIN, EPI_WGRAD
from trainfuse.nn.mlp.launches import act_grad, config, dropout_mask, linear_dgrad, linear_forward, matmul
from trainfuse.nn.mlp.tiles import MatmulConfig, MatmulConfigs, default_tile

__all__ = ["ACTIVATIONS", "EPI_ACT_GRAD", "EPI_FORWARD", "EPI_PLAIN", "EPI_WGRAD", "FusedMLPFunction",
           "Layer", "MatmulConfig", "MatmulConfigs", "act_grad", "config", "default_tile", "dropout_mask",
           "linear_dgrad", "linear_forward", "matmul"]
