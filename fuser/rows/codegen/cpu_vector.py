"""The CPU row kernel's at::vec loops (:class:`_Vector`), over the pointwise kernels' ``CpuVector`` lines."""
from __future__ import annotations

import torch

from ...codegen import KernelOptions
from ...codegen.cpu_vector import CpuVector
from ...codegen import CPU_VECTORS_PER_TRIP as COPIES
from ...descs import DENSE, TensorDesc, compute_type
from .. import templates as t
from ..passes import needed as _needed


class _Vector:
    """The CPU kernel's vector loops: each pass along the row runs ``CPU_VECTORS_PER_TRIP`` vectors a trip over
    at::vec (the pointwise kernels' ``CpuVector`` lines: the same op forms), then the scalar loop takes the tail
    from where they stopped. Row-level values enter as broadcasts. A row whose inputs step by 0 or 1 along it
    takes them (``vec_ok``, per row: strides are launch arguments); otherwise the scalar loop runs alone. Off for
    the kernel (``on`` False) when a node has no vector form, the inputs mix compute types or hold bools, a
    reduction converts its input, or an output's type is not the vectors'."""

    def __init__(self, group, inputs, rows_v, vname, vdtype, vector_args, tensor_index, order):
        self.group, self.inputs, self.vname, self.vector_args = group, inputs, vname, vector_args
        self.tensor_index, self.order = tensor_index, order
        self.vdtype = {**vdtype, **{i: None for i in rows_v}}  # row-level values: broadcasts (as float arguments)
        self.on = not any(dt == torch.bool for dt in inputs)
        self.descs = [TensorDesc(dt, DENSE, False) for dt in inputs]
        self.vtype = None
        self.parts: list[str] = []

    def _lines(self, wanted, held: frozenset, keep: frozenset):
        """(loads, op lines) for ``copies`` vectors of the values ``wanted`` needs, or None (no vector form);
        ``held``: the values read from their scratch rows, ``keep``: those written there (passes.kept_values)."""
        need = _needed(self.group, wanted, held)
        cv = CpuVector(self.descs, "cpu", KernelOptions())
        for i in sorted(need - set(self.tensor_index) - {v.id for v in self.group.inputs} - held,
                        key=self.order.__getitem__):
            n, op, variant, nt, consts, pos, round_to = self.vector_args[i]
            cv.add(n, op, variant, nt, consts, self.vname, self.vdtype, f"v{pos}", round_to)
        if not cv.on or cv.vtype is None:
            self.on = False
            return None
        if self.vtype is None:
            self.vtype, self.ctype = cv.vtype, cv.ctype
        elif cv.vtype != self.vtype:
            self.on = False
            return None
        if any(compute_type(self.vdtype[i]) != self.ctype for i in need & held):
            self.on = False
            return None
        loads = [f"const fz_v x{k}_{c} = cs{k} ? fz_vload(t{k} + off{k} + c + {c} * W) : fz_v(fz_ld(t{k}[off{k}]));"
                 for i, k in self.tensor_index.items() if i in need for c in range(COPIES)]
        loads += [f"const fz_v {self.vname[i]}_{c} = fz_vload(fz_s_{self.vname[i]} + c + {c} * W);"
                  for i in sorted(need & held, key=self.order.__getitem__) for c in range(COPIES)]
        stores = [f"fz_vstore(fz_s_{self.vname[i]} + c + {c} * W, {self.vname[i]}_{c});"
                  for i in sorted(keep, key=self.order.__getitem__) for c in range(COPIES)]
        return cv, loads + cv.lines(COPIES) + stores

    def reduction(self, u, red, pos: int, acc_t: str, same_type: bool, held: frozenset, keep: frozenset,
                  wanted, shifted: bool = False) -> None:
        """A pass's vector loop accumulating ``u``; ``shifted``: each vector sums its differences from its first
        trip's values (a centered mean: ``centered_means``)."""
        got = self._lines(wanted, held, keep) if self.on and same_type else None
        if got is None:
            self.on = False
            return
        cv, lines = got
        value = self.vname[u.id]
        if u.id not in self.tensor_index and compute_type(self.vdtype[u.id]) != self.ctype:
            self.on = False
            return
        shift_set = shift_add = ""
        decls = [f"      fz_v vacc{pos}_{c} = fz_v({red.identity.replace('$A', self.ctype)});" for c in range(COPIES)]
        accumulate = [f"          vacc{pos}_{c} = {red.combine}::f(vacc{pos}_{c}, {value}_{c});" for c in range(COPIES)]
        if shifted:  # besides the plain sums: each lane sums its differences from its first trip's value (so an
            # outlier in column 0 shifts one lane, not all), then adds the trips times that value's difference from the
            # row's first value (cref) in double: the differences from cref (accs, generate's loop), exactly 0 for a
            # row of equal values in every dtype
            decls += [f"      fz_v vs{pos}_{c} = fz_v(0), vsa{pos}_{c} = fz_v(0);" for c in range(COPIES)]
            shift_set = ("          if (c == 0) { " + " ".join(f"vs{pos}_{c} = {value}_{c};" for c in range(COPIES))
                         + " }\n")
            accumulate += [f"          vsa{pos}_{c} = vsa{pos}_{c} + ({value}_{c} - vs{pos}_{c});" for c in range(COPIES)]
            shift_add = (f"      {{ const double fz_trips = (double)(c0_{pos} / ({COPIES} * W));\n"
                         f"        const fz_vd fz_cr = fz_vd(cref{pos});\n"
                         f"        fz_vd fz_sa = fz_vd(0), fz_ss = fz_vd(0);\n" + "".join(
                             f"        fz_sa = fz_sa + fz_wsum(vsa{pos}_{c}); fz_ss = fz_ss + fz_wdiff(vs{pos}_{c}, fz_cr);\n"
                             for c in range(COPIES)) +
                         f"        accs{pos} += fz_lane_tree<fz_rsum, double>(fz_sa) + "
                         f"fz_trips * fz_lane_tree<fz_rsum, double>(fz_ss);\n"
                         "      }\n")
        self.parts.append(t.CPU_VECTOR_PASS.substitute(
            pos=pos, ident=red.identity.replace("$A", acc_t), decls="\n".join(decls), shift_set=shift_set,
            shift_add=shift_add, copies=COPIES, lines="\n".join("          " + ln for ln in lines),
            accumulate="\n".join(accumulate),
            combine="\n".join(f"      vacc{pos}_0 = {red.combine}::f(vacc{pos}_0, vacc{pos}_{c});"
                               for c in range(1, COPIES)),
            acc_t=acc_t, combine_fn=red.combine,
            lanes=(f"fz_lane_tree<fz_rsum, double>(fz_wsum(vacc{pos}_0))" if (red.combine, acc_t) == ("fz_rsum", "double")
                   else f"fz_lane_tree<{red.combine}, {acc_t}>(vacc{pos}_0)")))

    def stores(self, outs, held: frozenset, keep: frozenset, wanted, sums: tuple = ()) -> None:
        got = self._lines(wanted, held, keep) if self.on else None
        if got is None or any(compute_type(dt) != self.ctype or self.vdtype[o.id] != dt for _, o, dt in outs):
            self.on = False
            return
        cv, lines = got
        if any(self.vname[o.id] in cv.masks for _, o, _ in outs):
            self.on = False
            return
        lines += [f"fz_vstore(o{m} + row * cols + c + {c} * W, {self.vname[o.id]}_{c});" if m not in sums else
                  f"fz_vstore(fz_p{m} + c + {c} * W, fz_vload(fz_p{m} + c + {c} * W) + {self.vname[o.id]}_{c});"
                  for m, o, _ in outs for c in range(COPIES)]
        self.parts.append(t.CPU_VECTOR_STORES.substitute(copies=COPIES,
                                                         lines="\n".join("        " + ln for ln in lines)))
