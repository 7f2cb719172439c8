"""A finished fusion: its group (registered in the kernel store), and per execute: the inputs checked against the
definition, each group input made (the input itself, a broadcast view of it, a float, a shape carrier for
``uniform``), the group run through ``autodiff.run`` (the kernel, or the fallback), the outputs finished."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .. import autodiff, executor
from ..kernel_cache import STORE
from .datatype import DataType
from .handles import Scalar, Sym, Tensor


@dataclass(frozen=True)
class InputSpec:
    """What ``define_tensor`` declared: sizes (-1 any, 1 broadcast, n exactly n), contiguity in allocation order
    (True, False, None for a broadcast dim), stride order (0: innermost), whether it is a CPU scalar."""

    index: int
    dtype: DataType
    shape: tuple
    contiguity: tuple
    stride_order: tuple
    is_cpu: bool = False


class InputError(ValueError, RuntimeError):
    """Inputs that do not match the definition (a ValueError, and a RuntimeError as nvFuser raises)."""


@dataclass
class Fusion:
    id: int
    records: tuple
    group: object
    key: int  # the kernel store's
    inputs: list  # handles in execute order (Tensor or Scalar)
    specs: dict  # tensor index -> InputSpec
    in_plans: list
    outputs: list  # per output: (group output index or None, extents to expand to or None, group input to copy)
    constraints: list  # (extent, extent, where): run-time sizes that must be equal
    last: dict = field(default_factory=dict)
    checked: dict = field(default_factory=dict)  # input signature -> device, for inputs already checked

    @property
    def spec(self):
        return STORE.get(self.key)

    # ---- checking --------------------------------------------------------------------------------------
    def check(self, inputs, device=None) -> Optional[torch.device]:
        """The inputs' device, after checking them against the definition (once per input signature)."""
        try:
            sig = (device, tuple((x.shape, x.stride(), x.dtype, x.device) if isinstance(x, torch.Tensor) else type(x)
                                 for x in inputs))
        except (TypeError, RuntimeError):
            sig = None
        got = self.checked.get(sig, _UNCHECKED) if sig is not None else _UNCHECKED
        if got is not _UNCHECKED:
            return got
        dev = self._check(inputs, device)
        if sig is not None:
            if len(self.checked) >= 256:
                self.checked.clear()
            self.checked[sig] = dev
        return dev

    def _check(self, inputs, device=None) -> Optional[torch.device]:
        if not isinstance(inputs, (list, tuple)):
            raise InputError(f"execute takes a list of inputs, got {type(inputs).__name__}")
        if len(inputs) != len(self.inputs):
            raise InputError(f"execute: the definition has {len(self.inputs)} inputs "
                             f"({', '.join(repr(h) for h in self.inputs)}), got {len(inputs)}")
        where = None if device is None else torch.device(device)
        first = None
        for h, x in zip(self.inputs, inputs):
            if isinstance(h, Scalar):
                _check_scalar(h, x)
                continue
            spec: InputSpec = self.specs[h.index]
            if not isinstance(x, torch.Tensor):
                raise InputError(f"execute: input {h!r} must be a tensor (declared {_declared(spec)}), got "
                                 f"{type(x).__name__} {x!r}")
            if x.dim() != len(spec.shape):
                raise InputError(f"execute: input {h!r} has rank {x.dim()}; the definition declares rank "
                                 f"{len(spec.shape)} ({_declared(spec)})")
            if x.dtype != spec.dtype.torch_dtype:
                raise InputError(f"execute: input {h!r} has dtype {x.dtype}; the definition declares {spec.dtype} "
                                 f"({spec.dtype.torch_dtype}); cast it, or define the tensor with that dtype")
            for d, (want, got) in enumerate(zip(spec.shape, x.shape)):
                if want != -1 and want != got:
                    what = "a broadcast dim (size 1)" if want == 1 else f"size {want}"
                    raise InputError(f"execute: input {h!r} dim {d} has size {got}; the definition declares it "
                                     f"{what} (shape {list(spec.shape)})")
            if spec.is_cpu:
                if x.device.type != "cpu":
                    raise InputError(f"execute: input {h!r} is declared a CPU scalar (is_cpu=True) but is on {x.device}")
            else:
                if where is not None and x.device != where:
                    raise InputError(f"execute: input {h!r} is on {x.device}, but execute(device={device!r}) asks "
                                     f"for {where}")
                if first is None:
                    first = (h, x.device)
                elif x.device != first[1]:
                    raise InputError(f"execute: input {h!r} is on {x.device}, but {first[0]!r} is on {first[1]}: "
                                     "every tensor input must be on one device")
            _check_strides(h, spec, x)
        for a, b, what in self.constraints:
            sa, sb = self._size(a, inputs), self._size(b, inputs)
            if sa != sb:
                raise InputError(f"execute: {what} must have equal sizes (got {sa} and {sb}); a dim declared -1 "
                                 "does not broadcast: declare it 1 in define_tensor to broadcast it")
        return first[1] if first is not None else where

    def _size(self, e, inputs) -> int:
        if isinstance(e, Sym):
            k = next(j for j, h in enumerate(self.inputs) if h.index == e.tensor)
            return inputs[k].shape[e.dim]
        return e

    # ---- running ---------------------------------------------------------------------------------------
    def args(self, inputs, device) -> list:
        out = []
        for plan in self.in_plans:
            if plan[0] == "scalar":
                out.append(float(inputs[plan[1]]))
            elif plan[0] == "tensor":
                x = inputs[plan[1]]
                r, pos, exp = plan[2]
                if pos != tuple(range(r)) or any(e is not None for e in exp):
                    shape = [1] * r
                    for i, p in enumerate(pos):
                        shape[p] = x.shape[i]
                    x = x.view(shape) if x.dim() else x.reshape(shape)
                    if any(e is not None for e in exp):
                        x = x.expand([-1 if e is None else self._size(e, inputs) for e in exp])
                out.append(x)
            else:  # a shape carrier for uniform: only its shape, dtype and device are read
                _, ext, dt = plan
                if device is None:  # no tensor input says where: nvFuser's default device, else the CPU
                    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
                out.append(torch.empty([self._size(e, inputs) for e in ext], dtype=dt.torch_dtype, device=device))
        return out

    def run(self, inputs, device=None) -> list:
        dev = self.check(inputs, device)
        spec = self.spec
        args = self.args(inputs, dev)
        results = autodiff.run(spec, args) if self.group.outputs else []
        # what a later last_cuda_code() needs to plan the same launch: the arguments' layouts, not the tensors
        self.last = {"args": [a if not isinstance(a, torch.Tensor) else
                              (tuple(a.shape), a.stride(), a.dtype, a.device) for a in args]}
        outs = []
        for k, expand, copied in self.outputs:
            o = results[k] if k is not None else args[copied].clone()
            if expand is not None:
                o = o.expand([self._size(e, inputs) for e in expand])
            outs.append(o)
        return outs

    def fused(self) -> Optional[bool]:
        """Whether the last execute ran a compiled kernel (None: never executed)."""
        plan = self._last_plan()
        if plan is None or not self.group.outputs:  # every output a copy of an input: no group ran
            return None if plan is None else False
        return not isinstance(plan, str) and executor.kernel_for(self.spec, plan) is not None

    def _last_plan(self):
        args = self.last.get("args")
        if args is None:
            return None
        vals = [torch.empty_strided(a[0], a[1], dtype=a[2], device=a[3]) if isinstance(a, tuple) else a
                for a in args]
        return executor.plan(self.spec, vals)

    def kernel_code(self, inputs=None) -> str:
        if inputs is not None:
            dev = self.check(inputs)
            plan = executor.plan(self.spec, self.args(inputs, dev))
        else:
            plan = self._last_plan()
            if plan is None:
                raise RuntimeError("this fusion has never been executed: execute it first, or use cuda_code_for(inputs)")
        if isinstance(plan, str):
            raise RuntimeError(f"these inputs run through the fallback (no generated kernel): {plan}")
        kernel = executor.kernel_for(self.spec, plan)
        if kernel is None:
            raise RuntimeError("these inputs run through the fallback (no generated kernel): the group has an op the "
                               "code generator does not take yet (" + ", ".join(sorted(self.unfused_ops())) + ")")
        return kernel.source

    def unfused_ops(self) -> set:
        from .. import ops
        return {n.op for n in self.group.nodes if ops.of(n.op) is None}


_UNCHECKED = object()


def _declared(spec: InputSpec) -> str:
    return f"shape {list(spec.shape)}, {spec.dtype}"


def _check_scalar(h: Scalar, x) -> None:
    t = h.dtype.torch_dtype
    if isinstance(x, torch.Tensor):
        raise InputError(f"execute: input {h!r} must be a Python number ({h.dtype}), got a tensor of rank {x.dim()}")
    ok = (isinstance(x, bool) if t == torch.bool else
          isinstance(x, (int, float)) and not isinstance(x, bool) if t.is_floating_point else
          isinstance(x, (int, float, complex)) and not isinstance(x, bool) if t.is_complex else
          isinstance(x, int) and not isinstance(x, bool))
    if not ok:
        raise InputError(f"execute: input {h!r} must be a Python number of {h.dtype}, got {type(x).__name__} {x!r}")


def _check_strides(h: Tensor, spec: InputSpec, x: torch.Tensor) -> None:
    if x.numel() == 0 or x.dim() == 0:
        return
    r = x.dim()
    alloc = sorted(range(r), key=lambda d: -spec.stride_order[d])  # outermost first
    expected = 1
    for k in range(r - 1, -1, -1):
        d = alloc[k]
        c = spec.contiguity[k]
        size, stride = x.shape[d], x.stride(d)
        if c is None or size == 1:
            continue
        if c and stride != expected:
            raise InputError(f"execute: input {h!r} has strides {list(x.stride())} (sizes {list(x.shape)}); the "
                             f"definition declares dim {d} contiguous (contiguity {list(spec.contiguity)}, "
                             f"stride_order {list(spec.stride_order)}): pass x.contiguous(), or define the tensor "
                             "with contiguity False there")
        expected = stride * size
