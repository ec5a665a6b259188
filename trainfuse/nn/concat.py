"""A channel concatenation whose parts are written into it where they are made.

``torch.cat(parts, 1)`` reads every part and writes it again, and its backward hands each part a
strided slice of the grad, which autograd then adds to the part's other grads (a tensor read by
the next block too) at half speed in channels_last. A :class:`ConcatBuffer` is the concatenation's
output allocated first; each part is written into its channel slice by the op that makes it
(:func:`~trainfuse.nn.bn_silu_into.batch_norm_silu_into`, or :meth:`ConcatBuffer.write`, a copy,
for any other part) and :meth:`ConcatBuffer.join` returns the whole buffer as the concatenation.

For autograd each part's slice is an output of the op that wrote it, and the join's backward
hands each of them its slice of the grad, a view: nothing is copied, and an op that made its part
twice (in the slice and in a dense tensor) adds the two grads itself.
"""

from __future__ import annotations

import torch


class Slice:
    """The channels ``[start, end)`` of a :class:`ConcatBuffer`: what an op writing a part is
    handed (not a tensor, so that the slice it returns is an output of its own, whose grad is
    the concatenation's slice)."""

    __slots__ = ("buffer", "start", "end")

    def __init__(self, buffer: ConcatBuffer, start: int, end: int) -> None:
        self.buffer, self.start, self.end = buffer, start, end

    def view(self) -> torch.Tensor:
        """The slice of the buffer (a view)."""
        return self.buffer.tensor[:, self.start:self.end]

    def copy_(self, part: torch.Tensor) -> None:
        """Copy ``part`` into the slice, leaving the buffer's version counter as it is (the
        slices already returned are outputs of autograd Functions, which an in-place change of
        their base would invalidate; every slice is written once, before the join reads it)."""
        self.buffer._writer[:, self.start:self.end].copy_(part)


class ConcatBuffer:
    """``torch.cat(parts, 1)`` of 4-d parts, ``channels`` channels in all, filled part by part in
    order: :meth:`slot` gives the next part's :class:`Slice` (the buffer is made at the first, in
    that part's dtype, device and memory format), :meth:`write` copies a part there, :meth:`join`
    returns the concatenation once every channel is written."""

    def __init__(self, channels: int) -> None:
        if channels < 1:
            raise ValueError(f"ConcatBuffer: channels must be positive; got {channels}")
        self.channels = channels
        self.tensor: torch.Tensor | None = None
        self._writer: torch.Tensor | None = None  # the same memory, a version counter of its own
        self.filled = 0
        self._slots: list[Slice] = []

    def slot(self, like: torch.Tensor, channels: int) -> Slice:
        """The slice for the next part, ``channels`` channels of a part shaped as ``like``
        (``(N, *, H, W)``): its batch and spatial size must be the first part's."""
        if like.dim() != 4:
            raise ValueError(f"ConcatBuffer: parts must be (N, C, H, W); got shape {tuple(like.shape)}")
        if self.filled + channels > self.channels:
            raise ValueError(f"ConcatBuffer: a part of {channels} channels after {self.filled} overflows "
                             f"the {self.channels} channels")
        N, _, H, W = like.shape
        if self.tensor is None:
            channels_last = like.stride(1) == 1 and like.shape[1] > 1
            fmt = torch.channels_last if channels_last else torch.contiguous_format
            self.tensor = torch.empty((N, self.channels, H, W), device=like.device, dtype=like.dtype,
                                      memory_format=fmt)
            self._writer = torch.empty(0, device=like.device, dtype=like.dtype).set_(
                self.tensor.untyped_storage(), 0, self.tensor.shape, self.tensor.stride())
        elif (N, H, W) != (self.tensor.shape[0], *self.tensor.shape[2:]) or like.device != self.tensor.device:
            raise ValueError(f"ConcatBuffer: part of shape {tuple(like.shape)} on {like.device} does not "
                             f"match the buffer's {tuple(self.tensor.shape)} on {self.tensor.device}")
        piece = Slice(self, self.filled, self.filled + channels)
        self.filled += channels
        self._slots.append(piece)
        return piece

    def write(self, part: torch.Tensor) -> torch.Tensor:
        """Copy ``part`` into the next slice (cast to the buffer's dtype); returns the slice, which
        :meth:`join` takes."""
        return _CopyInto.apply(part, self.slot(part, part.shape[1]))

    def join(self, *slices: torch.Tensor) -> torch.Tensor:
        """The concatenation: the buffer, once ``slices`` (the slices the writes returned, in
        order) fill every channel."""
        if self.filled != self.channels or len(slices) != len(self._slots):
            raise ValueError(f"ConcatBuffer.join: {self.filled} of {self.channels} channels written in "
                             f"{len(self._slots)} parts; got {len(slices)} slices")
        for piece, s in zip(self._slots, slices):
            if s.data_ptr() != piece.view().data_ptr() or s.shape[1] != piece.end - piece.start:
                raise ValueError(f"ConcatBuffer.join: the slice of channels {piece.start} to {piece.end} is "
                                 "not the buffer's (pass the slices the writes returned, in order)")
        return _Join.apply(self.tensor, [(p.start, p.end) for p in self._slots], *slices)


class _CopyInto(torch.autograd.Function):
    @staticmethod
    def forward(ctx, part, piece):
        piece.copy_(part)
        ctx.dtype = part.dtype
        return piece.view()

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


class _Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer, slots, *slices):
        ctx.slots = slots
        return buffer.view_as(buffer)

    @staticmethod
    def backward(ctx, grad):
        return (None, None, *(grad[:, start:end] for start, end in ctx.slots))


__all__ = ["ConcatBuffer", "Slice"]
