"""Random programs and their inputs: value pools, input recipes (dtype, shape, layout, values), random
graphs over the op catalog, and the input sets of one graph of a campaign."""
from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

import torch

from .program import (_TCONST_TYPES, BY_OP, OP_NAMES, REDUCTION_CATALOG, VIEW_CATALOG, Arg, PNode, Program,
                      TensorInput, _broadcast)


FLOAT_POOL = (0.5, -1.5, 2.0, 3.0, 0.0, -0.0, 1.0, -1.0, 0.1, 1e-3, -0.25, 7.0, 0.3333333333333333, 1e30, -1e30,
              math.inf, -math.inf, math.nan, 1e-40, 65504.0, 70000.0, 1e-7)
INT_POOL = (0, 1, 2, -1, 3, -7, 100, 5)
ARG_POOLS = {
    "alpha": (1, 2, -1, 0, 0.5, -2.0, 1.5),
    "value": (1, 2, -1, 0, 0.5, -0.25, 3.0),
    "exponent": (2, 3, 0, -1, 0.5, 2.0, -0.5, 1.5, 10.0, 0.0, math.inf, math.nan, -2.0),
    "weight": (0.3, 0.5, 0.7, 1.0, 0.0, -0.5, 1.5, 0.49999, math.nan),
    "min_val": (-1, -0.5, 0.0, 1.0, -math.inf, math.nan, 2),
    "max_val": (1, 0.5, 0.0, -1.0, math.inf, math.nan, 3),
    "threshold": (0.1, 0.0, 1, -0.5, math.nan, 1e30, 20),
    "negative_slope": (0.01, 0.2, 0, -0.5, 1, 1.5, math.nan),
    "beta": (1, 2, 0.5, -1, 0, 1e-3, 100.0),
    "scale": (1, 1.0507009873554805, 2, -1, 0.5),
    "input_scale": (1, 0.5, 2, -1.5, 0),
}


def _pick_scalar(rng: random.Random, name: str, int_only: bool):
    pool = ARG_POOLS.get(name)
    if pool is None or rng.random() < 0.25:
        pool = INT_POOL if (int_only or rng.random() < 0.3) else FLOAT_POOL
    if int_only and rng.random() < 0.9:
        ints = [v for v in pool if isinstance(v, int)]
        if ints:
            pool = ints
    return rng.choice(pool)


@dataclass
class Recipe:
    """How one tensor input is made, independent of the map shape (so a second input set can reuse it)."""

    dtype: torch.dtype
    zero_dim: bool
    rank_drop: int  # leading map dims the input lacks
    ones: tuple  # map dims (indices) where the input has size 1
    layout: str
    seed: int


def _log_uniform_int(rng, lo, hi) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def _map_shape(rng: random.Random, rank: int, max_numel: int) -> tuple:
    if rank == 0:
        return ()
    total = _log_uniform_int(rng, 1, max_numel)
    # split log(total) at random into rank parts
    cuts = sorted(rng.random() for _ in range(rank - 1))
    parts = [b - a for a, b in zip([0.0] + cuts, cuts + [1.0])]
    dims = [max(1, int(round(total ** p))) for p in parts]
    for d in range(rank):
        r = rng.random()
        if r < 0.12:
            dims[d] = 1
        elif r < 0.22:
            dims[d] = rng.randint(2, 9)
    if rng.random() < 0.04:
        dims[rng.randrange(rank)] = 0
    while math.prod(dims) > max_numel:
        d = max(range(rank), key=lambda i: dims[i])
        dims[d] = max(1, dims[d] // 2)
    return tuple(dims)


_SPECIALS = {
    torch.float32: (math.nan, math.inf, -math.inf, -0.0, 0.0, 1e30, -3e38, 1e-30, 1e-40, 0.5, -1.0),
    torch.float64: (math.nan, math.inf, -math.inf, -0.0, 0.0, 1e300, -1e30, 1e-300, 1e-310, 0.5, -1.0),
    torch.float16: (math.nan, math.inf, -math.inf, -0.0, 0.0, 6e4, -65504.0, 1e-4, 6e-8, 0.5, -1.0),
    torch.bfloat16: (math.nan, math.inf, -math.inf, -0.0, 0.0, 1e30, -3e38, 1e-30, 1e-39, 0.5, -1.0),
}


def _values(n: int, dtype: torch.dtype, rng: random.Random, gen: torch.Generator) -> torch.Tensor:
    if n == 0:
        return torch.empty(0, dtype=dtype)
    if dtype == torch.bool:
        return torch.rand(n, generator=gen) < rng.choice((0.1, 0.5, 0.9))
    if dtype.is_floating_point:
        prof = rng.choice(("normal", "normal", "wide", "int", "half", "small", "unit", "big"))
        if prof == "normal":
            t = torch.randn(n, generator=gen, dtype=torch.float64) * rng.choice((1.0, 2.0, 10.0, 0.1))
        elif prof == "wide":
            mag = torch.empty(n, dtype=torch.float64).uniform_(-30, 30, generator=gen)
            sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
            t = sign * torch.pow(10.0, mag)
        elif prof == "int":
            t = torch.round(torch.randn(n, generator=gen, dtype=torch.float64) * 5)
        elif prof == "half":
            t = torch.round(torch.randn(n, generator=gen, dtype=torch.float64) * 6) / 2
        elif prof == "small":
            t = torch.randn(n, generator=gen, dtype=torch.float64) * 1e-4
        elif prof == "unit":
            t = torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1
        else:
            t = torch.randn(n, generator=gen, dtype=torch.float64) * 1e4
        if rng.random() < 0.6:
            k = min(n, rng.randint(1, 8))
            idx = torch.randperm(n, generator=gen)[:k]
            vals = [rng.choice(_SPECIALS[dtype]) for _ in range(k)]
            t[idx] = torch.tensor(vals, dtype=torch.float64)
        return t.to(dtype)
    info = torch.iinfo(dtype)
    prof = rng.choice(("small", "small", "medium", "extreme"))
    lo, hi = {"small": (-5, 6), "medium": (-1000, 1001), "extreme": (-1000, 1001)}[prof]
    lo, hi = max(lo, info.min), min(hi, info.max + 1)
    t = torch.randint(lo, hi, (n,), generator=gen, dtype=torch.int64)
    if prof == "extreme":
        k = min(n, rng.randint(1, 4))
        idx = torch.randperm(n, generator=gen)[:k]
        t[idx] = torch.tensor([rng.choice((info.min, info.max, 0, -1 if info.min < 0 else 1)) for _ in range(k)],
                              dtype=torch.int64)
    return t.to(dtype)


LAYOUTS = ("contiguous", "contiguous", "contiguous", "expand", "transpose", "step", "offset", "rows",
           "transpose_offset")


def _make_input(rec: Recipe, map_shape: tuple) -> TensorInput:
    rng = random.Random(rec.seed * 7919 + len(map_shape) * 31 + math.prod(map_shape))
    gen = torch.Generator().manual_seed(rng.getrandbits(62))
    if rec.zero_dim:
        size = ()
    else:
        size = tuple(1 if d in rec.ones else s for d, s in enumerate(map_shape))[rec.rank_drop:]
    layout = rec.layout
    meta = None
    big = [d for d, s in enumerate(size) if s > 1]
    if layout == "expand" and big:
        red = list(size)
        for d in big:
            if rng.random() < 0.6 or d == big[-1]:
                red[d] = 1
        meta = torch.empty(red, device="meta").expand(size)
    elif layout in ("transpose", "transpose_offset") and len(size) >= 2:
        perm = list(range(len(size)))
        while perm == sorted(perm):
            rng.shuffle(perm)
        inv = [perm.index(i) for i in range(len(size))]
        meta = torch.empty([size[p] for p in perm], device="meta").permute(inv)
        if layout == "transpose_offset":
            meta = torch.empty(meta.numel() + 1, device="meta")[1:].as_strided(meta.shape, meta.stride())
    elif layout == "step" and size:
        d = rng.randrange(len(size))
        k = rng.choice((2, 3))
        base = list(size)
        base[d] = size[d] * k
        meta = torch.empty(base, device="meta")
        meta = meta.narrow(d, 0, base[d])[(slice(None),) * d + (slice(None, None, k),)]
    elif layout == "offset":
        off = rng.choice((1, 3))
        n = math.prod(size)
        meta = torch.empty(n + off, device="meta")[off:].view(size)
    elif layout == "rows" and size:
        extra = rng.choice((1, 3, 8))
        base = list(size[:-1]) + [size[-1] + extra]
        start = rng.choice((0, extra))
        meta = torch.empty(base, device="meta")[..., start:start + size[-1]]
    if meta is None:
        layout = "contiguous"
        meta = torch.empty(size, device="meta")
    st, off = meta.stride(), meta.storage_offset()
    n_storage = 0 if meta.numel() == 0 else off + sum((s - 1) * x for s, x in zip(meta.shape, st)) + 1
    storage = _values(n_storage, rec.dtype, rng, gen)
    t = TensorInput(storage, meta.shape, st, off, layout)
    t.recipe = rec
    return t


def _sample(dtype: torch.dtype, zero_dim: bool) -> torch.Tensor:
    return torch.ones((), dtype=dtype) if zero_dim else torch.empty((0,), dtype=dtype)


def _pick_dtype(rng: random.Random) -> torch.dtype:
    r = rng.random()
    for p, dt in ((0.28, torch.float32), (0.43, torch.float16), (0.58, torch.bfloat16), (0.72, torch.float64),
                  (0.80, torch.int32), (0.87, torch.int64), (0.93, torch.bool)):
        if r < p:
            return dt
    return rng.choice((torch.int8, torch.uint8, torch.int16))


@dataclass
class Generated:
    program: Program
    recipes: list
    map_rank: int
    error_expected: bool


def generate(rng: random.Random, max_numel: int = 100_000, max_ops: int = 40) -> Generated:
    """A random program and its first input set."""
    main = _pick_dtype(rng)
    n_t = rng.choice((1, 1, 2, 2, 2, 3, 3, 4, 5))
    rank = rng.choice((0, 1, 1, 2, 2, 2, 3, 3, 4)) if rng.random() > 0.05 else 0
    map_shape = _map_shape(rng, rank, max_numel)
    recipes = []
    for k in range(n_t):
        dt = main if (k == 0 or rng.random() < 0.7) else _pick_dtype(rng)
        zero_dim = rank == 0 or (k > 0 and rng.random() < 0.12)
        rank_drop = 0 if (k == 0 or rank == 0 or rng.random() < 0.75) else rng.randint(1, rank)
        ones = () if k == 0 else tuple(d for d in range(rank) if rng.random() < 0.25)
        layout = rng.choice(LAYOUTS)
        recipes.append(Recipe(dt, zero_dim, rank_drop, ones, layout, rng.getrandbits(31)))
    tensors = [_make_input(r, map_shape) for r in recipes]
    floats: list = []

    # generation-time shadow values: zero-element (or 0-dim) tensors of each value's dtype
    shadow = {("t", k): _sample(r.dtype, r.zero_dim) for k, r in enumerate(recipes)}
    shapes = {("t", k): tuple(t.size) for k, t in enumerate(tensors)}
    full = _broadcast(*shapes.values())
    nodes: list = []
    n_ops = rng.choice((rng.randint(1, 3), rng.randint(4, 10), rng.randint(4, 10), rng.randint(11, 20),
                        rng.randint(21, max(21, max_ops))))
    n_ops = min(n_ops, max_ops)
    error_expected = False
    last = None

    def pick_val(cond=False):
        vals = list(shadow)
        if cond:
            bools = [v for v in vals if shadow[v].dtype == torch.bool]
            if bools:
                return rng.choice(bools)
            return None if rng.random() < 0.9 else rng.choice(vals)
        if last is not None and rng.random() < 0.5:
            return last
        return rng.choice(vals)

    for _ in range(n_ops):
        for attempt in range(10):
            entry = rng.choice(BY_OP[rng.choice(OP_NAMES)])
            args, sample_args, ok = [], [], True
            tensor_refs = []
            int_only = False
            for aname, atype, _ in entry.args:
                if atype in ("Tensor", "Optional[Tensor]"):
                    if atype == "Optional[Tensor]" and rng.random() < 0.3:
                        args.append(Arg("none"))
                        continue
                    if tensor_refs and rng.random() < 0.04:
                        dt = rng.choice(list(_TCONST_TYPES))
                        v = rng.choice((2, -3, 0)) if dt == torch.int64 else rng.choice((0.5, -2.25, 3.0, 1e-3))
                        args.append(Arg("tconst", v, dt))
                        continue
                    ref = pick_val(cond=(entry.op.keep_args and not args))
                    if ref is None:
                        ok = False
                        break
                    args.append(Arg("val", ref))
                    tensor_refs.append(ref)
                elif atype == "str":
                    args.append(Arg("str", rng.choice([k for k in entry.op.exprs if k is not None])))
                elif atype in ("Scalar", "Optional[number]", "number"):
                    if atype == "Optional[number]" and rng.random() < 0.3:
                        args.append(Arg("none"))
                        continue
                    int_only = bool(tensor_refs) and all(not shadow[r].is_floating_point() for r in tensor_refs)
                    if rng.random() < 0.35:
                        if floats and rng.random() < 0.5:
                            args.append(Arg("float", rng.randrange(len(floats))))
                        else:
                            floats.append(rng.choice(FLOAT_POOL) if rng.random() < 0.6 else
                                          rng.choice(ARG_POOLS.get(aname, FLOAT_POOL)) * 1.0)
                            args.append(Arg("float", len(floats) - 1))
                    else:
                        args.append(Arg("const", _pick_scalar(rng, aname, int_only)))
                else:
                    raise AssertionError(f"unexpected argument type {atype} in {entry.schema}")
            if not ok or not tensor_refs:
                continue
            # shadow evaluation: the result dtype, or eager's error
            pos, kw = [], {}
            for a, (aname, atype, kwo) in zip(args, entry.args):
                val = (shadow[a.v] if a.kind == "val" else floats[a.v] if a.kind == "float" else
                       a.v if a.kind in ("const", "str") else None if a.kind == "none" else
                       torch.tensor(a.v, dtype=a.dtype))
                if kwo:
                    kw[aname] = val
                else:
                    pos.append(val)
            try:
                res = entry.fn(*pos, **kw)
            except Exception:  # noqa: BLE001
                if rng.random() < 0.03:
                    error_expected = True
                    res = None
                else:
                    continue
            ref = ("n", len(nodes))
            nodes.append(PNode(entry, args))
            shapes[ref] = _broadcast(*(shapes[r] for r in tensor_refs))
            if res is not None:
                shadow[ref] = res
            last = ref
            break
        if error_expected:
            break
    reduced = None  # the op after an added reduction or permute: always an output
    permuted_from = None  # the value an added permute reads (of the full shape)
    viewed_only = False  # the op after a permute is the only output
    if nodes and not error_expected:
        # now and then a reduction or normalization over the last dim of the last value, and an op after it: drawn
        # from a generator of its own, so that the pointwise programs of a seed stay what they were
        side = random.Random(hash(rng.getstate()[1]))  # the state's ints: the same in every process
        if side.random() < REDUCTION_RATE:
            got = _add_reduction(side, nodes, shadow, shapes, last, full)
            if got is not None:
                last = reduced = got
        # or else a permute of it and an op after it, from a generator of its own too
        view_side = random.Random(hash(rng.getstate()[1]) ^ 0x5EED)
        if reduced is None and view_side.random() < PERMUTE_RATE:
            reduced = _add_permute(view_side, nodes, shadow, shapes, last, full)
            permuted_from = last if reduced is not None else None
            # mostly its only output: a group writes its outputs in one space (fuser/views.py), so outputs read with
            # and without the permute fall back
            viewed_only = reduced is not None and view_side.random() < 0.7
    if not nodes:
        # always something: neg works on every dtype but bool, abs... use add with itself
        entry = _ADD
        nodes.append(PNode(entry, [Arg("val", ("t", 0)), Arg("val", ("t", 0)), Arg("const", 1)]))
        shapes[("n", 0)] = shapes[("t", 0)]
    used = {a.v for n in nodes for a in n.args if a.kind == "val"}
    sinks = [("n", j) for j in range(len(nodes)) if ("n", j) not in used]
    outs = list(sinks) + [("n", j) for j in range(len(nodes)) if ("n", j) in used and rng.random() < 0.2]
    if rng.random() < 0.9:  # outputs of the group's full shape, so that it can fuse
        outs = [r for r in outs if shapes[r] == full]
    if error_expected:
        outs = [("n", len(nodes) - 1)]
    if not outs:
        entry = _ADD
        # the last value plus t0; after a permute, the value it permuted (of the full shape): a permuted [a, b, 1]
        # plus t0 [a, b, 1] holds a * b * b elements (a fuzz worker took 108 GB of an H200's memory that way)
        src = permuted_from or ("n", len(nodes) - 1)
        nodes.append(PNode(entry, [Arg("val", src), Arg("val", ("t", 0)), Arg("const", 1)]))
        outs = [("n", len(nodes) - 1)]
    rng.shuffle(outs)
    outs = outs[:8]
    if reduced is not None and reduced not in outs:
        outs = [reduced] + outs[:7]
    if viewed_only:
        outs = [reduced]
    p = Program(tensors, floats, nodes, outs).compact()
    return Generated(p, recipes, rank, error_expected)


REDUCTION_RATE = 0.15  # of the programs that get a reduction or normalization (generate)
PERMUTE_RATE = 0.1  # of the others: a permute of the last value (generate)

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_REDUCTION_ENTRIES = {e.id: e for e in REDUCTION_CATALOG}
_ADD = next(e for e in BY_OP["add"] if e.overload == "Tensor")  # add.Tensor


def _reduction_args(kind: str, x: tuple, cols: int, side: random.Random) -> list:
    """The arguments of reduction ``kind`` of value ``x`` over its last dim (keepdim, so its result broadcasts)."""
    val, last = Arg("val", x), Arg("ints", (-1,))
    if kind in ("sum.dim_IntList", "mean.dim"):
        return [val, last, Arg("bool", True), Arg("none")]
    if kind in ("amax", "amin"):
        return [val, last, Arg("bool", True)]
    if kind in ("var.correction", "std.correction"):
        return [val, last, Arg("const", side.choice((0, 1))), Arg("bool", True)]
    if kind in ("var.dim", "std.dim"):
        return [val, last, Arg("bool", side.random() < 0.5), Arg("bool", True)]
    if kind in ("softmax.int", "log_softmax.int"):
        return [val, Arg("const", -1), Arg("none")]
    if kind == "layer_norm":
        return [val, Arg("ints", (cols,)), Arg("none"), Arg("none"), Arg("const", side.choice((1e-5, 1e-3))),
                Arg("bool", True)]
    if kind == "rms_norm":
        return [val, Arg("ints", (cols,)), Arg("none"), Arg("none")]  # eps None
    raise AssertionError(f"no arguments for {kind}")


def _add_reduction(side: random.Random, nodes: list, shadow: dict, shapes: dict, last, full: tuple):
    """Append a reduction (keepdim) or normalization over the last dim of ``last`` (a floating value of the full
    shape), then ``sub(last, it)`` or ``add(it, last)``, which broadcasts it back: the row kernel's prologue and
    epilogue. Returns the last node's ref, or None where it does not apply."""
    if last is None or not full or shapes.get(last) != full or shadow[last].dtype not in _FLOATING:
        return None
    kind = side.choice(sorted(_REDUCTION_ENTRIES))
    entry = _REDUCTION_ENTRIES[kind]
    args = _reduction_args(kind, last, full[-1], side)
    meta = torch.empty(full, dtype=shadow[last].dtype, device="meta")
    vals = [meta if a.kind == "val" else None if a.kind == "none" else list(a.v) if a.kind == "ints" else a.v
            for a in args]
    pos = [v for v, (_, _, kwo) in zip(vals, entry.args) if not kwo]
    kw = {name: v for v, (name, _, kwo) in zip(vals, entry.args) if kwo}
    try:
        res = entry.fn(*pos, **kw)
    except Exception:  # noqa: BLE001  (an empty row's amax: no program)
        return None
    red = ("n", len(nodes))
    nodes.append(PNode(entry, args))
    shadow[red], shapes[red] = torch.empty((0,), dtype=res.dtype), tuple(res.shape)
    if side.random() < 0.5:
        epi = [Arg("val", last), Arg("val", red), Arg("const", 1)]
        entry2 = next(e for e in BY_OP["sub"] if e.overload == "Tensor")
    else:
        epi = [Arg("val", red), Arg("val", last), Arg("const", 1)]
        entry2 = _ADD
    out = ("n", len(nodes))
    nodes.append(PNode(entry2, epi))
    shadow[out] = torch.empty((0,), dtype=torch.promote_types(res.dtype, shadow[last].dtype))
    shapes[out] = full
    return out


def _add_permute(side: random.Random, nodes: list, shadow: dict, shapes: dict, last, full: tuple):
    """Append ``permute(last, dims)`` (dims not the identity) and ``add(it, it)``, which reads the value through the
    view (the pass moves a group's permutes: ``fuser/views.py``). Returns the add's ref (an output), or None where
    it does not apply (rank below 2, a bool value, a value of another shape)."""
    if last is None or len(full) < 2 or shapes.get(last) != full or shadow[last].dtype == torch.bool:
        return None
    dims = list(range(len(full)))
    while dims == sorted(dims):
        side.shuffle(dims)
    entry = VIEW_CATALOG[0]
    view = ("n", len(nodes))
    nodes.append(PNode(entry, [Arg("val", last), Arg("ints", tuple(dims))]))
    shadow[view], shapes[view] = torch.empty((0,), dtype=shadow[last].dtype), tuple(full[d] for d in dims)
    out = ("n", len(nodes))
    nodes.append(PNode(_ADD, [Arg("val", view), Arg("val", view), Arg("const", 1)]))
    shadow[out], shapes[out] = shadow[view], shapes[view]
    return out


def graph_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index * 7_919 + 12_345) % (2 ** 62)


def _inputs_for_variant(g: Generated, variant: int, seed: int, index: int, max_numel: int) -> Program:
    if variant == 0:
        return g.program
    rng = random.Random(graph_seed(seed, index) ^ (variant * 0x9E3779B97F4A7C15 % 2 ** 62))
    p = g.program
    map_shape = _map_shape(rng, g.map_rank, max_numel)
    tensors = []
    for t in p.tensors:
        rec = t.recipe
        tensors.append(_make_input(dataclasses.replace(rec, seed=rng.getrandbits(31)), map_shape))
    floats = [rng.choice(FLOAT_POOL) if rng.random() < 0.5 else f for f in p.floats]
    return Program(tensors, floats, p.nodes, p.outputs)


def build_case(seed: int, index: int, max_numel: int = 100_000, max_ops: int = 40) -> Generated:
    """Generate graph ``index`` of campaign ``seed``, remembering each surviving input's recipe."""
    rng = random.Random(graph_seed(seed, index))
    g = generate(rng, max_numel, max_ops)
    return g
