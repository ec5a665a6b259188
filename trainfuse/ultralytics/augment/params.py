"""Per-image random parameters of ultralytics' augmentation, drawn for a whole batch from one
``torch.Generator`` with ultralytics' distributions (its transforms draw from Python's ``random``
and NumPy one image at a time; the draws here are seeded and reproducible, not the same numbers).

``RandomPerspective``: perspective ``U(-p, p)`` twice, rotation ``U(-degrees, degrees)``, scale
``U(1 - scale, 1 + scale)``, shear ``U(-shear, shear)`` degrees twice, translation
``U(0.5 - t, 0.5 + t)`` of the output size twice; ``M = T @ S @ R @ P @ C`` with ``C`` centring the
input. ``RandomHSV``: gains ``U(-1, 1) * (hgain, sgain, vgain)``. ``RandomFlip``: ``U(0, 1) < p``.
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class AffineParams:
    """``RandomPerspective``'s parameters for a batch: ``matrix`` (N, 3, 3) float64 mapping input
    pixels to output pixels, ``scale`` (N,) the sampled scale (the box filter compares areas with
    it), ``size`` the output (width, height), ``perspective`` whether the warp divides by w."""

    matrix: torch.Tensor
    scale: torch.Tensor
    size: tuple[int, int]
    perspective: bool


def _uniform(n: int, low: float, high: float, generator: torch.Generator | None) -> torch.Tensor:
    return torch.rand(n, dtype=torch.float64, generator=generator) * (high - low) + low


def affine_params(n: int, in_size: tuple[int, int], out_size: tuple[int, int], *, degrees: float = 0.0,
                  translate: float = 0.1, scale: float = 0.5, shear: float = 0.0, perspective: float = 0.0,
                  generator: torch.Generator | None = None) -> AffineParams:
    """Draw ``n`` warps from input images of ``in_size`` (width, height; a mosaic is twice the
    training size) to ``out_size``, with ultralytics' hyperparameters (``degrees``, ``translate``,
    ``scale``, ``shear``, ``perspective``)."""
    if n < 0:
        raise ValueError(f"affine_params: n must be >= 0, got {n}")
    C = torch.eye(3, dtype=torch.float64).repeat(n, 1, 1)
    C[:, 0, 2] = -in_size[0] / 2
    C[:, 1, 2] = -in_size[1] / 2
    P = torch.eye(3, dtype=torch.float64).repeat(n, 1, 1)
    P[:, 2, 0] = _uniform(n, -perspective, perspective, generator)
    P[:, 2, 1] = _uniform(n, -perspective, perspective, generator)
    a = _uniform(n, -degrees, degrees, generator) * (math.pi / 180)
    s = _uniform(n, 1 - scale, 1 + scale, generator)
    R = torch.eye(3, dtype=torch.float64).repeat(n, 1, 1)
    R[:, 0, 0] = R[:, 1, 1] = s * torch.cos(a)  # cv2.getRotationMatrix2D(angle, (0, 0), scale)
    R[:, 0, 1] = s * torch.sin(a)
    R[:, 1, 0] = -R[:, 0, 1]
    S = torch.eye(3, dtype=torch.float64).repeat(n, 1, 1)
    S[:, 0, 1] = torch.tan(_uniform(n, -shear, shear, generator) * (math.pi / 180))
    S[:, 1, 0] = torch.tan(_uniform(n, -shear, shear, generator) * (math.pi / 180))
    T = torch.eye(3, dtype=torch.float64).repeat(n, 1, 1)
    T[:, 0, 2] = _uniform(n, 0.5 - translate, 0.5 + translate, generator) * out_size[0]
    T[:, 1, 2] = _uniform(n, 0.5 - translate, 0.5 + translate, generator) * out_size[1]
    return AffineParams(T @ S @ R @ P @ C, s, (int(out_size[0]), int(out_size[1])), bool(perspective))


def hsv_gains(n: int, hgain: float = 0.015, sgain: float = 0.7, vgain: float = 0.4,
              generator: torch.Generator | None = None) -> torch.Tensor:
    """(N, 3) float64 gains ``U(-1, 1) * (hgain, sgain, vgain)`` (ultralytics' defaults)."""
    r = torch.rand(n, 3, dtype=torch.float64, generator=generator) * 2 - 1
    return r * torch.tensor([hgain, sgain, vgain], dtype=torch.float64)


def flip_params(n: int, p: float = 0.5, generator: torch.Generator | None = None) -> torch.Tensor:
    """(N,) bool: which images flip, each with probability ``p``."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"flip_params: p must be in [0, 1], got {p}")
    return torch.rand(n, dtype=torch.float64, generator=generator) < p


__all__ = ["AffineParams", "affine_params", "flip_params", "hsv_gains"]
