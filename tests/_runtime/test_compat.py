"""Each private torch internal of trainfuse._runtime.compat still exists and still does what the
code relies on. A failure here names the torch change to adapt to."""

from __future__ import annotations

import warnings

import pytest
import torch
import triton.language as tl
from torch.optim.optimizer import register_optimizer_step_pre_hook

from trainfuse._runtime import compat

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_current_raw_stream_is_the_current_streams_handle():
    side = torch.cuda.Stream()
    assert compat.current_raw_stream(torch.cuda.current_device()) == torch.cuda.current_stream().cuda_stream
    with torch.cuda.stream(side):
        assert compat.current_raw_stream(torch.cuda.current_device()) == side.cuda_stream


@cuda
def test_current_device_index_follows_torch_cuda_device():
    assert compat.current_device_index() == torch.cuda.current_device()


def test_cuda_entries_exist_in_cuda_builds():
    if torch.version.cuda is None:
        pytest.skip("CPU-only torch build: no CUDA entry points to check")
    assert callable(compat.current_raw_stream) and callable(compat.current_device_index)
    assert hasattr(torch._C, "_cuda_endAllocateToPool")


def test_will_engine_execute_node_tells_grad_from_backward():
    seen = {}
    a = torch.ones(2, requires_grad=True)
    b = torch.ones(2, requires_grad=True)
    out = (a * b).sum()
    node_a = out.grad_fn.next_functions[0][0].next_functions[0][0]  # AccumulateGrad of a

    def probe(grad):
        seen["a"] = compat.will_engine_execute_node(node_a)
        return grad

    out.grad_fn.register_prehook(lambda g: probe(g))
    torch.autograd.grad(out, [b], retain_graph=True)
    assert seen["a"] is False
    out.backward()
    assert seen["a"] is True


def test_function_c_apply_is_the_c_method_under_function_apply():
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return 2 * x

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    x = torch.ones(3, requires_grad=True)
    y = compat.function_c_apply.__get__(None, Twice)(x)
    y.sum().backward()
    assert torch.equal(y, 2 * torch.ones(3)) and torch.equal(x.grad, 2 * torch.ones(3))


def test_functorch_transforms_active_inside_vmap():
    seen = []
    torch.func.vmap(lambda t: seen.append(compat.functorch_transforms_active()) or t)(torch.ones(2, 3))
    assert seen == [True] and compat.functorch_transforms_active() is False


def test_profiler_enabled_follows_the_profiler():
    assert compat.profiler_enabled() is False
    with torch.autograd.profiler.profile():
        assert compat.profiler_enabled() is True


def test_addmm_activation_is_addmm_then_relu():
    b, x, w = torch.randn(5), torch.randn(3, 4), torch.randn(4, 5)
    torch.testing.assert_close(compat.addmm_activation(b, x, w), torch.relu(torch.addmm(b, x, w)))


def test_scalar_dtype_is_the_step_counter_dtype_of_torch_optim():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([p], foreach=False)
    p.grad = torch.ones(2)
    opt.step()
    assert opt.state[p]["step"].dtype == compat.scalar_dtype()


def test_optimizer_init_calls_the_step_patch_method_by_name():
    calls = []

    class Probe(torch.optim.SGD):
        pass

    setattr(Probe, compat.STEP_PATCH_METHOD, lambda self: calls.append(self))
    opt = Probe([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    assert calls == [opt]


def test_torch_calls_the_step_code_hook_after_each_step_inside_its_range():
    """torch's step wrapper calls ``_optimizer_step_code`` after the step, inside the step's
    profiler range (the profiler's Python tracer hooks that method's code object); compat's call
    is that method."""
    assert callable(torch.optim.Optimizer.__dict__["_optimizer_step_code"])
    seen = []

    class Probe(torch.optim.SGD):
        def _optimizer_step_code(self):
            seen.append(compat.profiler_enabled())

    p = torch.nn.Parameter(torch.ones(1))
    opt = Probe([p], lr=0.1)
    p.grad = torch.ones(1)
    opt.step()
    with torch.autograd.profiler.profile() as prof:
        opt.step()
    assert seen == [False, True]
    assert "Optimizer.step#Probe.step" in {e.name for e in prof.function_events}
    compat.run_optimizer_step_code(opt)
    assert len(seen) == 3
    compat.run_optimizer_step_code(torch.optim.SGD([p], lr=0.1))  # torch's own: does nothing


def test_zero_grad_reads_the_profile_name_compat_sets_as_torch_does():
    """``Optimizer.__init__``'s patch method sets ``_zero_grad_profile_name`` and ``zero_grad``
    names its profiler range by it (calling the patch method only when it is missing): compat's
    setter gives torch's own name, and a class whose patch method is compat's setter keeps it."""
    stock = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    torch_name = stock._zero_grad_profile_name
    del stock._zero_grad_profile_name
    compat.set_zero_grad_profile_name(stock)
    assert stock._zero_grad_profile_name == torch_name == "Optimizer.zero_grad#SGD.zero_grad"

    patches = []

    class Probe(torch.optim.SGD):
        pass

    def patch(self):
        patches.append(self)
        compat.set_zero_grad_profile_name(self)

    setattr(Probe, compat.STEP_PATCH_METHOD, patch)
    p = torch.nn.Parameter(torch.ones(1))
    opt = Probe([p], lr=0.1)
    assert opt._zero_grad_profile_name == "Optimizer.zero_grad#Probe.zero_grad" and len(patches) == 1
    opt._zero_grad_profile_name = "probe zero_grad range"  # what zero_grad reads, not recomputes
    p.grad = torch.ones(1)
    with torch.autograd.profiler.profile() as prof:
        opt.zero_grad(set_to_none=False)
    assert "probe zero_grad range" in {e.name for e in prof.function_events}
    assert len(patches) == 1  # the name was there: zero_grad did not patch again


def test_grad_scaler_hands_the_scale_to_a_step_that_supports_amp_scaling():
    """A class with ``STEP_SUPPORTS_AMP_SCALING`` True gets ``grad_scale`` and ``found_inf`` set for
    its ``step()``, with its grads left scaled; without it GradScaler unscales them first."""
    seen = {}

    class Probe(torch.optim.SGD):
        def step(self, closure=None):
            seen["grad_scale"] = getattr(self, "grad_scale", None)
            seen["found_inf"] = getattr(self, "found_inf", None)
            seen["grad"] = self.param_groups[0]["params"][0].grad.clone()

    for supports in (True, False):
        seen.clear()
        setattr(Probe, compat.STEP_SUPPORTS_AMP_SCALING, supports)
        p = torch.nn.Parameter(torch.ones(2))
        opt = Probe([p], lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        scaler.scale(p.sum()).backward()
        scaler.step(opt)
        if supports:
            assert float(seen["grad_scale"]) == 8.0 and float(seen["found_inf"]) == 0.0
            assert torch.equal(seen["grad"], torch.full((2,), 8.0))  # still scaled
            assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")  # removed after
        else:
            assert seen["grad_scale"] is None and seen["found_inf"] is None
            assert torch.equal(seen["grad"], torch.ones(2))  # unscaled by GradScaler


def test_step_hooks_are_the_ones_torch_registers_in_its_order():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    assert not compat.has_step_hooks(opt)
    mine = opt.register_step_pre_hook(lambda *a: None)
    pre_global = register_optimizer_step_pre_hook(lambda *a: None)
    post = opt.register_step_post_hook(lambda *a: None)
    try:
        assert compat.has_step_hooks(opt)
        pre, posts = compat.step_hooks(opt)
        assert len(pre) == 2 and len(posts) == 1
        assert pre[0] is compat.global_step_pre_hooks[pre_global.id]
    finally:
        mine.remove(), pre_global.remove(), post.remove()
    assert not compat.has_step_hooks(opt)


def test_schedulers_see_a_marked_step_and_do_not_warn():
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    other = torch.optim.SGD([p], lr=0.1)
    sched.optimizer = other  # what re-pointing does
    compat.mark_step_for_schedulers(other)
    p.grad = torch.ones(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        other.step()
        sched.step()
    assert other.param_groups[0]["lr"] == pytest.approx(0.01)


def test_a_step_function_put_on_the_optimizer_is_marked_for_its_scheduler():
    """``mark_step_for_schedulers(opt, func)``: ``opt.step`` becomes ``func`` (called with the
    optimizer), in place of a scheduler's earlier wrapper, and the scheduler sees it stepped."""
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    calls = []

    def step(this, closure=None):
        calls.append(this)
        return type(this).step(this, closure)

    compat.mark_step_for_schedulers(opt, step)
    p.grad = torch.ones(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
        sched.step()
    assert calls == [opt] and p.item() == pytest.approx(0.9)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)


def test_a_scheduler_warns_when_the_step_was_never_recorded():
    """The converse of the test above: torch still checks the mark (else the wrapper is moot)."""
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    sched.optimizer = other = torch.optim.SGD([p], lr=0.1)
    compat.mark_step_for_schedulers(other)
    with pytest.warns(UserWarning, match="optimizer.step"):
        sched.step()


def test_inner_schedulers_of_sequential_and_chained():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    a = torch.optim.lr_scheduler.LinearLR(opt, 0.5, total_iters=2)
    b = torch.optim.lr_scheduler.StepLR(opt, 1)
    seq = torch.optim.lr_scheduler.SequentialLR(opt, [a, b], milestones=[2])
    chained = torch.optim.lr_scheduler.ChainedScheduler([a, b])
    assert list(compat.inner_schedulers(seq)) == [a, b]
    assert list(compat.inner_schedulers(chained)) == [a, b]
    assert list(compat.inner_schedulers(a)) == []


def test_module_hooks_lists_the_hooks_registered_on_the_module():
    lin = torch.nn.Linear(2, 2)
    assert compat.module_hooks(lin) == []
    handles = [lin.register_forward_hook(lambda *a: None),
               lin.register_full_backward_pre_hook(lambda *a: None)]
    assert compat.module_hooks(lin) == ["forward", "backward_pre"]
    assert compat.module_hooks(lin, ("forward_pre", "backward")) == []
    for h in handles:
        h.remove()
    assert compat.module_hooks(lin) == []


def test_tensor_grad_hooks_sees_both_kinds():
    p = torch.nn.Parameter(torch.ones(2))
    assert not compat.tensor_grad_hooks(p)
    h = p.register_hook(lambda g: g)
    assert compat.tensor_grad_hooks(p)
    h.remove()
    h = p.register_post_accumulate_grad_hook(lambda t: None)
    assert compat.tensor_grad_hooks(p)
    h.remove()
    assert not compat.tensor_grad_hooks(p)


def test_parameters_of_is_what_attribute_access_returns():
    lin = torch.nn.Linear(2, 3)
    assert compat.parameters_of(lin)["weight"] is lin.weight and compat.parameters_of(lin)["bias"] is lin.bias
    assert compat.parameters_of(torch.nn.Linear(2, 3, bias=False))["bias"] is None


def test_compiled_original_unwraps_torch_compile_only():
    lin = torch.nn.Linear(2, 2)
    assert compat.compiled_original(torch.compile(lin)) is lin
    assert compat.compiled_original(lin) is None


def test_norm_base_covers_batch_and_instance_norm():
    for cls in (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.SyncBatchNorm, torch.nn.InstanceNorm2d):
        assert issubclass(cls, compat.NormBase)
    assert not issubclass(torch.nn.LayerNorm, compat.NormBase)


def test_triton_allocator_query_follows_set_allocator():
    import threading

    import triton

    def fresh_thread() -> None:  # Triton's allocator is per thread: this one's is the null one
        seen.append(compat.triton_allocator_is_null())
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8))
        seen.append(compat.triton_allocator_is_null())

    seen = []
    # in a thread of its own: a CPU allocator left on this process's main thread would hand CPU
    # scratch to every later kernel that makes tensor descriptors here
    thread = threading.Thread(target=fresh_thread)
    thread.start(), thread.join()
    assert seen == [True, False]


@pytest.mark.parametrize("enabled", [True, False])
def test_grad_scaler_keeps_the_state_trainfuses_subclass_reads(enabled):
    from torch.amp.grad_scaler import OptState

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=2, enabled=enabled)
    if not enabled:  # a disabled scaler sets nothing else: trainfuse's checks _enabled first
        assert scaler._enabled is False
        return
    for name in compat.GRAD_SCALER_STATE:
        assert hasattr(scaler, name), name
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale(p.sum()).backward()
    scale, tracker = scaler._scale, scaler._growth_tracker
    assert scale.dtype == torch.float32 and tracker.dtype == torch.int32 and float(scale) == 16.0
    assert (scaler._growth_factor, scaler._backoff_factor, scaler._growth_interval) == (2.0, 0.5, 2)
    scaler.unscale_(opt)
    assert compat.scaler_optimizer_states(scaler)[id(opt)]["stage"] is OptState.UNSCALED
    compat.scaler_optimizer_states(scaler).clear()  # unscale_ may run again
    scaler.unscale_(opt)
    scaler.step(opt)
    assert compat.scaler_optimizer_states(scaler)[id(opt)]["stage"] is OptState.STEPPED
    scaler.update()
    assert not compat.scaler_optimizer_states(scaler) and int(scaler._growth_tracker) == 1
    with pytest.raises(AssertionError, match="step but _scale is None"):
        torch.amp.GradScaler("cpu")._check_scale_growth_tracker("step")


def _local_tensor_worker(rank: int, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{root}/init", rank=rank, world_size=1)
    try:
        mesh = dist.device_mesh.init_device_mesh("cpu", (1,))
        t = torch.nn.Parameter(distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)]))
        shard = compat.local_tensor(t)
        assert isinstance(t, DTensor) and type(shard) in (torch.Tensor, torch.nn.Parameter)
        with torch.no_grad():
            public = t.to_local()
        assert shard.data_ptr() == public.data_ptr() and shard.shape == public.shape
        shard.add_(1)  # the very storage the DTensor holds
        assert torch.equal(t.full_tensor(), torch.arange(1.0, 7.0).reshape(3, 2))
    finally:
        dist.destroy_process_group()


def test_local_tensor_is_the_shard_the_dtensor_holds(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_local_tensor_worker, args=(str(tmp_path),), nprocs=1, join=True)


def _kernel_source(x, n, m, BLOCK: tl.constexpr):  # noqa: N803 - Triton's constexpr naming
    pass


@pytest.mark.parametrize("given", [["n"], [1]])
def test_unspecialized_args_read_the_decorator_compiled_and_interpreted(given):
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for kind in (JITFunction, InterpretedFunction):
        assert compat.unspecialized_args(kind(_kernel_source, do_not_specialize=given)) == {"n"}, kind
        assert compat.unspecialized_args(kind(_kernel_source)) == frozenset(), kind


def test_compiled_kernels_fill_their_register_count_as_their_module_loads():
    """``compiled_resources`` calls ``CompiledKernel._init_handles``, which sets ``n_regs`` from
    the driver's module load (the one-launch BatchNorm sizes its grid by it)."""
    import inspect

    from triton.compiler.compiler import CompiledKernel

    assert callable(getattr(CompiledKernel, "_init_handles", None))
    assert "self.n_regs" in inspect.getsource(CompiledKernel._init_handles)

    class Old:  # a compiled kernel without the call answers None
        pass

    assert compat.compiled_resources(Old()) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="loads a module onto a GPU")
def test_compiled_resources_of_a_kernel_on_the_gpu():
    import triton

    kernel = triton.jit(_kernel_source)
    x = torch.zeros(16, device="cuda")
    regs, shared = compat.compiled_resources(kernel.warmup(x, 16, 16, BLOCK=16, grid=(1,)))
    assert isinstance(regs, int) and 0 <= regs <= 255 and shared >= 0  # an empty kernel may hold none
