"""The torch.compile door (fuser/dynamo/): ``torch.compile(fn, backend="fuser")`` against eager PyTorch, on the
CPU backend (CUDA twins marked gpu): pointwise functions fused into compiled kernels, models trained step by step
with eager's losses (a transformer block, an LSTM cell, a CNN block with inference batch norm), no_grad and
inference mode, graph breaks, dynamic shapes without recompiles or new kernels, the fallback on a backend error,
and the backend's registration (by import and through setup.py's entry point)."""
import contextlib
import copy
import inspect
import operator
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fuser
import fuser.dynamo  # registers backend="fuser" (an installed fuser needs no import: the entry point)
from fuser import settings
from fuser.dynamo import aot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


@contextlib.contextmanager
def recording():
    """The ATen graphs the backend compiles: (name, rewritten graph module, partition, specs) each."""
    got = []

    def listen(name, gm, part, specs):
        got.append((name, gm, part, specs))

    aot.listeners.append(listen)
    try:
        yield got
    finally:
        aot.listeners.remove(listen)


def group_calls(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and hasattr(n.target, "fuser_spec"))


def assert_ran_fused(specs, device_type="cpu"):
    """Every group has a kernel compiled by fuser's backend for ``device_type`` (built only when the executor
    planned the inputs: a group that fell back has none)."""
    assert specs
    for s in specs:
        kernels = [k for k in s.kernels().values() if k is not None]
        assert kernels, f"group {s.key} never ran as a kernel:\n{s.text}"
        # a row kernel (a group with a reduction, fuser/rows/) names its target
        assert all((k.arg_spec.device_type if hasattr(k, "arg_spec") else k.target) == device_type for k in kernels)


def pointwise(x, b):
    """Python scalars in Tensor slots (1.0 - t is rsub, 0.5 * t a mul by a wrapped number), a broadcast row."""
    a = torch.sigmoid(x * b + 1.0)
    return (1.0 - a) * torch.tanh(x) + F.silu(b) * 0.5, a.relu()


def _check_pointwise(device, dtype):
    x = torch.randn(33, 65, device=device, dtype=dtype)
    b = torch.randn(65, device=device, dtype=dtype)
    compiled = torch.compile(pointwise, backend="fuser", dynamic=False)
    with recording() as graphs:
        out = compiled(x, b)
    ref = pointwise(x, b)
    ref64 = pointwise(x.double(), b.double())
    for o, r, r64 in zip(out, ref, ref64):
        assert o.dtype == r.dtype and o.shape == r.shape and o.device == r.device
        # as close to float64's answer as eager itself is (a fused kernel rounds less, not more)
        err, eager_err = (o.double() - r64).abs().max().item(), (r.double() - r64).abs().max().item()
        assert err <= 4 * eager_err + torch.finfo(dtype).eps * 4, (err, eager_err)
    [(name, gm, part, specs)] = graphs
    assert name.endswith("inference")
    assert len(part.regions) == 1 and group_calls(gm) == 1  # one launch for all 9 pointwise ops
    assert len(part.regions[0].nodes) >= 8
    assert_ran_fused(specs, device)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
def test_a_pointwise_function_runs_as_one_compiled_kernel(dtype):
    _check_pointwise("cpu", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=str)
def test_a_pointwise_function_runs_as_one_compiled_kernel_cuda(dtype):
    _check_pointwise("cuda", dtype)


# ---- models trained step by step against eager -------------------------------------------------------------

class Block(nn.Module):
    """A pre-norm transformer block: attention through scaled_dot_product_attention, an MLP with GELU and dropout."""

    def __init__(self, d=16, heads=2, p=0.0):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)
        self.heads = heads

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, 2)
        q, k, v = [t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v)]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(a)
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh")))


class LSTMCell(nn.Module):
    def __init__(self, n_in=8, hidden=16):
        super().__init__()
        self.ih, self.hh = nn.Linear(n_in, 4 * hidden), nn.Linear(hidden, 4 * hidden)

    def forward(self, x, h, c):
        i, f, g, o = (self.ih(x) + self.hh(h)).chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c


class ConvBlock(nn.Module):
    """Conv, BatchNorm (eval: running statistics), ReLU, pooled into a linear head."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(8, 4)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-0.5, 0.5)
        self.eval()

    def forward(self, x):
        return self.head(F.relu(self.bn(self.conv(x))).mean((2, 3)))


def train(model, batches, compiled, steps=20, device="cpu"):
    """Losses of ``steps`` SGD steps, the random state reset the same way for eager and compiled runs."""
    model = model.to(device)
    torch.manual_seed(1234)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    fn = torch.compile(model, backend="fuser", dynamic=False) if compiled else model
    losses = []
    for args, target in batches:
        out = fn(*[a.to(device) for a in args])
        out = out if isinstance(out, tuple) else (out,)
        loss = sum(F.mse_loss(o, t.to(device)) for o, t in zip(out, target))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _batches(kind, steps=20):
    out = []
    for _ in range(steps):
        if kind == "block":
            out.append(((torch.randn(2, 5, 16),), (torch.randn(2, 5, 16),)))
        elif kind == "lstm":
            out.append(((torch.randn(3, 8), torch.randn(3, 16), torch.randn(3, 16)),
                        (torch.randn(3, 16), torch.randn(3, 16))))
        else:
            out.append(((torch.randn(2, 3, 6, 6),), (torch.randn(2, 4),)))
    return out


_MODELS = {"block": Block, "lstm": LSTMCell, "conv": ConvBlock}


def _check_training(kind, device="cpu", **kw):
    model = _MODELS[kind](**kw)
    batches = _batches(kind)
    eager = train(copy.deepcopy(model), batches, compiled=False, device=device)
    with recording() as graphs:
        fused = train(copy.deepcopy(model), batches, compiled=True, device=device)
    # step by step: every step's loss is eager's, so every gradient and update was eager's too
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(eager), rtol=2e-5, atol=1e-6)
    kinds = [name.split()[-1] for name, *_ in graphs]
    assert kinds == ["forward", "backward"], kinds  # one graph, compiled once: no recompile over 20 steps
    backward = graphs[1]
    assert group_calls(backward[1]) >= 1  # the backward is fused too
    specs = [s for *_, specs in graphs for s in specs]
    assert_ran_fused(specs, device)
    assert_every_compute_node_is_explained(graphs)
    return graphs


def assert_every_compute_node_is_explained(graphs):
    """Each compute node of each ATen graph is in a group or left out with a reason (fuser.explain's records)."""
    from fuser.dynamo.support import is_compute
    for name, _, part, _ in graphs:
        grouped = {n for r in part.regions for n in r.nodes}
        graph = next(iter(grouped or part.left_out)).graph
        for n in graph.nodes:
            if is_compute(n) and n.target is not torch.ops.aten.scalar_tensor.default:
                assert n in grouped or part.left_out.get(n), (name, n.format_node())


def test_a_transformer_block_trains_with_eagers_losses():
    graphs = _check_training("block")
    backward_ops = [len(r.nodes) for r in graphs[1][2].regions]
    assert max(backward_ops) >= 10  # GELU's backward (decomposed) is one group


def test_a_transformer_block_with_dropout_trains_fused_with_eagers_random_stream():
    # native_dropout stays ATen: the random stream, and so every loss, is eager's
    graphs = _check_training("block", p=0.25)
    left = [r for *_, part, _ in graphs for r in part.left_out.values()]
    assert any("native_dropout" in r for r in left)


def test_an_lstm_cell_trains_with_eagers_losses():
    graphs = _check_training("lstm")
    forward = graphs[0][2]
    # the gates' sigmoids and tanhs and the cell update: one group over the chunks
    assert len(forward.regions) == 1 and len(forward.regions[0].nodes) >= 8


def test_a_cnn_block_with_inference_batch_norm_trains_with_eagers_losses():
    graphs = _check_training("conv")
    forward = graphs[0][2]
    # batch norm with running statistics becomes pointwise ops, fused with the ReLU
    names = [n.target.name() for r in forward.regions for n in r.nodes]
    assert "aten::relu" in names and "aten::mul.Tensor" in names


def test_training_batch_norm_stays_one_op_and_updates_its_running_statistics():
    model = ConvBlock().train()
    batches = _batches("conv", steps=3)
    eager_model, fused_model = copy.deepcopy(model), copy.deepcopy(model)
    eager = train(eager_model, batches, compiled=False)
    with recording() as graphs:
        fused = train(fused_model, batches, compiled=True)
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(eager), rtol=2e-5, atol=1e-6)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(fused_model.bn, name), getattr(eager_model.bn, name))
    ops = {n.target for n in graphs[0][1].graph.nodes if n.op == "call_function"}
    assert torch.ops.aten._native_batch_norm_legit_functional.default in ops  # not decomposed in training


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(_MODELS))
def test_models_train_with_eagers_losses_cuda(kind):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):  # one conv algorithm
        _check_training(kind, device="cuda")


def test_values_saved_for_the_backward_are_inputs_or_come_out_of_forward_groups_with_eagers_gradients():
    def f(x, w):
        s = torch.sigmoid(x * w + 0.25)
        return s * torch.tanh(x) - s.square()

    x = torch.randn(6, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, requires_grad=True)
    with recording() as graphs:
        out = torch.compile(f, backend="fuser", dynamic=False)(x, w)
        go = torch.randn_like(out)
        first = torch.autograd.grad(out, (x, w), go, retain_graph=True)
        again = torch.autograd.grad(out, (x, w), go)
    ref = f(x, w)
    want = torch.autograd.grad(ref, (x, w), go)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b, e in zip(first, again, want):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)
        assert torch.equal(a, b)  # the saved tensors were not overwritten by the first backward
    (fw_name, fw, fw_part, _), (bw_name, bw, bw_part, _) = graphs
    assert fw_name.endswith("forward") and bw_name.endswith("backward")
    # what the backward reads (AOTAutograd's saved tensors) are the inputs or come out of the forward's group: the
    # rematerializing partitioner has the backward group recompute pointwise values rather than save them
    [region] = fw_part.regions
    output = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    saved = [a for a in output.args[0][1:] if isinstance(a, torch.fx.Node)]
    assert saved and all(a.op == "placeholder" or hasattr(a.target, "fuser_spec") or (
        a.target is operator.getitem and hasattr(a.args[0].target, "fuser_spec")) for a in saved)
    assert group_calls(bw) == 1  # one backward group: no alias between its ops splits it


def test_the_doors_groups_run_as_cuda_kernels_in_the_host_emulation():
    """The groups this door makes (Python numbers in Tensor slots, scalar_tensor constants in a where, decomposed
    backward ops) through their CUDA source, emulated on the host (fuser/cuda/emulate.py), against eager's ops."""
    def f(x, w, b):
        h = F.gelu(x * w + b, approximate="tanh")
        return F.relu(h) * torch.sigmoid(1.0 - h)

    args = [torch.randn(5, 24, requires_grad=True), torch.randn(24, requires_grad=True), torch.randn(24)]
    with recording() as graphs:
        out = torch.compile(f, backend="fuser", dynamic=False)(*args)
        out.backward(torch.randn_like(out))
    assert _emulated_regions(graphs) >= 2
    texts = "\n".join(s.text for *_, specs in graphs for s in specs)
    assert "tensor(float32, [], [0.0])" in texts and "aten::rsub" in texts


def _emulated_regions(graphs, tol=1e-5) -> int:
    """Runs every group of ``graphs`` (recorded door graphs) through its CUDA source emulated on the host, on
    fresh random inputs of the region's shapes and dtypes, against the interpreter's eager ops (float16/bfloat16
    outputs, and any floating output of float16/bfloat16 inputs: against the ops in float64, within ``tol`` of the
    output's magnitude, since the kernel rounds once where eager's ops round each step: a weight's gradient summed
    over 32 rows of bfloat16 is off by an ulp of 4, 0.03, now and then); returns how many."""
    from fuser import fallback
    from fuser.cuda import emulate
    from fuser.rows import emulate as row_emulate

    checked = 0
    for _, _, part, specs in graphs:
        for region, spec in zip(part.regions, specs):
            inputs = [torch.randn(tuple(n.meta["val"].shape), dtype=n.meta["val"].dtype)
                      if n.meta["val"].is_floating_point() else torch.rand(tuple(n.meta["val"].shape)) > 0.5
                      for n in region.inputs]
            # (a group with a reduction, such as the weight's gradient summed over the rows, is a row or column
            # kernel: fuser/rows/'s emulation)
            got = (row_emulate.run(spec.group, inputs) if spec.has_reduction else
                   emulate.run_graph(spec.group, inputs))
            assert got is not None, spec.text
            want = fallback.evaluate(spec.group, inputs)
            want64 = fallback.evaluate(spec.group, [x.double() if x.is_floating_point() else x for x in inputs])
            reduced = any(x.dtype in (torch.float16, torch.bfloat16) for x in inputs)
            for o, r, r64 in zip(got, want, want64):
                assert o.dtype == r.dtype and o.shape == r.shape
                # (a float32 result of float16/bfloat16 values, such as a weight's gradient summed in float32 over the
                # rows: eager's ops round the values it sums, the kernel does not)
                if o.dtype in (torch.float16, torch.bfloat16) or (reduced and o.is_floating_point()):
                    scale = max(1.0, r64.abs().max().item()) if r64.numel() else 1.0
                    torch.testing.assert_close(o.double(), r64.double(), rtol=tol, atol=tol * scale)
                else:
                    torch.testing.assert_close(o, r, rtol=tol, atol=tol)
            checked += 1
    return checked


# ---- modes, graph breaks, dynamic shapes ----------------------------------------------------------------------

def _act(x, w):
    return F.gelu(x * w + 0.5, approximate="tanh") * torch.sigmoid(w)


@pytest.mark.parametrize("mode", ("no_grad", "inference_mode"))
def test_no_grad_and_inference_mode_run_the_inference_graph_fused(mode):
    x, w = torch.randn(9, 17), torch.randn(17, requires_grad=True)
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with recording() as graphs, ctx:
        out = torch.compile(_act, backend="fuser", dynamic=False)(x, w)
        ref = _act(x, w)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert not out.requires_grad
    [(name, gm, part, specs)] = graphs
    assert name.endswith("inference") and group_calls(gm) == 1
    assert_ran_fused(specs)


def test_autocast_bfloat16_fuses_the_lower_precision_ops():
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(approximate="tanh"), nn.Linear(32, 16))
    x = torch.randn(6, 16)

    def f(t):
        h = model(t)
        return t + torch.sigmoid(h) * h  # after the bfloat16 linear: bfloat16 values, a float32 residual

    with recording() as graphs, torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.compile(f, backend="fuser", dynamic=False)(x)
        ref = f(x)
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1.6e-2)
    [(_, gm, part, specs)] = graphs
    assert any(len(r.nodes) >= 3 for r in part.regions)
    assert_ran_fused(specs)
    kernels = [k for s in specs for k in s.kernels().values() if k is not None]
    assert any(d.dtype == torch.bfloat16 for k in kernels for d in k.arg_spec.inputs)


def test_a_graph_break_gives_two_fused_graphs():
    def f(x):
        y = torch.tanh(x) * 2 - 1
        torch._dynamo.graph_break()
        return torch.sigmoid(y) * y + 1

    x = torch.randn(7, 5)
    with recording() as graphs:
        out = torch.compile(f, backend="fuser", dynamic=False)(x)
    torch.testing.assert_close(out, f(x), rtol=1e-5, atol=1e-6)
    assert len(graphs) == 2 and all(group_calls(gm) == 1 for _, gm, _, _ in graphs)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


def test_dynamic_shapes_compile_once_and_reuse_one_kernel_per_signature():
    def f(x, b):
        return torch.sigmoid(x * b + 1.0) * x - b

    b = torch.randn(6)
    compiled = torch.compile(f, backend="fuser", dynamic=True)
    with recording() as graphs, torch._dynamo.config.patch(error_on_recompile=True):
        compiled(torch.randn(2, 6), b)
        before = fuser.n_compiled_kernels()
        for batch in (3, 5, 8, 13):
            x = torch.randn(batch, 6)
            torch.testing.assert_close(compiled(x, b), f(x, b), rtol=1e-5, atol=1e-6)
    assert len(graphs) == 1 and group_calls(graphs[0][1]) == 1
    assert fuser.n_compiled_kernels() == before  # the executor specializes on dtypes and layouts, not sizes
    [spec] = graphs[0][3]
    assert len([k for k in spec.kernels().values() if k is not None]) == 1
    # a new dtype is a new signature: a new kernel, still no recompile of the graph
    with torch._dynamo.config.patch(error_on_recompile=False):
        x64 = torch.randn(4, 6, dtype=torch.float64)
        torch.testing.assert_close(torch.compile(f, backend="fuser", dynamic=True)(x64, b.double()),
                                   f(x64, b.double()))


def test_integer_and_mixed_dtypes_follow_eagers_promotion():
    def f(i, x):
        return (i * 3 + 1) * x + (i > 0)

    i, x = torch.randint(-4, 5, (5, 6)), torch.randn(5, 6, dtype=torch.float64)
    with recording() as graphs:
        out = torch.compile(f, backend="fuser", dynamic=False)(i, x)
    ref = f(i, x)
    assert out.dtype == ref.dtype == torch.float64
    torch.testing.assert_close(out, ref)
    assert group_calls(graphs[0][1]) == 1


# ---- errors, fallback, registration -------------------------------------------------------------------------

def test_an_error_inside_the_backend_runs_the_graph_unfused_and_warns_once(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("partitioner exploded")

    monkeypatch.setattr(aot, "partition", broken)
    monkeypatch.setattr(settings, "strict_pass", False)
    monkeypatch.setattr(aot, "_warned", False)
    x = torch.randn(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = torch.compile(lambda t: (t * 2).sin(), backend="fuser")(x)
        b = torch.compile(lambda t: (t + 1).cos(), backend="fuser")(x)
    torch.testing.assert_close(a, (x * 2).sin())
    torch.testing.assert_close(b, (x + 1).cos())
    ours = [w for w in caught if "fuser: compiling" in str(w.message)]
    assert len(ours) == 1 and "partitioner exploded" in str(ours[0].message)


def test_errors_are_torch_compiles_own_not_the_backends():
    """Bad input raises what torch.compile raises with Dynamo's own eager backend, never BackendCompilerFailed."""
    x, y = torch.randn(3, 4), torch.randn(5)
    errors = []
    for backend in ("fuser", "eager"):
        torch._dynamo.reset()
        with pytest.raises(Exception) as e:
            torch.compile(lambda a, b: (a * b).exp(), backend=backend, dynamic=False)(x, y)
        errors.append(e.value)
    assert type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1])
    assert not isinstance(errors[0], torch._dynamo.exc.BackendCompilerFailed)


def test_the_backend_is_registered_once():
    assert "fuser" in torch._dynamo.list_backends(exclude_tags=())
    assert fuser.dynamo.register() is None  # a second registration is skipped, not an error


def test_setup_py_entry_point_finds_the_backend_without_an_import(tmp_path):
    # the metadata setup.py writes (egg-info) is what importlib.metadata reads for an installed package
    r = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    # fixed inputs (CI is deterministic); sin(2x) + 1 cancels near sin = -1, so the bound is absolute
    code = ("import sys, torch\n"
            "torch.manual_seed(0)\n"
            "x = torch.randn(8)\n"
            "out = torch.compile(lambda t: (t * 2).sin() + 1, backend='fuser')(x)\n"
            "torch.testing.assert_close(out, (x * 2).sin() + 1, rtol=1e-6, atol=1e-6)\n"
            "print('fuser.dynamo' in sys.modules)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, str(tmp_path)]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"  # loaded by Dynamo through the entry point


def test_the_decomposition_table_keeps_the_ops_fuser_fuses_whole():
    from fuser import ops
    table = fuser.dynamo.decompositions()
    split = [op.name() for op in table if isinstance(op, torch._ops.OpOverload) and ops.of(op.name())]
    assert split == []
    names = {op.name() for op in table if isinstance(op, torch._ops.OpOverload)}
    assert "aten::gelu_backward" in names and "aten::native_layer_norm_backward" in names
    assert not any("scaled_dot_product" in n for n in names)


# ---- torch.compile's mode and options ---------------------------------------------------------------------------

_MODES = [dict(mode="reduce-overhead"), dict(mode="max-autotune"), dict(options={"not_an_option": 1})]


def _check_mode(kw, device):
    """torch.compile hands a backend other than Inductor its ``mode`` / ``options`` as keyword arguments (only when
    given, and a mode other than "default"); this backend accepts and ignores them: the same fused graph as
    without them (no CUDA graphs under "reduce-overhead", no autotuning under "max-autotune")."""
    seen = []

    def spy(gm, example_inputs, **given):
        seen.append(given)
        return aot.backend(gm, example_inputs, **given)

    x, b = torch.randn(8, 16, device=device), torch.randn(16, device=device)
    for backend in ("fuser", spy):
        torch._dynamo.reset()
        with recording() as graphs:
            compiled = torch.compile(pointwise, backend=backend, dynamic=False, **kw)
            out = compiled(x, b)
            out = compiled(x, b)  # a second call: what "reduce-overhead" would replay from a CUDA graph
        for o, r in zip(out, pointwise(x, b)):
            torch.testing.assert_close(o, r, rtol=2e-5, atol=2e-5)
        [(_, gm, part, specs)] = graphs
        assert len(part.regions) == 1 and group_calls(gm) == 1
        assert_ran_fused(specs, device)
    assert seen == [kw]


@pytest.mark.parametrize("kw", _MODES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_modes_and_options_are_accepted_and_ignored(kw):
    _check_mode(kw, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("kw", _MODES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_modes_and_options_are_accepted_and_ignored_cuda(kw):
    _check_mode(kw, "cuda")


def test_mode_and_options_together_are_torch_compiles_own_error():
    with pytest.raises(RuntimeError, match="Either mode or options"):
        torch.compile(pointwise, backend="fuser", mode="reduce-overhead", options={"not_an_option": 1})


# ---- dtype constants ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_reduced_precision_backward_casts_join_the_group(dtype):
    """The decomposed GELU backward of a float16/bfloat16 value computes in float32 between two
    ``_to_copy(x, dtype=...)`` casts; the dtype is a constant the group holds (a ScalarType code), so the
    whole backward is one group, with gradients as close to float64's as eager's are."""
    def f(x, b):
        return F.gelu(x) * torch.sigmoid(b) + b

    x, b = torch.randn(8, 24, dtype=dtype), torch.randn(24, dtype=dtype)  # b needs no gradient: no sum
    grad = torch.randn(8, 24, dtype=dtype)
    got, ref, ref64 = x.clone().requires_grad_(), x.clone().requires_grad_(), x.double().requires_grad_()
    with recording() as graphs:
        torch.compile(f, backend="fuser", dynamic=False)(got, b).backward(grad)
    f(ref, b).backward(grad)
    f(ref64, b.double()).backward(grad.double())
    err = (got.grad.double() - ref64.grad).abs().max().item()
    eager_err = (ref.grad.double() - ref64.grad).abs().max().item()
    assert got.grad.dtype == dtype and err <= 2 * eager_err + torch.finfo(dtype).eps, (err, eager_err)
    (_, _, fw, fw_specs), (_, _, bw, bw_specs) = graphs
    casts = [n for r in bw.regions for n in r.nodes if n.target is torch.ops.aten._to_copy.default]
    assert len(fw.regions) == 1 and len(bw.regions) == 1 and len(casts) >= 2
    assert not any(n.target is torch.ops.aten._to_copy.default for n in bw.left_out), bw.left_out
    assert_ran_fused(fw_specs + bw_specs)


# ---- reductions through the door: a cast that names its own layout and device; leading dims ---------------------

def _rms_weight(x, w):
    return torch.rms_norm(x, [x.shape[-1]], None, 1e-6) * w


def _sum0(x, y):
    p = x * y
    return p.sum(0), p.amax(0, keepdim=True)


def _check_door_groups(fn, args, n_nodes, device="cpu"):
    """``fn`` through the door runs as one group of at least ``n_nodes`` ops with nothing left out, and gives
    eager's results within the dtype's tolerance (float64's answer as the reference)."""
    with recording() as graphs:
        out = torch.compile(fn, backend="fuser", dynamic=False)(*args)
    ref = fn(*args)
    ref64 = fn(*[a.double() for a in args])
    out, ref, ref64 = [o if isinstance(o, tuple) else (o,) for o in (out, ref, ref64)]
    for o, r, r64 in zip(out, ref, ref64):
        assert o.dtype == r.dtype and o.shape == r.shape
        tol = 1e-5 if r.dtype == torch.float32 else 2e-2
        torch.testing.assert_close(o.double(), r64, rtol=tol, atol=tol * max(1.0, r64.abs().max().item()))
    [(_, _, part, specs)] = graphs
    assert len(part.regions) == 1 and not part.left_out, part.left_out
    assert len(part.regions[0].nodes) >= n_nodes
    assert_ran_fused(specs, device)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_rms_norm_and_its_weight_are_one_group_in_every_dtype(dtype):
    """rms_norm of bfloat16 decomposes into float32 steps between casts; the cast back names the input's own layout
    and device (``_to_copy(y, dtype=, layout=torch.strided, device=cpu)``): a dtype cast, in the group with the
    weight's product after it."""
    _check_door_groups(_rms_weight, [torch.randn(16, 64, dtype=dtype), torch.randn(64, dtype=dtype)], 5)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_reductions_over_leading_dims_are_one_column_group(dtype):
    """A sum and an amax over dim 0 of one product: one group, run by a column kernel (fuser/rows/outer.py)."""
    x, y = torch.randn(40, 24, dtype=dtype), torch.randn(40, 24, dtype=dtype)
    _check_door_groups(_sum0, [x, y], 3)


def test_a_leading_variance_is_left_to_aten_with_its_reason():
    """A variance over leading dims needs the column's mean first (no column kernel form): left out, and said."""
    def f(x):
        return (x * 2).var(0) + 1
    x = torch.randn(30, 8)
    report = fuser.explain(f, x)
    text = str(report)
    assert "var" in text and "leading dims" in text, text
    torch.testing.assert_close(torch.compile(f, backend="fuser")(x), f(x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_rms_norm_and_leading_sums_through_the_door_cuda(dtype):
    _check_door_groups(_rms_weight, [torch.randn(16, 64, dtype=dtype, device="cuda"),
                                     torch.randn(64, dtype=dtype, device="cuda")], 5, "cuda")
    _check_door_groups(_sum0, [torch.randn(40, 24, dtype=dtype, device="cuda"),
                               torch.randn(40, 24, dtype=dtype, device="cuda")], 3, "cuda")


# ---- layer norm in training: the forward's statistics come out of its row kernel --------------------------------

def _ln_train(x, w, b, w2):
    return torch.nn.functional.layer_norm(x, [x.shape[-1]], w, b, 1e-5) * w2


def _rms_train(x, w, b, w2):
    return torch.rms_norm(x * b, [x.shape[-1]], w, 1e-6) * w2


def _rms_then_weight(x, w):
    return torch.rms_norm(x, [x.shape[-1]], None, 1e-6) * w


def _train_once(fn, dtype, device="cpu"):
    """``fn`` trained one step through the door: the output and every gradient as close to float64's as eager's
    are; returns the forward's and the backward's partitions (after checking both ran fused)."""
    gen = torch.Generator().manual_seed(5)
    x, w, b, w2 = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((6, 20, 96), (96,), (96,), (96,)))
    x = x * 3 + 1  # rows with a mean away from zero
    grad = torch.randn(6, 20, 96, generator=gen, dtype=torch.float64)

    n_args = len(inspect.signature(fn).parameters)

    def run(f, dt):
        args = [a.to(device=device, dtype=dt).requires_grad_() for a in (x, w, b, w2)[:n_args]]
        out = f(*args)
        out.backward(grad.to(device=device, dtype=dt))
        return [out.detach()] + [a.grad for a in args]

    with recording() as graphs:
        got = run(torch.compile(fn, backend="fuser", dynamic=False), dtype)
    ref, ref64 = run(fn, dtype), run(fn, torch.float64)
    for g, r, r64 in zip(got, ref, ref64):
        assert g.dtype == dtype and g.shape == r64.shape
        err = (g.double() - r64).abs().max().item()
        eager_err = (r.double() - r64).abs().max().item()
        scale = max(1.0, r64.abs().max().item())
        assert err <= 2 * eager_err + 4 * torch.finfo(dtype).eps * scale, (err, eager_err)
    (_, _, fw, fw_specs), (_, _, bw, bw_specs) = graphs
    assert_ran_fused(fw_specs + bw_specs, device)
    return fw, bw


def _check_layer_norm_training(dtype, device="cpu"):
    """A training forward's ``native_layer_norm`` (its mean and rstd saved for the backward) becomes its steps:
    the forward is one group (the row statistics among its outputs). So does the joint graph's, before AOTAutograd
    cuts it: the forward saves x and the statistics, not the normalized rows. The backward is one group: x's
    gradient with the weights' and the bias's gradient sums over the rows (dy's own sum included) as the row
    kernel's column sums; only the casts of those sums (bfloat16: a [cols] vector each) are left to ATen."""
    fw, bw = _train_once(_ln_train, dtype, device)
    assert len(fw.regions) == 1 and not fw.left_out, fw.left_out
    saved = [o for o in fw.regions[0].outputs if o.meta["val"].shape == (6, 20, 96)]
    assert len(saved) == 1, saved  # y alone: the normalized rows are recomputed in the backward
    assert len(bw.regions) == 1, bw.regions
    assert all(n.meta["val"].shape == (96,) for n in bw.left_out if n.target is torch.ops.aten._to_copy.default), \
        bw.left_out
    assert not any(n.target is torch.ops.aten.sum.dim_IntList for n in bw.left_out), bw.left_out  # dy's sum too


def _check_rms_norm_training(dtype, device="cpu", fn=_rms_train):
    """rms_norm's decomposed backward broadcasts a row's value with ``expand`` before a division and the
    products with full-size values (fuser/dynamo/broadcasts.py moves it away): the input's gradient is one row
    group (partition rounds: its last ops join once the row group has grown); the weights' gradient sums over the
    rows (leading dims) join last, unable to share that row kernel: a column group of their own, or ATen's sums
    (each cast back alone, in bfloat16)."""
    fw, bw = _train_once(fn, dtype, device)
    assert len(fw.regions) == 1 and not fw.left_out, fw.left_out
    rows = [r for r in bw.regions if any(n.target is torch.ops.aten.sum.dim_IntList and n.args[1] == [-1]
                                         or n.target is torch.ops.aten.sum.dim_IntList and n.args[1] == [2]
                                         for n in r.nodes)]
    # the row group, and a column group where the weights' gradient is formed from the inputs (float32)
    assert len(rows) == 1 and len(bw.regions) <= 2, bw.regions
    left = {n.target for n, why in bw.left_out.items() if "returns a view" not in why}
    # a bfloat16 weight's gradient: ATen's sum, then its cast back, alone
    assert left <= {torch.ops.aten.sum.dim_IntList, torch.ops.aten._to_copy.default}, bw.left_out
    assert not any(n.target is torch.ops.aten.expand.default for r in bw.regions for n in r.inputs)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.bfloat16, torch.float16), ids=str)
def test_layer_norm_training_forward_is_one_group_with_its_statistics(dtype):
    _check_layer_norm_training(dtype)


@pytest.mark.parametrize("fn", (_rms_train, _rms_then_weight), ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_rms_norm_training_backward_is_one_row_group(dtype, fn):
    _check_rms_norm_training(dtype, fn=fn)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
def test_layer_norm_and_rms_norm_training_through_the_door_cuda(dtype):
    _check_layer_norm_training(dtype, "cuda")
    _check_rms_norm_training(dtype, "cuda")
    _check_rms_norm_training(dtype, "cuda", _rms_then_weight)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_layer_norm_and_rms_norm_training_groups_run_as_cuda_kernels_in_the_host_emulation(dtype):
    """The training groups above (layer_norm's forward with its statistics, rms_norm's backward as one row group)
    through their CUDA row kernels, emulated on the host, against eager's ops."""
    for fn in (_ln_train, _rms_train):
        args = [torch.randn(4, 8, 64, dtype=dtype, requires_grad=True)] + [
            torch.randn(64, dtype=dtype, requires_grad=True) for _ in range(3)]
        with recording() as graphs:
            out = torch.compile(fn, backend="fuser", dynamic=False)(*args)
            out.backward(torch.randn_like(out))
        assert _emulated_regions(graphs, 1e-5 if dtype == torch.float32 else 2e-2) >= 2


def test_an_expand_before_pointwise_ops_moves_out_of_their_group():
    """``expand`` of a row's value before a scalar division and a product with a full-size value: the division
    runs on the row's value and the product broadcasts it; one group, eager's values (float64 reference)."""
    def f(x, r):
        return (r.expand(x.shape) / 3.0) * x + torch.sigmoid(r.expand(x.shape))

    x, r = torch.randn(12, 40), torch.randn(12, 1)
    _check_door_groups(f, [x, r], 4)
