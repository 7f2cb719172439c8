"""The torch.compile door builds a graph's kernels when it compiles the graph, side by side on worker threads
(fuser/dynamo/prebuild.py), the backward graph's when AOTAutograd partitions the joint graph: the same kernels as
first calls would build (no more), every one of a training step's built when its forward's first call returns, the
results eager's; a plan or a build that fails ahead changes nothing; symbolic shapes build nothing ahead. On the
CPU backend, with a CUDA twin marked gpu."""
import threading

import pytest
import torch
import torch.nn.functional as F

import fuser.dynamo  # noqa: F401 (registers backend="fuser")
from fuser import executor, native, settings
from fuser.dynamo import prebuild
from fuser.kernel_cache import STORE, KernelSpec


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def builds(monkeypatch):
    """Each kernel build while the test runs: (spec key, arg key, thread name); every kernel built before is set
    aside (``KernelStore.kernels_set_aside``) and the native hot path's launches forgotten, so that this test's calls
    build their own."""
    got = []
    kernel_for = KernelSpec.kernel_for

    def recorded(self, arg_spec, build):
        def build_and_record():
            got.append((self.key, arg_spec, threading.current_thread().name))
            return build()
        return kernel_for(self, arg_spec, build_and_record)

    monkeypatch.setattr(KernelSpec, "kernel_for", recorded)
    native.clear()
    with STORE.kernels_set_aside():
        yield got
        prebuild.wait()


def step(x, w, b, r):
    """A training step's function: residual, layer norm, GELU and a mean over the rows (a forward row group, its
    backward a row group that also sums the weight's and bias's gradients)."""
    h = F.layer_norm(x + r, (x.shape[-1],), w, b)
    return F.gelu(h * 2.0).mean(0)


def _inputs(device, dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    x, r = (torch.randn(48, 96, generator=g, dtype=dtype).to(device) for _ in range(2))
    w = (1 + 0.1 * torch.randn(96, generator=g, dtype=dtype)).to(device)
    b = (0.1 * torch.randn(96, generator=g, dtype=dtype)).to(device)
    return [t.requires_grad_() for t in (x, w, b)] + [r]


def _train_once(device, record):
    """One compiled step's forward and backward; (builds when the forward returned, outputs, gradients)."""
    args = _inputs(device)
    out = torch.compile(step, backend="fuser", dynamic=False)(*args)
    after_forward = list(record)
    out.backward(torch.ones_like(out))
    return after_forward, out.detach(), [a.grad for a in args[:3]]


def _check_against_eager(device, out, grads):
    args = _inputs(device)
    ref = step(*args)
    ref.backward(torch.ones_like(ref))
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-5)
    for g, a in zip(grads, args[:3]):
        torch.testing.assert_close(g, a.grad, rtol=1e-4, atol=1e-5)


def _kernels_built_ahead(device, builds, monkeypatch):
    after_forward, out, grads = _train_once(device, builds)
    _check_against_eager(device, out, grads)
    ahead = sorted((k, repr(a)) for k, a, _ in builds)
    assert len(ahead) >= 2  # the forward's row group and the backward's
    assert all(name.startswith("fuser-build") for *_, name in builds), builds
    # the backward's kernels too are built by the time the forward's first call returns
    assert len(after_forward) == len(builds)
    # the same kernels as first calls build one after another, no more
    monkeypatch.setattr(settings, "prebuild", False)
    torch._dynamo.reset()
    del builds[:]
    native.clear()
    with STORE.kernels_set_aside():
        after_forward, out, grads = _train_once(device, builds)
    _check_against_eager(device, out, grads)
    assert sorted((k, repr(a)) for k, a, _ in builds) == ahead
    # (on the calling thread, or on autograd's device thread for a CUDA backward)
    assert not any(name.startswith("fuser-build") for *_, name in builds), builds
    assert len(after_forward) < len(builds)  # (the backward's kernels at the backward's first call)


def test_a_training_steps_kernels_build_on_workers_when_it_compiles(builds, monkeypatch):
    _kernels_built_ahead("cpu", builds, monkeypatch)


@pytest.mark.gpu
def test_a_training_steps_kernels_build_on_workers_when_it_compiles_cuda(builds, monkeypatch):
    _kernels_built_ahead("cuda", builds, monkeypatch)


def test_a_plan_that_fails_ahead_leaves_the_first_calls_to_plan(builds, monkeypatch):
    def failing(spec, args):
        raise RuntimeError("planned ahead and failed")

    monkeypatch.setattr(executor, "kernel_builder", failing)
    _, out, grads = _train_once("cpu", builds)
    _check_against_eager("cpu", out, grads)
    assert builds and {name for *_, name in builds} == {threading.main_thread().name}


def test_a_build_that_fails_ahead_is_built_again_by_the_first_call(builds, monkeypatch):
    """The failure ahead is forgotten (``KernelSpec.kernel_for`` keeps no failed entry): the first call builds the
    kernel itself."""
    kernel_for = executor.kernel_for
    failed = []

    def failing_on_workers(spec, p):
        if threading.current_thread() is not threading.main_thread():
            failed.append(spec.key)
            return spec.kernel_for(getattr(p, "arg_spec", None) or p.key, _raise)
        return kernel_for(spec, p)

    monkeypatch.setattr(executor, "kernel_for", failing_on_workers)
    _, out, grads = _train_once("cpu", builds)
    _check_against_eager("cpu", out, grads)
    assert failed
    built_here = [k for k, _, name in builds if name == threading.main_thread().name]
    assert sorted(built_here) == sorted(failed)


def _raise():
    raise RuntimeError("a build that fails on a worker")


def test_symbolic_shapes_build_nothing_ahead(builds):
    def f(x, b):
        return torch.sigmoid(x * b + 1.0) * x - b

    compiled = torch.compile(f, backend="fuser", dynamic=True)
    b = torch.randn(6)
    for batch in (3, 5):
        x = torch.randn(batch, 6)
        torch.testing.assert_close(compiled(x, b), f(x, b), rtol=1e-5, atol=1e-6)
    assert len(builds) == 1 and builds[0][2] == threading.main_thread().name
