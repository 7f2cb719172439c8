"""The public API: names, install/uninstall, the debug entry points and compiler errors."""
import os
import subprocess
import sys
import warnings

import pytest
import torch
from helpers import assert_same

import fuser
from fuser import graph_fuser
from fuser.errors import CompileError
from fuser.kernel_cache import STORE

API = ["install", "uninstall", "fuse", "graph_for", "register_fusion", "run_fusion", "debug_launch_graph",
       "debug_get_fused_kernel_code", "can_fuse_on_cpu", "can_fuse_on_gpu", "override_can_fuse_on_cpu",
       "override_can_fuse_on_gpu", "n_compiled_kernels", "n_cached_kernel_specs"]


def gelu_block(x, b):
    y = x + b
    return 0.5 * y * (1 + torch.tanh(0.7978845608 * (y + 0.044715 * y * y * y)))


def lstm_update(ingate, forgetgate, cellgate, outgate, cx):
    cy = torch.sigmoid(forgetgate) * cx + torch.sigmoid(ingate) * torch.tanh(cellgate)
    hy = torch.sigmoid(outgate) * torch.tanh(cy)
    return hy, cy


def _n_groups(graph):
    return sum(1 for n in graph.nodes() if n.kind() == "prim::FusionGroup")


def test_api_names():
    for name in API:
        assert callable(getattr(fuser, name)), name
        assert getattr(fuser, name).__doc__, f"{name} has no docstring"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_install_fuses_gelu_block_into_one_group(dtype):
    fuser.install()
    fn = torch.jit.script(gelu_block)
    x, b = torch.randn(64, 96, dtype=dtype), torch.randn(96, dtype=dtype)
    g = fuser.graph_for(fn, x, b)
    assert _n_groups(g) == 1
    assert [n.kind() for n in g.nodes() if n.kind() != "prim::Constant"] == ["prim::FusionGroup"]
    before = fuser.n_compiled_kernels()
    assert_same(fn(x, b), gelu_block(x, b))
    assert fuser.n_compiled_kernels() == before  # graph_for's calls compiled it already


def test_install_fuses_lstm_update_into_one_group():
    fuser.install()
    fn = torch.jit.script(lstm_update)
    args = [torch.randn(16, 32) for _ in range(5)]
    g = fuser.graph_for(fn, *args)
    assert _n_groups(g) == 1
    for a, b in zip(fn(*args), lstm_update(*args)):
        assert_same(a, b)


def test_traced_module_under_install_runs_its_group():
    """torch.jit.trace checks a trace by running the module, and a method that ran keeps the graph its executor
    compiled: under install the module is traced again, unchecked, and that one is fused, so the group runs."""
    class Block(torch.nn.Module):
        def forward(self, x, b):
            return gelu_block(x, b)

    x, b = torch.randn(16, 32), torch.randn(32)
    fuser.install()
    try:
        traced = torch.jit.trace(Block(), (x, b))
    finally:
        fuser.uninstall()
    before = {spec.key: len(spec.geometries) for spec in STORE._specs.values()}
    for _ in range(2):
        out = traced(x, b)
    assert_same(out, gelu_block(x, b))
    ran = [spec for spec in STORE._specs.values() if len(spec.geometries) > before.get(spec.key, 0)]
    assert any("aten::tanh" in spec.text for spec in ran)


def test_traced_module_under_install_keeps_its_buffers_as_a_stock_trace_leaves_them():
    """The second trace under install runs the module once more: a train-mode batch norm's running statistics
    are put back as the first trace left them."""
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())

    x = torch.randn(2, 3, 8, 8)
    stock_model, fused_model = make(), make()
    torch.jit.trace(stock_model, (x,))
    fuser.install()
    try:
        torch.jit.trace(fused_model, (x,))
    finally:
        fuser.uninstall()
    for (name, a), (_, b) in zip(stock_model.named_buffers(), fused_model.named_buffers()):
        assert torch.equal(a, b), name


def test_install_and_uninstall_trace_and_nnc_switches():
    cpu, gpu = torch._C._jit_can_fuse_on_cpu(), torch._C._jit_can_fuse_on_gpu()
    fuser.install()
    assert fuser.is_installed()
    assert not torch._C._jit_can_fuse_on_cpu() and not torch._C._jit_can_fuse_on_gpu()
    traced = torch.jit.trace(gelu_block, (torch.randn(4, 8), torch.randn(8)))
    assert any(graph_fuser.is_group_call(n) for n in traced.graph.nodes())
    fuser.uninstall()
    assert not fuser.is_installed()
    assert (torch._C._jit_can_fuse_on_cpu(), torch._C._jit_can_fuse_on_gpu()) == (cpu, gpu)

    def plain(x, y):
        return (x * y).sin() + y

    stock = torch.jit.script(plain)
    assert not any(graph_fuser.is_group_call(n) for n in stock.graph.nodes())


def test_debug_launch_graph_and_kernel_code():
    g = torch.parse_ir("""
    graph(%x : Tensor, %y : Tensor):
      %a : Tensor = aten::mul(%x, %y)
      %b : Tensor = aten::relu(%a)
      return (%b, %a)
    """)
    x, y = torch.randn(10, 3), torch.randn(10, 3)
    b, a = fuser.debug_launch_graph(g, [x, y])
    assert_same(a, x * y)
    assert_same(b, torch.relu(x * y))
    code = fuser.debug_get_fused_kernel_code(g, [x, y])
    assert 'extern "C" void' in code and "fz_st<float>" in code
    with pytest.raises(RuntimeError, match="not fused"):
        fuser.debug_get_fused_kernel_code(g, [x, torch.randn(4)])


def test_register_fusion_takes_a_fusion_group_node():
    fuser.install()
    fn = torch.jit.script(gelu_block)
    x, b = torch.randn(4, 6), torch.randn(6)
    g = fuser.graph_for(fn, x, b)
    (node,) = [n for n in g.nodes() if n.kind() == "prim::FusionGroup"]
    key = fuser.register_fusion(node)
    assert_same(fuser.run_fusion(key, [x, b])[0], gelu_block(x, b))
    other = torch.parse_ir("graph(%x : Tensor):\n  %a : Tensor = aten::sin(%x)\n  return (%a)\n")
    with pytest.raises(ValueError):
        fuser.register_fusion(next(iter(other.nodes())))
    with pytest.raises(KeyError):
        fuser.run_fusion(10 ** 9, [x])


def test_fusion_debug_env_prints_kernel_source():
    code = (
        "import torch, fuser\n"
        "g = torch.parse_ir('graph(%x : Tensor):\\n  %a : Tensor = aten::exp(%x)\\n"
        "  %b : Tensor = aten::neg(%a)\\n  return (%b)\\n')\n"
        "print(fuser.debug_launch_graph(g, [torch.ones(3)])[0].tolist())\n")
    env = dict(os.environ, PYTORCH_FUSION_DEBUG="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr
    assert "extern \"C\" void fused_" in r.stderr and "expf" in r.stderr
    assert "-2.71828" in r.stdout


def test_cpu_compile_error_carries_log_and_numbered_source():
    from fuser.cpu import compiler
    src = 'extern "C" void k() {\n  this is not C++;\n}\n'
    with pytest.raises(CompileError) as e:
        compiler.compile_kernel(src, "k")
    msg = str(e.value)
    assert "error" in e.value.log
    assert " 2 |   this is not C++;" in msg


def test_nvrtc_compile_error_carries_log_and_numbered_source():
    from fuser.cuda import driver
    src = 'extern "C" __global__ void k() {\n  undefined_thing();\n}\n'
    with pytest.raises(CompileError) as e:
        driver.compile_source(src, "k", driver.NvrtcOptions(90))
    assert "undefined_thing" in e.value.log
    assert "2 |   undefined_thing();" in str(e.value)
    assert "--gpu-architecture=sm_90" in str(e.value)


def test_contraction_only_where_every_output_and_floating_input_is_16_bit(monkeypatch):
    """With contraction turned on, NVRTC contracts multiplies and adds (--fmad=true) in a kernel whose outputs and
    floating inputs are all float16 or bfloat16; never where one is float32 or float64 (eager's two roundings
    kept) or an output is bool or an integer, nor when settings turn it off or ask for eager's bits."""
    from fuser import settings
    from fuser.cuda import driver, launch
    f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
    monkeypatch.setattr(settings, "round_reduced", False)
    monkeypatch.setattr(settings, "cuda_contract", True)
    assert launch.contracts((bf16, bf16), (bf16,)) and launch.contracts((f16, torch.int64, torch.bool), (f16, bf16))
    for ins, outs in (((bf16,), (f32,)), ((bf16,), (bf16, f32)), ((f16,), (f64, f16)), ((bf16,), (bf16, torch.bool)),
                      ((bf16,), (torch.int64,)), ((f32, bf16), (bf16,)), ((f64,), (f16,)), ((bf16,), ())):
        assert not launch.contracts(ins, outs), (ins, outs)
    monkeypatch.setattr(settings, "round_reduced", True)
    assert not launch.contracts((bf16,), (bf16,))
    monkeypatch.setattr(settings, "round_reduced", False)
    monkeypatch.setattr(settings, "cuda_contract", False)
    assert not launch.contracts((bf16,), (bf16,))
    assert b"--fmad=false" in driver.NvrtcOptions(90).flags()
    assert b"--fmad=true" in driver.NvrtcOptions(90, fmad=True).flags()
    assert b"--fmad=false" not in driver.NvrtcOptions(90, fmad=True).flags()


def _fused_sin(x, y):
    return (x * y).sin() + y


def test_forward_ad_jvp_and_vmap_match_eager():
    import torch.autograd.forward_ad as fwAD
    ff = fuser.fuse(torch.jit.script(_fused_sin))
    x, y, t = torch.randn(6), torch.randn(6), torch.randn(6)
    with fwAD.dual_level():
        out = fwAD.unpack_dual(ff(fwAD.make_dual(x, t), y))
        ref = fwAD.unpack_dual(_fused_sin(fwAD.make_dual(x, t), y))
    assert out.tangent is not None
    assert_same(out.tangent, ref.tangent)
    assert_same(torch.func.jvp(lambda a: ff(a, y), (x,), (t,))[1],
                torch.func.jvp(lambda a: _fused_sin(a, y), (x,), (t,))[1])
    xb, yb = torch.randn(3, 6), torch.randn(3, 6)
    assert_same(torch.vmap(ff)(xb, yb), _fused_sin(xb, yb))


def test_neg_bit_and_zero_tensors_fall_back():
    ff = fuser.fuse(torch.jit.script(_fused_sin))
    y = torch.randn(5)
    xi = torch.randn(5, dtype=torch.complex64).conj().imag  # a float view with the neg bit set
    assert xi.is_neg()
    assert_same(ff(xi, y), _fused_sin(xi, y))
    z = torch._efficientzerotensor((5,))
    assert_same(ff(z, y), _fused_sin(z, y))


def test_register_rejects_int_and_bool_graph_inputs():
    g = torch.parse_ir("graph(%x : Tensor, %s : int):\n  %a : Tensor = aten::mul(%x, %s)\n"
                       "  %b : Tensor = aten::neg(%a)\n  return (%b)\n")
    with pytest.raises(ValueError, match="tensors and floats"):
        fuser.debug_launch_graph(g, [torch.arange(4), 3])


def test_saved_fused_module_runs_in_another_process(tmp_path):
    """Keys are per process; a saved module carries its groups' digest and graph, so a process that
    registered other groups first (or none) still runs the right kernel."""
    src = tmp_path / "model.py"
    src.write_text("import torch\n"
                   "class M(torch.nn.Module):\n"
                   "    def forward(self, x):\n"
                   "        return torch.sigmoid(x * 2 + 1) - 0.25\n")
    saver = tmp_path / "save.py"
    saver.write_text("import sys, torch, fuser\nsys.path.insert(0, sys.argv[2])\nfrom model import M\n"
                     "m = fuser.fuse(torch.jit.script(M()))\ntorch.jit.save(m, sys.argv[1])\n")
    loader = tmp_path / "load.py"
    loader.write_text("import sys, torch, fuser\n"
                      "g = torch.parse_ir('graph(%x : Tensor):\\n  %a : Tensor = aten::exp(%x)\\n"
                      "  %b : Tensor = aten::cos(%a)\\n  return (%b)\\n')\n"
                      "fuser.debug_launch_graph(g, [torch.ones(3)])  # takes key 0 in this process\n"
                      "m = torch.jit.load(sys.argv[1])\n"
                      "x = torch.linspace(-3, 3, 7)\n"
                      "print(torch.allclose(m(x), torch.sigmoid(x * 2 + 1) - 0.25), fuser.n_compiled_kernels())\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    path = str(tmp_path / "m.pt")
    r = subprocess.run([sys.executable, str(saver), path, str(tmp_path)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, str(loader), path], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    ok, compiled = r.stdout.split()
    assert ok == "True" and int(compiled) == 2  # the loaded group was rebuilt and compiled, not mistaken


def _break_lint(graph_fuser_fuse):
    """A fuse stage that leaves a use before its definition (what the pass once did, issue 16)."""
    def broken(graph):
        made = graph_fuser_fuse(graph)
        use = graph.create("aten::neg", [graph.outputs()[0]], 1)
        use.insertBefore(next(iter(graph.nodes())))
        return made
    return broken


def _raise(graph):
    raise RuntimeError("injected pass failure")


@pytest.mark.parametrize("failure", ["raises", "invalid graph"])
def test_a_pass_failure_runs_unfused_and_warns_once(monkeypatch, failure):
    from fuser import graph_fuser, integration, settings
    monkeypatch.setattr(settings, "strict_pass", False)
    monkeypatch.setattr(integration, "_warned", False)
    monkeypatch.setattr(graph_fuser, "fuse_graph",
                        _raise if failure == "raises" else _break_lint(graph_fuser.fuse_graph))

    def gelu_bias(x, b):
        y = x + b
        return 0.5 * y * (1 + torch.tanh(0.7978845608 * (y + 0.044715 * y * y * y)))

    class Block(torch.nn.Module):
        def forward(self, x, b):
            return torch.sigmoid(x * b + 1) * x

    fuser.install()
    x, b = torch.randn(16, 8), torch.randn(8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = torch.jit.trace(gelu_bias, (x, b))
        scripted = torch.jit.script(gelu_bias)
        module = torch.jit.trace(Block(), (x, b))
        results = [(traced(x, b), gelu_bias(x, b)), (scripted(x, b), gelu_bias(x, b)),
                   (module(x, b), Block()(x, b))]
    for actual, expected in results:
        assert_same(actual, expected)
    for fn in (traced, scripted, module):
        assert not any(n.kind().startswith("fuser::") for n in fn.graph.nodes())
    ours = [w for w in caught if "fusion pass failed" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    stage = "'fuse'"
    assert stage in str(ours[0].message) and ("injected" in str(ours[0].message)) == (failure == "raises")


def test_strict_pass_raises_the_failure(monkeypatch):
    from fuser import graph_fuser, settings
    from fuser.errors import PassError
    monkeypatch.setattr(settings, "strict_pass", True)
    monkeypatch.setattr(graph_fuser, "fuse_graph", _break_lint(graph_fuser.fuse_graph))
    with pytest.raises(PassError, match="'fuse' stage"):
        fuser.fuse(torch.jit.script(_sigmoid_block))


def _sigmoid_block(x):
    return (x * 2).sigmoid() + 1
