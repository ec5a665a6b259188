"""One-launch deterministic reductions: every program stores its partial, counts itself in on an
arrival counter, and the program that arrives last adds the partials up in a fixed order.

No float atomics, so a sum is bit-identical run to run whichever program finishes last. The
partials and counters are the per-stream scratch of :func:`trainfuse._runtime.launch.stream_workspace`;
the last program re-arms its counter, so the next launch on the stream finds it at zero.

- :func:`last_to_arrive`: the arrival protocol, for reductions with their own partials (the
  split-K weight grad's tiles in FusedMLP, the gradient norm's partials and inf/NaN flags).
- :func:`reduce_partials`: a scalar sum divided by a denominator (the losses' means and sums).
"""

import triton
import triton.language as tl


@triton.jit
def last_to_arrive(counter, nparts):
    """Count this program in on ``counter`` (after its partial is stored: the add releases it)
    and return whether it is the last of ``nparts`` (the add acquires the others' partials)."""
    return tl.atomic_add(counter, 1, sem="acq_rel") == nparts - 1


@triton.jit
def reduce_partials(partials, counter, out, part, nparts, denom):
    """Program ``pid``'s share of a one-launch sum: store ``part``; the last program to arrive
    writes ``out = sum(partials) / denom`` (added in float64 in a fixed order; a float64 ``out``
    gets that float64 value, within one ulp of the division on a GPU, with float64 partials for
    float64 inputs) and re-arms the counter."""
    tl.store(partials + tl.program_id(0), part)
    if last_to_arrive(counter, nparts):
        RB: tl.constexpr = 1024
        acc = tl.zeros([RB], tl.float64)
        for i in range(0, nparts, RB):
            o = i + tl.arange(0, RB)
            acc += tl.load(partials + o, mask=o < nparts, other=0.0, cache_modifier=".cg").to(tl.float64)
        total = tl.sum(acc, 0) / denom
        if out.dtype.element_ty == tl.float64:
            tl.store(out, total)
        else:
            # through float32: the interpreter's float64 -> bfloat16 conversion is wrong
            tl.store(out, total.to(tl.float32).to(out.dtype.element_ty))
        tl.store(counter, 0)


__all__ = ["last_to_arrive", "reduce_partials"]
