"""The torch.compile door builds a graph's kernels when it compiles the graph, side by side on worker threads
(fuser/dynamo/prebuild.py), the backward graph's when AOTAutograd partitions the joint graph: the same kernels as
first calls would build (no more), every one of a training step's started by the time its forward's first call
returns (a ReLU's backward with its 0-dim constant too), each group and signature planned once however many calls
of it a graph makes, the results eager's; a plan or a build that fails ahead changes nothing; symbolic shapes build
nothing ahead; a forked child compiles with workers of its own. On the CPU backend, with a CUDA twin marked gpu."""
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.nn.functional as F

import fuser.dynamo  # noqa: F401 (registers backend="fuser")
from fuser import executor, settings
from fuser.bench.caches import own_builds
from fuser.dynamo import prebuild
from fuser.kernel_cache import KernelSpec


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def builds(monkeypatch):
    """Each kernel build while the test runs, as it starts: (spec key, arg key, thread name); the kernels built before
    set aside and the native hot path's launches forgotten (``bench.caches.own_builds``, as the benchmark does for a
    first call), so that this test's calls build their own."""
    got = []
    kernel_for = KernelSpec.kernel_for

    def recorded(self, arg_spec, build):
        def build_and_record():
            got.append((self.key, arg_spec, threading.current_thread().name))
            return build()
        return kernel_for(self, arg_spec, build_and_record)

    monkeypatch.setattr(KernelSpec, "kernel_for", recorded)
    with own_builds():
        yield got
        prebuild.wait()


def step(x, w, b, r):
    """A training step's function: residual, layer norm, GELU and a mean over the rows (a forward row group, its
    backward a row group that also sums the weight's and bias's gradients)."""
    h = F.layer_norm(x + r, (x.shape[-1],), w, b)
    return F.gelu(h * 2.0).mean(0)


def relu_step(x, w, b, r):
    """A ReLU's backward is a where(mask, grad, 0.) with a 0-dim tensor constant, beside the weight's and bias's
    gradients summed over the rows."""
    return (F.relu(x * w + b) * r).sum(0)


def _inputs(device, dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    x, r = (torch.randn(48, 96, generator=g, dtype=dtype).to(device) for _ in range(2))
    w = (1 + 0.1 * torch.randn(96, generator=g, dtype=dtype)).to(device)
    b = (0.1 * torch.randn(96, generator=g, dtype=dtype)).to(device)
    return [t.requires_grad_() for t in (x, w, b)] + [r]


def _train_once(device, record, fn=step):
    """One compiled step's forward and backward; (builds started when the forward returned, outputs, gradients)."""
    args = _inputs(device)
    out = torch.compile(fn, backend="fuser", dynamic=False)(*args)
    after_forward = list(record)
    out.backward(torch.ones_like(out))
    return after_forward, out.detach(), [a.grad for a in args[:3]]


def _check_against_eager(device, out, grads, fn=step):
    args = _inputs(device)
    ref = fn(*args)
    ref.backward(torch.ones_like(ref))
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-5)
    for g, a in zip(grads, args[:3]):
        torch.testing.assert_close(g, a.grad, rtol=1e-4, atol=1e-5)


def _kernels_built_ahead(device, builds, monkeypatch, fn=step):
    after_forward, out, grads = _train_once(device, builds, fn)
    _check_against_eager(device, out, grads, fn)
    ahead = sorted((k, repr(a)) for k, a, _ in builds)
    assert len(ahead) >= 2  # the forward's group and the backward's
    assert all(name.startswith("fuser-build") for *_, name in builds), builds
    # the backward's kernels too started building before the forward's first call returned
    assert len(after_forward) == len(builds)
    # the same kernels as first calls build one after another, no more
    monkeypatch.setattr(settings, "prebuild", False)
    torch._dynamo.reset()
    del builds[:]
    with own_builds():
        after_forward, out, grads = _train_once(device, builds, fn)
    _check_against_eager(device, out, grads, fn)
    assert sorted((k, repr(a)) for k, a, _ in builds) == ahead
    # (on the calling thread, or on autograd's device thread for a CUDA backward)
    assert not any(name.startswith("fuser-build") for *_, name in builds), builds
    assert len(after_forward) < len(builds)  # (the backward's kernels at the backward's first call)


@pytest.mark.parametrize("fn", (step, relu_step), ids=lambda f: f.__name__)
def test_a_training_steps_kernels_build_on_workers_when_it_compiles(builds, monkeypatch, fn):
    _kernels_built_ahead("cpu", builds, monkeypatch, fn)


@pytest.mark.gpu
@pytest.mark.parametrize("fn", (step, relu_step), ids=lambda f: f.__name__)
def test_a_training_steps_kernels_build_on_workers_when_it_compiles_cuda(builds, monkeypatch, fn):
    _kernels_built_ahead("cuda", builds, monkeypatch, fn)


def test_equal_layers_plan_their_group_once(builds, monkeypatch):
    """Four calls of one group (the layers between the matmuls), forward and backward: each group and signature is
    planned once, and built once."""
    planned = []
    kernel_builder = executor.kernel_builder

    def counted(spec, args):
        planned.append((spec.key, tuple((a.dtype, tuple(a.shape), a.stride()) for a in args)))
        return kernel_builder(spec, args)

    monkeypatch.setattr(executor, "kernel_builder", counted)

    def layers(x, w):
        for _ in range(4):
            x = torch.tanh(x @ w) * 0.5 + x
        return x

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(16, 32, generator=g), (0.2 * torch.randn(32, 32, generator=g)).requires_grad_()
    out = torch.compile(layers, backend="fuser", dynamic=False)(x, w)
    out.backward(torch.ones_like(out))
    ref_w = w.detach().clone().requires_grad_()
    ref = layers(x, ref_w)
    ref.backward(torch.ones_like(ref))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, ref_w.grad, rtol=1e-4, atol=1e-5)
    assert len(planned) >= 2 and len(set(planned)) == len(planned), planned
    assert len(builds) == len(planned)


def test_a_plan_that_fails_ahead_leaves_the_first_calls_to_plan(builds, monkeypatch):
    failed = []

    def failing(spec, args):
        failed.append(spec.key)
        raise RuntimeError("planned ahead and failed")

    monkeypatch.setattr(executor, "kernel_builder", failing)
    _, out, grads = _train_once("cpu", builds)
    _check_against_eager("cpu", out, grads)
    assert len(failed) >= 2
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


def test_a_forked_child_compiles_with_workers_of_its_own():
    """After a parent's compile started the workers, a forked child's compile (a DataLoader worker's) builds with
    threads of its own: the parent's do not exist in the child."""
    script = textwrap.dedent("""
        import os, signal, sys, torch
        import fuser.dynamo
        from fuser.dynamo import prebuild
        f = torch.compile(lambda x: torch.sigmoid(x * 2 + 1), backend="fuser", dynamic=False)
        x = torch.randn(8, 8)
        torch.testing.assert_close(f(x), torch.sigmoid(x * 2 + 1))
        pid = os.fork()
        if pid == 0:
            signal.alarm(120)  # (a build queued for the parent's threads would never run: wait() would hang)
            g = torch.compile(lambda x: torch.tanh(x * 3 - 1).cos(), backend="fuser", dynamic=False)
            y = torch.randn(16, 4)
            torch.testing.assert_close(g(y), torch.tanh(y * 3 - 1).cos())
            prebuild.wait()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
