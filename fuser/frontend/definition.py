"""``FusionDefinition`` and ``FusionManager``: nvFuser's Python frontend on fuser's group IR.

``with FusionDefinition() as fd:`` records the definition (``define_tensor``, ``define_scalar``, ``fd.ops.*``,
``add_output``); leaving the block looks its records up in the definition cache and, on a miss, lowers them to
one ``ir.Group`` (``lower.py``) registered in the kernel store. ``fd.execute(inputs)`` checks the inputs
against the definition and runs the group like every other front door (``autodiff.run``: the compiled kernel,
or the fallback). Both spellings work: nvFuser's current one (``define_tensor(shape=, contiguity=)``,
``define_scalar``, ``fd.execute``) and the legacy one (``FusionManager.get()``, ``FusionDefinition(fm)``,
``define_tensor(symbolic_sizes=, contiguous=)``, ``define_constant``, ``fm.execute``).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .datatype import DataType, as_datatype, from_torch, of_python
from .handles import Scalar, Sym, Tensor, Vector
from .lower import Lowerer
from .ops import Operators
from .records import CACHE, Record, Ref
from .repro import definition_text, dump, dump_requested, script
from .runtime import Fusion, InputSpec

_NO_DEFAULT = object()


def _arg(a):
    if isinstance(a, (Tensor, Scalar, Vector)):
        return Ref(a.kind, a.index)
    if isinstance(a, (list, tuple)):
        return [_arg(x) for x in a]
    return a


class FusionDefinition:
    """A fusion, defined in a ``with`` block (or by overriding :meth:`definition`) and run by :meth:`execute`.

    ``FusionDefinition()`` starts a definition; ``FusionDefinition(fm)`` (a :class:`FusionManager`) does too and
    makes it the manager's current fusion; ``FusionDefinition(fusion_id)`` rebinds to a cached fusion.
    """

    Operators = Operators

    def __init__(self, arg=None, max_length: int = 9999, **_ignored):
        self._manager = arg if isinstance(arg, FusionManager) else None
        self._fusion: Optional[Fusion] = None
        if isinstance(arg, int) and not isinstance(arg, bool):
            if not 0 <= arg < CACHE.num_fusions():
                raise ValueError(f"no cached fusion with id {arg} ({CACHE.num_fusions()} exist)")
            self._fusion = CACHE.fusions[arg]
        self._open = False
        self._reset()

    def _reset(self):
        self._records: list = []
        self._handles: dict = {}
        self._producers: dict = {}
        self._inputs: list = []
        self._specs: dict = {}
        self._outputs: list = []
        self._constraints: list = []
        self._next = 0
        self._failed: Optional[BaseException] = None
        self.ops = Operators(self)

    # ---- the definition block -------------------------------------------------------------------------
    def __enter__(self) -> "FusionDefinition":
        self._reset()
        self._fusion = None
        self._open = True
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._open = False
        if exc_type is not None:
            self._fusion = None  # nothing half-built is kept or cached
            return False
        self._finalize()
        return False

    def definition(self) -> None:
        """Override in a subclass to define the fusion; :meth:`execute` then builds it on first use."""
        raise NotImplementedError("this FusionDefinition has no definition: define it in a `with "
                                  "FusionDefinition() as fd:` block, or subclass it and override definition()")

    def _check_open(self) -> None:
        if self._failed is not None:
            raise RuntimeError(f"this definition already failed ({self._failed}); start a new FusionDefinition")
        if not self._open:
            raise RuntimeError("Attempting to add to a completed definition! Define inside `with FusionDefinition() "
                               "as fd:`")

    def _record(self, name: str, args: tuple, kwargs: tuple, outs: Sequence, plan: tuple) -> list:
        self._check_open()
        handles = []
        for kind, dt, ext in outs:
            idx = self._next
            self._next += 1
            h = (Tensor(self, idx, dt, ext) if kind == "T" else Vector(self, idx, ext) if kind == "V"
                 else Scalar(self, idx, dt, ext))
            self._handles[idx] = h
            handles.append(h)
        rec = Record(name, tuple(_arg(a) for a in args), tuple((k, _arg(v)) for k, v in kwargs),
                     tuple(Ref(h.kind, h.index) for h in handles), plan)
        self._records.append(rec)
        for k, h in enumerate(handles):
            if isinstance(h, Tensor):
                self._producers[h.index] = (rec, k)
        return handles

    def _error(self, exc: BaseException) -> BaseException:
        self._failed = exc
        return exc

    # ---- inputs and constants ---------------------------------------------------------------------------
    def define_tensor(self, *args, **kwargs) -> Tensor:
        """A tensor input. ``define_tensor(shape=[-1, 1, -1], contiguity=[True, None, True], dtype=DataType.Float,
        is_cpu=False, stride_order=[2, 1, 0])``: -1 is any size, 1 a broadcast dim, n exactly n; contiguity per
        dim in allocation order (None for broadcast dims; a bool for all dims). Also the legacy spellings
        ``define_tensor(ndims)``, ``define_tensor(symbolic_sizes=, contiguous=, dtype=)`` and the concrete
        ``define_tensor(sizes=, strides=, dtype=, static_sizes=False)``."""
        self._check_open()
        kw = dict(kwargs)
        if args and isinstance(args[0], int) and not isinstance(args[0], bool) and "shape" not in kw:
            if len(args) > 1:
                kw.setdefault("dtype", args[1])
            shape, contiguity = [-1] * args[0], None
            return self._define_tensor(shape, contiguity, kw.pop("dtype", DataType.Float), False, None)
        names = ("shape", "contiguity", "dtype", "is_cpu", "stride_order")
        for n, a in zip(names, args):
            if n in kw:
                raise self._error(TypeError(f"define_tensor got {n} twice"))
            kw[n] = a
        if "symbolic_sizes" in kw:
            kw["shape"] = kw.pop("symbolic_sizes")
        if "contiguous" in kw:
            kw["contiguity"] = kw.pop("contiguous")
        if "sizes" in kw:
            return self._from_sizes(kw.pop("sizes"), kw.pop("strides", None), kw.pop("dtype", DataType.Float),
                                    kw.pop("static_sizes", False), kw.pop("is_cpu", False))
        unknown = set(kw) - set(names)
        if unknown:
            raise self._error(TypeError(f"define_tensor has no argument {sorted(unknown)[0]!r}"))
        if "shape" not in kw:
            raise self._error(TypeError("define_tensor needs shape= (or symbolic_sizes=, sizes=, or a rank)"))
        return self._define_tensor(kw["shape"], kw.get("contiguity"), kw.get("dtype", DataType.Float),
                                   kw.get("is_cpu", False), kw.get("stride_order"))

    def _define_tensor(self, shape, contiguity, dtype, is_cpu, stride_order) -> Tensor:
        dt = as_datatype(dtype, "define_tensor: dtype")
        if dt is DataType.Null:
            raise self._error(TypeError("define_tensor: dtype cannot be DataType.Null"))
        shape = list(shape)
        for i, s in enumerate(shape):
            if not isinstance(s, int) or isinstance(s, bool) or s < -1:
                raise self._error(ValueError(f"define_tensor: the value {s!r} at index {i} of shape {shape} was "
                                             "neither symbolic(-1), zero_element(0), broadcast(1), or static(>1)"))
        r = len(shape)
        order = list(range(r - 1, -1, -1)) if not stride_order else list(stride_order)
        if sorted(order) != list(range(r)):
            raise self._error(ValueError(f"define_tensor: stride_order {order} is not a permutation of 0..{r - 1}"))
        alloc = sorted(range(r), key=lambda d: -order[d])
        if contiguity is None or isinstance(contiguity, bool):
            flag = bool(contiguity)
            contig = [None if shape[d] == 1 else flag for d in alloc]
        else:
            contig = list(contiguity)
            if len(contig) != r:
                raise self._error(ValueError(f"define_tensor: contiguity {contig} has {len(contig)} entries for "
                                             f"a tensor of rank {r} (shape {shape})"))
            contig = [None if shape[d] == 1 else (False if c is None else bool(c)) for d, c in zip(alloc, contig)]
        if is_cpu and r != 0:
            raise self._error(ValueError(f"define_tensor: is_cpu=True is only for 0-dim (scalar) tensors; shape "
                                         f"{shape} has rank {r}"))
        idx = self._next
        ext = tuple(Sym(idx, d) if s == -1 else s for d, s in enumerate(shape))
        kwargs = (("shape", shape), ("contiguity", contig), ("dtype", dt), ("is_cpu", bool(is_cpu)),
                  ("stride_order", order))
        t = self._record("define_tensor", (), kwargs, [("T", dt, ext)], ("input",))[0]
        self._inputs.append(t)
        self._specs[t.index] = InputSpec(t.index, dt, tuple(shape), tuple(contig), tuple(order), bool(is_cpu))
        return t

    def _from_sizes(self, sizes, strides, dtype, static_sizes, is_cpu) -> Tensor:
        sizes = list(sizes)
        strides = list(strides) if strides is not None else torch.empty(sizes, device="meta").stride()
        r = len(sizes)
        # rank of each stride, 0 innermost; equal strides keep the later dim inner
        by_stride = sorted(range(r), key=lambda d: (strides[d], -d))
        order = [0] * r
        for rank, d in enumerate(by_stride):
            order[d] = rank
        alloc = sorted(range(r), key=lambda d: -order[d])
        contig, expected = [None] * r, 1
        for k in range(r - 1, -1, -1):
            d = alloc[k]
            if sizes[d] == 1:
                continue
            contig[k] = strides[d] == expected
            expected = strides[d] * sizes[d]
        shape = [s if static_sizes or s == 1 else -1 for s in sizes]
        return self._define_tensor(shape, [c if c is not None else True for c in contig], dtype, is_cpu, order)

    def from_pytorch(self, t: torch.Tensor, static_sizes: bool = False) -> Tensor:
        """A tensor input shaped like ``t`` (its sizes, strides and dtype)."""
        if not isinstance(t, torch.Tensor):
            raise self._error(TypeError(f"from_pytorch expects a torch.Tensor, got {type(t).__name__}"))
        return self._from_sizes(t.shape, t.stride(), from_torch(t.dtype), static_sizes,
                                t.dim() == 0 and t.device.type == "cpu")

    def define_scalar(self, value=_NO_DEFAULT, dtype=_NO_DEFAULT) -> Scalar:
        """A scalar: ``define_scalar(3.0)`` a constant (dtype from the Python type: Double, Int, Bool,
        ComplexDouble; or given), ``define_scalar(dtype=DataType.Double)`` a symbolic input given at execute."""
        self._check_open()
        if isinstance(value, (DataType, torch.dtype)) and dtype is _NO_DEFAULT:
            value, dtype = None, value
        if value is _NO_DEFAULT:
            value = None
        if value is None:
            dt = DataType.Double if dtype is _NO_DEFAULT or dtype is None else as_datatype(dtype, "define_scalar")
            s = self._record("define_scalar", (None,), (("dtype", dt),), [("S", dt, None)], ("input",))[0]
            self._inputs.append(s)
            return s
        if isinstance(value, torch.Tensor) or not isinstance(value, (bool, int, float, complex)):
            raise self._error(TypeError(f"define_scalar: expected a Python number, got {type(value).__name__}"))
        dt = of_python(value) if dtype is _NO_DEFAULT or dtype is None else as_datatype(dtype, "define_scalar")
        value = torch.tensor(value).to(dt.torch_dtype).item() if dt.torch_dtype is not None else value
        return self._record("define_scalar", (value,), (("dtype", dt),), [("S", dt, value)], ("const",))[0]

    def define_constant(self, value, dtype=None) -> Scalar:
        """The legacy spelling of ``define_scalar(value)``."""
        return self.define_scalar(value, dtype if dtype is not None else _NO_DEFAULT)

    def add_output(self, t, alias_input=None, stride_order=None) -> None:
        """Make tensor ``t`` of this definition an output (returned by execute in add_output order)."""
        self._check_open()
        if alias_input is not None or stride_order:
            raise self._error(NotImplementedError("add_output with alias_input or stride_order: not supported yet"))
        if not isinstance(t, Tensor):
            what = ("a Scalar (scalar outputs are not supported yet)" if isinstance(t, Scalar)
                    else f"{type(t).__name__} {t!r}")
            raise self._error(TypeError(f"add_output expects a Tensor defined in this definition, got {what}"))
        if t.fd is not self or self._handles.get(t.index) is not t:
            raise self._error(ValueError(f"add_output: {t!r} was never defined in this definition (it belongs to "
                                         "another FusionDefinition)"))
        self._record("add_output", (t,), (), [], ("output",))
        self._outputs.append(t)

    # ---- finishing --------------------------------------------------------------------------------------
    def _finalize(self) -> None:
        if self._failed is not None:
            raise self._failed
        if not self._outputs:
            raise RuntimeError("the definition has no outputs: call fd.add_output(tensor)")
        records = tuple(self._records)
        fusion = CACHE.lookup(records)
        if fusion is None:
            fusion = CACHE.insert(records, self._build)
        self._fusion = fusion
        if self._manager is not None:
            self._manager._current = fusion
        if dump_requested():
            dump(str(self))

    def _build(self, fusion_id: int) -> Fusion:
        from ..kernel_cache import STORE
        low = Lowerer(self._handles, self._producers, list(self._inputs))
        lvs = [low.tensor(t.index) for t in self._outputs]
        # an output that is a group input (an input, or a view of one) is copied at execute, not computed by the
        # group: a kernel's outputs are fresh tensors, so it would send the whole group to the fallback
        position = {v.id: j for j, v in enumerate(low.b.inputs)}
        computed = [lv.value for lv in lvs if lv.value.id not in position]
        group = low.b.build(computed)
        key = STORE.register(group)
        outs, k = [], 0
        for t, lv in zip(self._outputs, lvs):
            phys = (1,) * (t.ndim - len(lv.phys)) + tuple(lv.phys)
            narrower = len(lv.phys) != t.ndim or any(p == 1 and e != 1 for p, e in zip(phys, t.extents))
            if lv.value.id in position:
                outs.append((None, t.extents if narrower else None, position[lv.value.id]))
            else:
                outs.append((k, t.extents if narrower else None, None))
                k += 1
        return Fusion(fusion_id, tuple(self._records), group, key, list(self._inputs), dict(self._specs),
                      low.in_plans, outs, list(self._constraints))

    def _ensure(self) -> Fusion:
        if self._fusion is None:
            if type(self).definition is FusionDefinition.definition:
                raise NotImplementedError("this FusionDefinition has no definition: define it in a `with` block "
                                          "first, or subclass it and override definition()")
            with self:
                self.definition()
        return self._fusion

    # ---- running and debugging --------------------------------------------------------------------------
    def execute(self, inputs=(), *, device=None, print_repro: bool = False, **_options) -> list:
        """Run the fusion on ``inputs`` (tensors and symbolic scalars, in definition order); the outputs as a list,
        in add_output order. ``device``: where a definition without tensor inputs runs."""
        fusion = self._ensure()
        if print_repro:
            print(self.repro_script_for(inputs))
        return fusion.run(list(inputs), device)

    def id(self) -> Optional[int]:
        """The fusion id (the definition cache's), or None before the definition is finished."""
        return None if self._fusion is None else self._fusion.id

    def __repr__(self) -> str:
        records = self._fusion.records if self._fusion is not None and not self._records else tuple(self._records)
        return definition_text(records, self.id())

    def repro_script_for(self, inputs) -> str:
        """A standalone Python script that re-creates this fusion and runs it on inputs like ``inputs``."""
        f = self._ensure()
        f.check(list(inputs))
        return script(f.records, f.id, list(inputs))

    def fusion_ir(self) -> str:
        """The group IR's canonical text."""
        return self._ensure().group.text()

    def last_cuda_code(self, intrinsic_code: bool = False) -> str:
        """The generated kernel source of the last execute (CUDA, or C++ on the CPU backend); RuntimeError when it
        ran through the fallback or never ran."""
        return self._ensure().kernel_code()

    last_kernel_code = last_cuda_code

    def cuda_code_for(self, inputs, intrinsic_code: bool = False) -> str:
        """The generated kernel source for ``inputs``."""
        return self._ensure().kernel_code(list(inputs))

    def last_run_fused(self) -> Optional[bool]:
        """Whether the last execute ran a compiled kernel (False: the fallback; None: never executed)."""
        return self._ensure().fused()

    def inputs(self) -> list:
        return [h.index for h in (self._fusion.inputs if self._fusion else self._inputs)]


class FusionManager:
    """The legacy API's process-wide manager: ``FusionManager.get()``; ``FusionDefinition(fm)`` makes the
    definition its current fusion; ``fm.execute(inputs)`` runs it; ``FusionManager.print_ir()`` prints its IR."""

    _instance: Optional["FusionManager"] = None

    def __init__(self):
        self._current: Optional[Fusion] = None

    @classmethod
    def get(cls, max_fusions: int = 8192) -> "FusionManager":
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def _fusion(self) -> Fusion:
        if self._current is None:
            raise RuntimeError("the FusionManager has no fusion yet: define one with `with FusionDefinition(fm) as fd:`")
        return self._current

    def execute(self, inputs) -> list:
        return self._fusion().run(list(inputs))

    def print_ir(self=None) -> None:
        fm = self if isinstance(self, FusionManager) else FusionManager.get()
        f = fm._fusion()
        print(definition_text(f.records, f.id))
        print(f.group.text())
