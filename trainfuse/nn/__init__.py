"""Fused small MLPs: ``FusedMLP`` (Linear + bias + activation (+ dropout) chains on Triton matmuls
with fused epilogues and a two-stream backward) and ``fuse_mlps`` to swap them into a model."""

from trainfuse.nn.mlp.module import FusedMLP, FuseReport, fuse_mlps

__all__ = ["FuseReport", "FusedMLP", "fuse_mlps"]
