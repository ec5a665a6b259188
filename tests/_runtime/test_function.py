"""applier: our autograd Functions called straight through torch's C apply."""

import pytest
import torch

from trainfuse._runtime.function import applier


class _Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x.pow(3) * scale, k * 2

    @staticmethod
    def backward(ctx, g, _):
        (x,) = ctx.saved_tensors
        return 3 * x.square() * g * ctx.scale, None, None


@pytest.mark.parametrize("direct", [True, False, None])
def test_applier_gives_torchs_outputs_grad_fn_and_grads(direct):
    x = torch.randn(7, dtype=torch.float64, requires_grad=True)
    y, k = applier(_Cube, direct=direct)(x, 5, 0.5)
    assert k == 10 and type(y.grad_fn).__name__ == "_CubeBackward"
    y.sum().backward()
    torch.testing.assert_close(x.grad, 1.5 * x.detach().square(), rtol=0, atol=0)
    z = torch.randn(3)  # no input needs grad: no graph, as with cls.apply
    out, _ = applier(_Cube, direct=direct)(z, 1, 1.0)
    assert out.grad_fn is None and torch.equal(out, z.pow(3))


def test_under_a_functorch_transform_torchs_own_apply_runs():
    # the direct call is skipped while a transform is active: torch's apply answers, here with its
    # own error for a Function without setup_context
    fast = applier(_Cube, direct=True)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda t: fast(t, 1, 1.0)[0].sum())(torch.ones(3))


def test_a_function_with_setup_context_is_refused():
    class WithSetup(torch.autograd.Function):
        @staticmethod
        def forward(x, k=2):
            return x * k

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return g, None

    with pytest.raises(TypeError, match="WithSetup defines setup_context"):
        applier(WithSetup)
