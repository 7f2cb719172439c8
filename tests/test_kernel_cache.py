"""Registration dedupe (alpha-equivalent graphs share a key) and exactly-once compiles under threads."""

import torch
from helpers import assert_same, run_in_threads

import fuser
from fuser import compiler, executor
from fuser.kernel_cache import KernelStore
from fuser.ts_ir import lower

IR_A = """
graph(%x : Tensor, %y : Tensor):
  %one : int = prim::Constant[value=1]()
  %a : Tensor = aten::mul(%x, %y)
  %b : Tensor = aten::sigmoid(%a)
  %c : Tensor = aten::add(%b, %x, %one)
  return (%c)
"""
# same computation, other value names
IR_B = IR_A.replace("%x", "%input").replace("%a", "%tmp").replace("%b", "%sig")
# a different constant
IR_C = IR_A.replace("value=1]", "value=2]")
# different argument order of the multiplication
IR_D = IR_A.replace("aten::mul(%x, %y)", "aten::mul(%y, %x)")


def test_alpha_equivalent_graphs_share_a_key():
    store = KernelStore()
    ka = store.register(lower(torch.parse_ir(IR_A)))
    kb = store.register(lower(torch.parse_ir(IR_B)))
    assert ka == kb
    assert len(store) == 1
    assert store.register(lower(torch.parse_ir(IR_C))) != ka
    assert store.register(lower(torch.parse_ir(IR_D))) != ka
    assert len(store) == 3


def test_shapes_and_names_are_not_part_of_the_key():
    typed = IR_A.replace("%x : Tensor", "%x : Float(3, 4, strides=[4, 1], requires_grad=0, device=cpu)")
    assert lower(torch.parse_ir(typed)).text() == lower(torch.parse_ir(IR_A)).text()


def test_public_register_dedupes_equal_groups():
    def f(x, y):
        return (x * y).sigmoid() + x, (y * x).sigmoid() + y

    before = fuser.n_cached_kernel_specs()
    f1 = fuser.fuse(torch.jit.script(f))
    mid = fuser.n_cached_kernel_specs()
    fuser.fuse(torch.jit.script(f))  # the same groups again: no new spec
    assert fuser.n_cached_kernel_specs() == mid >= before
    x, y = torch.randn(4), torch.randn(4)
    for a, b in zip(f1(x, y), f(x, y)):
        assert_same(a, b)


def test_one_compile_however_many_threads_ask():
    g = torch.parse_ir(IR_A.replace("aten::sigmoid", "aten::tanh").replace("value=1]", "value=3]"))
    key = fuser.interface.STORE.register(lower(g))
    spec = fuser.interface.STORE.get(key)
    x, y = torch.randn(1000), torch.randn(1000)
    before = fuser.n_compiled_kernels()
    results = run_in_threads(16, lambda: fuser.run_fusion(key, [x, y])[0])
    assert fuser.n_compiled_kernels() - before == 1
    assert len([k for k in spec.kernels().values() if k is not None]) == 1
    expected = torch.tanh(x * y) + 3 * x
    for r in results:
        assert_same(r, expected)


def test_failed_compile_leaves_no_entry(monkeypatch):
    g = torch.parse_ir(IR_A.replace("aten::sigmoid", "aten::cos"))
    key = fuser.interface.STORE.register(lower(g))
    spec = fuser.interface.STORE.get(key)
    x, y = torch.randn(10), torch.randn(10)
    calls = []

    def broken(spec_, arg_spec):
        calls.append(1)
        raise RuntimeError("simulated compiler crash")

    monkeypatch.setattr(compiler, "build", broken)
    try:
        executor.run(spec, [x, y])
    except RuntimeError as e:
        assert "simulated" in str(e)
    else:
        raise AssertionError("the compile error was swallowed")
    assert spec.kernels() == {}
    monkeypatch.undo()
    out = executor.run(spec, [x, y])  # the next call compiles for real
    assert out is not None
    assert_same(out[0], torch.cos(x * y) + x)


def test_kernels_set_aside_makes_a_call_build_again_and_keeps_the_earlier_kernels(tmp_path, monkeypatch):
    """What the benchmark times a second front door's first call under: the spec's kernel, its futures and its
    geometries are hidden, so the call compiles (the disk cache moved to an empty place), with eager's result;
    afterwards the earlier kernel is the one served, and a later call compiles nothing."""
    monkeypatch.setenv("FUSER_CACHE_DIR", str(tmp_path / "a"))
    g = torch.parse_ir(IR_A.replace("aten::sigmoid", "aten::sinh").replace("value=1]", "value=5]"))
    key = fuser.interface.STORE.register(lower(g))
    spec = fuser.interface.STORE.get(key)
    x, y = torch.randn(257), torch.randn(257)
    expected = torch.sinh(x * y) + 5 * x
    before = fuser.n_compiled_kernels()
    assert_same(fuser.run_fusion(key, [x, y])[0], expected)
    assert fuser.n_compiled_kernels() - before == 1
    (first,) = spec.kernels().values()
    assert first is not None and spec.geometries
    monkeypatch.setenv("FUSER_CACHE_DIR", str(tmp_path / "b"))
    with fuser.interface.STORE.kernels_set_aside():
        assert spec.kernels() == {} and not spec.geometries
        x2, y2 = torch.randn(31), torch.randn(31)
        assert_same(fuser.run_fusion(key, [x2, y2])[0], torch.sinh(x2 * y2) + 5 * x2)
        assert fuser.n_compiled_kernels() - before == 2
        (again,) = spec.kernels().values()
        assert again is not first
    assert list(spec.kernels().values()) == [first]
    assert_same(fuser.run_fusion(key, [x, y])[0], expected)
    assert fuser.n_compiled_kernels() - before == 2
