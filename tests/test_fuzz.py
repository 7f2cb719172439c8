"""The differential fuzzer (the package fuser/fuzz/): its own machinery and two fixed-seed campaigns on the CPU
backend. A failing campaign prints shrunk reproducers and saves them
(``FUSER_FUZZ_OUT``, default: pytest's temporary directory) as ready-made regression tests."""
import math
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fuser
from fuser import executor, fuzz

FIXED_SEED = 20240601
JOBS = max(1, min(2, os.cpu_count() or 1))


def _needs_cpu_fusion():
    if not fuser.can_fuse_on_cpu():
        pytest.fail("the CPU backend needs a C++ compiler on this machine")


def _report(camp: fuzz.Campaign, tmp_path) -> str:
    out = os.environ.get("FUSER_FUZZ_OUT") or str(tmp_path / "fuzz_failures")
    lines = []
    paths = fuzz.report_failures(camp, out, max_shrink=3, shrink_budget=30, log=lines.append)
    return "\n".join([camp.summary(), *lines, f"reproducers: {paths}"])


# ---------------------------------------------------------------------------------------------- machinery

def test_parse_graph_nan_and_exact_tensor_constants():
    g = fuzz.parse_graph("""graph(%x : Tensor):
  %n : float = prim::Constant[value=nan]()
  %c : Double(requires_grad=0, device=cpu) = prim::Constant[value={-0.25}]()
  %a : Tensor = aten::mul(%x, %c)
  %r : Tensor = aten::clamp_min(%a, %n)
  return (%r)
""")
    consts = [n.output().toIValue() for n in g.nodes() if n.kind() == "prim::Constant"]
    assert math.isnan(consts[0])
    assert consts[1].item() == -0.25 and consts[1].dtype == torch.float64


def test_render_parse_round_trip_of_generated_programs():
    for i in range(20):
        p = fuzz.build_case(7, i).program
        g = fuzz.parse_graph(fuzz.render(p))
        assert len([n for n in g.nodes() if n.kind() != "prim::Constant"]) == len(p.nodes)
        assert len(list(g.outputs())) == len(p.outputs)


def test_check_catches_a_wrong_value(monkeypatch):
    _needs_cpu_fusion()
    g = torch.parse_ir("""graph(%x : Tensor, %y : Tensor):
  %one : int = prim::Constant[value=1]()
  %a : Tensor = aten::add(%x, %y, %one)
  %r : Tensor = aten::sigmoid(%a)
  return (%r, %a)
""")
    args = [torch.randn(50, 3), torch.randn(3)]
    good = fuzz.check(g, args)
    assert good.ok and good.fused, good

    real = executor.run

    def off_by_a_little(spec, a):
        out = real(spec, a)
        if out is not None:
            out[0].view(-1)[7] += 1e-3
        return out
    monkeypatch.setattr(executor, "run", off_by_a_little)
    bad = fuzz.check(g, args)
    assert not bad.ok and bad.kind == "value", bad


def test_check_catches_wrong_dtype_shape_and_missing_error(monkeypatch):
    g = torch.parse_ir("""graph(%x : Tensor):
  %r : Tensor = aten::neg(%x)
  return (%r)
""")
    monkeypatch.setattr(executor, "run", lambda spec, a: [(-a[0]).double()])
    assert fuzz.check(g, [torch.randn(4)]).kind == "dtype"
    monkeypatch.setattr(executor, "run", lambda spec, a: [(-a[0]).expand(2, 4)])
    assert fuzz.check(g, [torch.randn(4)]).kind == "shape"
    # eager raises (neg of bool): the fused path must raise too
    monkeypatch.setattr(executor, "run", lambda spec, a: [a[0].clone()])
    assert fuzz.check(g, [torch.ones(4, dtype=torch.bool)]).kind == "no_raise"


def _oom(spec, a):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 111.75 GiB.")


def test_an_out_of_memory_fused_run_is_a_failure_where_eager_leaves_room(monkeypatch):
    g = torch.parse_ir("""graph(%x : Tensor):
  %r : Tensor = aten::neg(%x)
  return (%r)
""")
    monkeypatch.setattr(executor, "run", _oom)
    verdict = fuzz.check(g, [torch.randn(4)])
    assert not verdict.ok and verdict.kind == "fused_raises"


@pytest.mark.gpu
def test_an_out_of_memory_fused_run_beside_eager_outputs_of_half_the_device_is_excused(monkeypatch):
    """(the CUDA fuzzer's graph 1862 of seed 1167626128: an int64 output of [122467, 122467], 112 GiB, which eager
    made on an H200 and the fused run then had no room for)"""
    g = torch.parse_ir("""graph(%x : Tensor):
  %r : Tensor = aten::neg(%x)
  return (%r)
""")
    x = torch.randn(1000, device="cuda")
    monkeypatch.setattr(executor, "run", _oom)
    assert not fuzz.check(g, [x]).ok  # 4 kB of eager's output leave room: a failure
    real = torch.cuda.get_device_properties
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: type("P", (), {"total_memory": 8000})() if d == x.device else real(d))
    verdict = fuzz.check(g, [x])
    assert verdict.ok and verdict.kind == "oom" and not verdict.fused


def test_excused_elements_are_only_near_discontinuities():
    """floor of a computed float16 value: eager rounds the intermediate to half, fusion keeps it in float, so
    floor may differ exactly where the intermediate is within rounding of an integer, and nowhere else."""
    _needs_cpu_fusion()
    g = torch.parse_ir("""graph(%x : Tensor):
  %c : float = prim::Constant[value=3.0]()
  %a : Tensor = aten::mul(%x, %c)
  %r : Tensor = aten::floor(%a)
  return (%r)
""")
    x = (torch.arange(-300, 300, dtype=torch.float64) / 3 + 1e-4).half()
    v = fuzz.check(g, [x])
    assert v.ok and v.fused, v
    assert v.judged >= 0.5 * v.total


def test_shrink_finds_the_planted_op():
    """Shrinking keeps the op that triggers a (simulated) bug and drops the rest."""
    p = None
    for i in range(200):
        cand = fuzz.build_case(11, i).program
        if any(n.schema.op.name == "sigmoid" for n in cand.nodes) and len(cand.nodes) >= 6:
            p = cand
            break
    assert p is not None

    def evaluate(q):
        has = any(n.schema.op.name == "sigmoid" for n in q.nodes)
        return fuzz.Verdict(not has, "value" if has else "ok")
    small, v, steps = fuzz.shrink(p, fuzz.Verdict(False, "value"), evaluate, budget_s=60)
    assert [n.schema.op.name for n in small.nodes] == ["sigmoid"], fuzz.render(small)
    src = fuzz.reproducer(small, v, "cpu", "planted")
    compile(src, "repro.py", "exec")


# ---------------------------------------------------------------------------------------------- campaigns

def test_fixed_seed_campaign_cpu(tmp_path):
    _needs_cpu_fusion()
    camp = fuzz.run_campaign(200, FIXED_SEED, "cpu", jobs=JOBS, log=lambda s: None)
    print(camp.summary())
    assert camp.graphs == 200
    # a fuzzer whose graphs all fall back tests nothing
    assert camp.fused >= 0.8 * (camp.runs - camp.raises), camp.summary()
    assert not camp.failures, _report(camp, tmp_path)


def test_second_seed_campaign_cpu(tmp_path):
    """A second fixed campaign, or any other: FUSER_FUZZ_SEED and FUSER_FUZZ_GRAPHS replay one (CI runs fixed
    seeds only; random-seed campaigns are a tool, ``python -m fuser.fuzz``, and what they find becomes a test)."""
    _needs_cpu_fusion()
    seed = int(os.environ.get("FUSER_FUZZ_SEED", "2026112203"))
    graphs = int(os.environ.get("FUSER_FUZZ_GRAPHS", "120"))
    camp = fuzz.run_campaign(graphs, seed, "cpu", jobs=JOBS, log=lambda s: None)
    print(f"FUSER_FUZZ_SEED={seed}\n" + camp.summary())
    assert camp.graphs == graphs
    assert not camp.failures, f"replay with FUSER_FUZZ_SEED={seed} FUSER_FUZZ_GRAPHS={graphs}\n" + _report(camp, tmp_path)


@pytest.mark.parametrize("ir, value, dtype", [
    # gelu(-7.15) is -0.0 in eager and -4e-16 with glibc's tanh: floor then gives -0.0 or -1
    ("""graph(%t0 : Tensor):
  %v0 : Tensor = aten::log2(%t0)
  %c : str = prim::Constant[value="tanh"]()
  %v1 : Tensor = aten::gelu(%v0, %c)
  %v2 : Tensor = aten::floor(%v1)
  return (%v2)""", 0.007029290003738087, torch.float64),
    # pow(1e-40, y) multiplies y's 1-ulp libm difference by about 90: fmod(., 5) of 1.46e15 is then anyone's guess
    ("""graph(%t0 : Tensor):
  %v0 : Tensor = aten::log10(%t0)
  %b : float = prim::Constant[value=1e-40]()
  %v1 : Tensor = aten::pow(%b, %v0)
  %c : int = prim::Constant[value=5]()
  %v2 : Tensor = aten::fmod(%v1, %c)
  return (%v2)""", 0.41773897226307644, torch.float64),
    # remainder(x, atan2(b, b)) for x near -4659: about 6000 times atan2's 1-ulp libm difference (float32)
    ("""graph(%t0 : Tensor):
  %c : float = prim::Constant[value=70000.0]()
  %v0 : Tensor = aten::lt(%t0, %c)
  %v1 : Tensor = aten::atan2(%v0, %v0)
  %v2 : Tensor = aten::remainder(%t0, %v1)
  return (%v2)""", -4659.3212890625, torch.float32),
    # erfc(10) in float32 is the smallest subnormal in one libm and twice it in another: pow(., -0.25) then
    # differs by 19%
    ("""graph(%t0 : Tensor):
  %v0 : Tensor = aten::erfc(%t0)
  %c : float = prim::Constant[value=-0.25]()
  %v1 : Tensor = aten::pow(%v0, %c)
  return (%v1)""", 10, torch.int64),
    # tan(atan2(x, x)) is 1 or 0.99999994 by libm: pow(., inf) jumps from 0 to 1 there
    ("""graph(%t0 : Tensor):
  %v0 : Tensor = aten::atan2(%t0, %t0)
  %v1 : Tensor = aten::tan(%v0)
  %c : float = prim::Constant[value=inf]()
  %v2 : Tensor = aten::pow(%v1, %c)
  return (%v2)""", 2.0, torch.float32),
])
def test_judge_excuses_ill_conditioned_ops(ir, value, dtype):
    """Verdicts the 10k campaign got wrong: a 1-ulp libm difference (glibc in the kernel, SLEEF in eager)
    upstream of a discontinuity or of an op that amplifies it, which the float64 reference cannot show when it
    is eager itself."""
    _needs_cpu_fusion()
    g = fuzz.parse_graph(ir)
    x = torch.tensor([value] * 60 + [0.5, 2.0, 3.0, 0.25], dtype=dtype)
    v = fuzz.check(g, [x])
    assert v.ok, v


def test_the_fuzzer_adds_permutes_and_keeps_the_other_programs(monkeypatch):
    """About PERMUTE_RATE of a seed's programs without a reduction end in a permute of the last value and an add
    that reads it through the view (their text round-trips, they run like eager); every other program is the one
    the generator made without them."""
    from fuser.fuzz import generator
    seed = int(torch.randint(2 ** 31, ()))
    with_view = [generator.build_case(seed, i) for i in range(150)]
    monkeypatch.setattr(generator, "PERMUTE_RATE", 0.0)
    without = [generator.build_case(seed, i) for i in range(150)]
    hits = [k for k, g in enumerate(with_view) if any(n.schema.kind == "aten::permute" for n in g.program.nodes)]
    assert 1 <= len(hits) <= 30, len(hits)
    for k, (a, b) in enumerate(zip(with_view, without)):
        if k not in hits:
            assert fuzz.render(a.program) == fuzz.render(b.program)
    fused = 0
    for k in hits:
        p = with_view[k].program
        g = fuzz.parse_graph(fuzz.render(p))
        assert [n.kind() for n in g.nodes() if n.kind() != "prim::Constant"] == [n.schema.kind for n in p.nodes]
        v = fuzz.check_program(p)
        assert v.ok, (v.kind, v.detail, fuzz.render(p))
        fused += v.fused
    # some permute program fuses: 150 programs hold 1-4 permutes none of which fuses for about 1 seed in 40, so the
    # seed's later programs are drawn until one does (within 600)
    monkeypatch.undo()
    for i in range(150, 600):
        if fused:
            break
        p = generator.build_case(seed, i).program
        if any(n.schema.kind == "aten::permute" for n in p.nodes):
            v = fuzz.check_program(p)
            assert v.ok, (v.kind, v.detail, fuzz.render(p))
            fused += v.fused
    assert fused


class _Largest(TorchDispatchMode):
    """The most elements of any tensor an op made under it."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.numel = max(self.numel, o.numel())
        return out


def _largest_value(p) -> int:
    """The most elements of a value program ``p`` makes (on meta tensors), up to eager's error where it raises."""
    g = fuzz.parse_graph(fuzz.render(p))
    g.makeMultiOutputIntoTuple()
    fn = torch._C._create_function_from_graph("f", g)
    m = _Largest()
    try:
        with m:
            fn(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in p.args()])
    except RuntimeError:  # (what it made before eager's error)
        pass
    return m.numel


@pytest.mark.parametrize("seed,graphs", [(1, range(1150, 1190)), (None, range(300))])
def test_no_generated_value_holds_more_than_max_numel_elements(seed, graphs):
    """Every value of a generated program, in both input sets, holds at most max_numel elements: the add a program
    without an output of the full shape gets reads the value a permute read, not the permuted one (seed 1's graph
    1170 added a permuted [1, 1545] to t0, 2.4M elements; on an H200 a CUDA fuzz worker took 108 GB that way)."""
    from fuser.fuzz import generator
    seed = int(torch.randint(2 ** 31, ())) if seed is None else seed
    for i in graphs:
        g = generator.build_case(seed, i, 100_000, 40)
        for v in range(2):
            p = generator._inputs_for_variant(g, v, seed, i, 100_000)
            assert _largest_value(p) <= 100_000, (seed, i, v, fuzz.render(p))


def test_the_judge_moves_uncertain_elements_through_a_permute():
    """An element near an edge (lgamma's pole at 0 after leaky_relu) ahead of a permute: its uncertainty mask is
    permuted with it. The CUDA campaign of 2026-11-27 (seed 3236402304, graph 2469) found the judge broadcasting the
    input's mask, of another shape, to the permuted output (a fuzzer error)."""
    _needs_cpu_fusion()
    g = fuzz.parse_graph("""graph(%t0 : Tensor):
  %c0_1 : int = prim::Constant[value=3]()
  %v0 : Tensor = aten::leaky_relu(%t0, %c0_1)
  %v1 : Tensor = aten::lgamma(%v0)
  %c2_1 : int[] = prim::Constant[value=[1, 2, 0]]()
  %v2 : Tensor = aten::permute(%v1, %c2_1)
  return (%v2)""")
    x = torch.tensor([0.0, -0.98828125, 0.0, 0.0, 0.0, 0.0], dtype=torch.bfloat16).view(3, 1, 2)
    v = fuzz.check(g, [x])
    assert v.ok, v
    for shape in ((3, 1, 2), (2, 3, 4)):  # random values, the same graph
        v = fuzz.check(g, [torch.randn(shape).to(torch.bfloat16)])
        assert v.ok, v


MEAN_IR = """graph(%t0 : Tensor):
  %dims : int[] = prim::Constant[value=[-1]]()
  %keep : bool = prim::Constant[value=1]()
  %none : NoneType = prim::Constant()
  %m : Tensor = aten::mean(%t0, %dims, %keep, %none)
  %one : int = prim::Constant[value=1]()
  %r : Tensor = aten::sub(%t0, %m, %one)
  return (%r)
"""


def test_the_judge_allows_a_sums_rounding_in_any_order(monkeypatch):
    """A row whose terms cancel (magnitudes to 1e30, their sum near 1e20): a kernel summing in another order than
    eager's is off by units of the largest partial sum, however close eager's own order came (the CUDA campaign of
    seed 2528166599 found a float32 row mean 3.5e-5 from the float64 truth, eager's 5e-7: both well within float32's
    summation error). The judge's spread of a sum or mean holds 4 units of rounding of the terms' magnitudes summed
    (over the count, for the mean), not only of the result; a mean off by a thousandth of the terms' mean magnitude
    is still caught."""
    from fuser.fuzz import judge
    from fuser.fuzz.eager import eager_eval
    _needs_cpu_fusion()
    g = torch.parse_ir(MEAN_IR)
    gen = torch.Generator().manual_seed(3)
    big = torch.randn(4, 38, generator=gen, dtype=torch.float64) * torch.logspace(0, 30, 38, dtype=torch.float64)
    x = (torch.cat([big, -big], -1) + 1e20 * torch.randn(4, 76, generator=gen, dtype=torch.float64)).float()
    mag = x.double().abs().mean(-1, keepdim=True)
    steps, _ = eager_eval(g, [x])
    ref_steps, _ = eager_eval(g, [x], upcast=True)
    spreads = judge._step_spreads(g, [x], steps, ref_steps)
    mean_spread = spreads[steps[0][0].output().unique()]
    assert bool((mean_spread >= 0.99 * 4 * torch.finfo(torch.float32).eps * mag).all()), (mean_spread, mag)
    real = executor.run

    def off_by_a_thousandth(spec, a):
        out = real(spec, a)
        if out is not None:
            out[0].copy_((out[0].double() - 1e-3 * mag).float())
        return out
    good = fuzz.check(g, [x])
    assert good.ok and good.fused, good
    monkeypatch.setattr(executor, "run", off_by_a_thousandth)
    bad = fuzz.check(g, [x])
    assert not bad.ok and bad.kind == "value", bad


_OVERFLOW_COMPARED = """graph(%t0 : Tensor):
  %c : float = prim::Constant[value=0.1]()
  %v0 : Tensor = aten::pow(%c, %t0)
  %v1 : Tensor = aten::mul(%v0, %t0)
  %v2 : Tensor = aten::mish(%v1)
  %v3 : Tensor = aten::le(%v2, %v2)
  return (%v3)
"""


def test_the_judge_takes_the_truth_of_a_comparison_where_eager_overflowed(monkeypatch):
    """0.1^x for x = -5.06 is 1.2e5, inf in float16: eager's mish of inf * x is NaN and NaN <= NaN is False, where the
    fused kernel (float intermediates) and the float64 truth give True (the CUDA fuzzer). The judge takes the truth
    there, only there: an element whose intermediates stay finite, made wrong, is still caught."""
    _needs_cpu_fusion()
    g = torch.parse_ir(_OVERFLOW_COMPARED)
    x = torch.tensor([-5.05859375, 0.5, -1.0, 2.0], dtype=torch.float16)
    v = fuzz.check(g, [x])
    assert v.ok and v.fused, v
    real = executor.run

    def flip(at):
        def run(spec, a):
            out = real(spec, a)
            if out is not None:
                out[0][at] = ~out[0][at]
            return out
        return run
    monkeypatch.setattr(executor, "run", flip(1))  # an element without overflow, made wrong
    bad = fuzz.check(g, [x])
    assert not bad.ok and bad.kind == "value", bad


_BEYOND_RANGE = """graph(%t0 : Tensor):
  %tiny : float = prim::Constant[value=1e-40]()
  %half : float = prim::Constant[value=0.5]()
  %v0 : Tensor = aten::sub(%t0, %tiny, %half)
  %v1 : Tensor = aten::div(%v0, %tiny)
  %v2 : Tensor = aten::mul(%t0, %half)
  return (%v1, %v2)
"""


def test_the_judge_excuses_values_whose_reference_moves_past_the_dtypes_range(monkeypatch):
    """(t - 5e-41) / 1e-40 in float16 at t = 0: eager's stored intermediate is 0, the fused float one -5e-41, and
    CUDA eager divides by a scalar through its reciprocal (1 / 1e-40 is inf in float): eager NaN, fused -inf, the
    float64 truth -0.5 (the CUDA fuzzer, seed 144929228). Moving the intermediates by 4 units of rounding moves that
    truth by about 2e33, past float16's largest value: any value is one rounding away, and the judge excuses it; the
    same -inf in a well-conditioned output (t * 0.5) is still caught."""
    _needs_cpu_fusion()
    g = torch.parse_ir(_BEYOND_RANGE)
    x = torch.tensor([0.0, -0.0, 1.5], dtype=torch.float16)
    real = executor.run

    def minus_inf(k):
        def run(spec, a):
            out = real(spec, a)
            if out is not None:
                out[k][:2] = -math.inf
            return out
        return run
    monkeypatch.setattr(executor, "run", minus_inf(0))
    v = fuzz.check(g, [x])
    assert v.ok and v.fused, v
    monkeypatch.setattr(executor, "run", minus_inf(1))
    bad = fuzz.check(g, [x])
    assert not bad.ok and bad.kind == "value" and "output 1" in bad.detail, bad
