"""The TorchScript operators the pass's graphs call: ``fuser::fusion_group`` (one fusion group: the kernel, the
differentiable group, or the fallback; ``fuser::fusion_group1`` for a group of one output, ``fusion_group1_t1`` to
``fusion_group1_t4`` for one of one output and 1-4 tensor inputs, each an argument of its own, ``fusion_group<m>_c<n>``
for one of 1-3 outputs whose 1-4 tensor arguments may be tensors whose chunks the group takes),
``fuser::broadcasting_chunk`` (chunk motion's chunk of every input) and ``fuser::batch_norm_params`` (the inference
batch norm decomposition's per-channel vectors).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from . import autodiff, graph_fuser, native, ts_ir
from .kernel_cache import STORE

_SPECS = STORE._specs  # key -> spec; read without a lock on the hot path (a plain dict read under the GIL)
_lib = torch.library.Library("fuser", "DEF")
# key: this process's spec key (the fast path); digest and ir: the group's identity and its TorchScript graph, so that a
# module saved with torch.jit.save and loaded in another process finds (or rebuilds) the same group
_lib.define("fusion_group(Tensor[] inputs, float[] scalars, int key, str digest, str ir) -> Tensor[]")
# a group of one output: its tensor alone (TorchScript then builds and unpacks no list: about 0.2 us a call)
_lib.define("fusion_group1(Tensor[] inputs, float[] scalars, int key, str digest, str ir) -> Tensor")
# ... and one of 1-4 tensor inputs, each an argument (no list to build, none to unbox: about 0.15 us a call)
for _n in range(1, graph_fuser.FIXED_INPUTS + 1):
    _lib.define(f"fusion_group1_t{_n}({''.join(f'Tensor t{i}, ' for i in range(_n))}float[] scalars, int key, "
                "str digest, str ir) -> Tensor")
# ... and one of 1-3 outputs, each a result of its own, whose tensor arguments may be chunked by the call: chunks holds,
# per group input, (argument, chunk index, chunks, dim), the argument itself where chunks is 1 (empty: the arguments)
for _m in range(1, graph_fuser.CHUNK_OUTPUTS + 1):
    for _n in range(1, graph_fuser.FIXED_INPUTS + 1):
        _lib.define(f"{graph_fuser.chunk_call(_m, _n).split('::')[1]}({''.join(f'Tensor t{i}, ' for i in range(_n))}"
                    f"int[] chunks, float[] scalars, int key, str digest, str ir) -> "
                    f"({', '.join(['Tensor'] * _m)})")


def run_key(key: int, args: list) -> list[torch.Tensor]:
    spec = STORE.get(key)
    if spec is None:
        raise KeyError(f"no fusion group registered under key {key} "
                       f"(keys 0..{len(STORE) - 1} exist); register_fusion(node) returns valid keys")
    return autodiff.run(spec, args)


def _spec_for(key: int, digest: str, ir: str):
    spec = _SPECS.get(key)
    if spec is not None and spec.digest == digest:
        return spec
    spec = STORE.by_digest(digest)
    if spec is None:  # saved by another process: rebuild the group from its graph
        spec = STORE.get(register_graph(torch.parse_ir(ir, parse_tensor_constants=True)))
        if spec.digest != digest:
            raise RuntimeError("this fused TorchScript code was saved by another process and its fusion group "
                               "cannot be rebuilt exactly from the saved text (a tensor constant printed with "
                               "rounding?). Load the unfused module and apply fuser.fuse() again.")
    return spec


def _run_group(inputs: list[torch.Tensor], scalars: list[float], key: int, digest: str, ir: str):
    spec = _spec_for(key, digest, ir)
    if spec.all_tensors:
        args = inputs
    else:
        tensors, floats = iter(inputs), iter(scalars)
        args = [next(tensors) if is_t else next(floats) for is_t in spec.input_is_tensor]
    return spec, args, autodiff.run(spec, args)


_native_started = []


def _fusion_group(inputs: list[torch.Tensor], scalars: list[float], key: int, digest: str,
                  ir: str) -> list[torch.Tensor]:
    if not _native_started:  # the first fused call: load the native hot path, or start building it
        _native_started.append(True)
        native.ensure()
    return _run_group(inputs, scalars, key, digest, ir)[2]


def _fusion_group1(inputs: list[torch.Tensor], scalars: list[float], key: int, digest: str, ir: str) -> torch.Tensor:
    return _fusion_group(inputs, scalars, key, digest, ir)[0]


def _fixed_inputs(n: int):
    """The Python kernel of ``fuser::fusion_group1_t<n>``: its first ``n`` arguments are the tensors."""
    def fusion_group1_fixed(*args) -> torch.Tensor:
        return _fusion_group(list(args[:n]), *args[n:])[0]
    return fusion_group1_fixed


def chunk_inputs(tensors: list[torch.Tensor], chunks: list[int]) -> list[torch.Tensor]:
    """A chunked call's group inputs (see fusion_group<m>_c<n>), each chunk as ``prim::ConstantChunk`` makes it:
    torch.chunk, and its error where the chunk a group takes is not among those made."""
    if not chunks:
        return list(tensors)
    made: dict = {}
    inputs = []
    for k in range(0, len(chunks), 4):
        j, i, n, dim = chunks[k:k + 4]
        if n == 1:
            inputs.append(tensors[j])
            continue
        if (j, n, dim) not in made:
            made[j, n, dim] = torch.chunk(tensors[j], n, dim)
        pieces = made[j, n, dim]
        if i >= len(pieces):
            raise RuntimeError(f"Expected chunk to return at least {n} outputs, but got only {len(pieces)}")
        inputs.append(pieces[i])
    return inputs


def _chunked(m: int, n: int):
    """The Python kernel of ``fuser::fusion_group<m>_c<n>``."""
    def fusion_group_chunked(*args):
        chunks, scalars, key, digest, ir = args[n:]
        outs = _fusion_group(chunk_inputs(list(args[:n]), chunks), scalars, key, digest, ir)
        return outs[0] if m == 1 else tuple(outs)
    return fusion_group_chunked


def _fusion_group_py(inputs: list[torch.Tensor], scalars: list[float], key: int, digest: str, ir: str,
                     offer: bool) -> list[torch.Tensor]:
    """What the native hot path (fuser/native) hands over: the group run here; with ``offer``, a plain call whose
    signature it has not seen, which is then prepared for it."""
    spec, args, out = _run_group(inputs, scalars, key, digest, ir)
    if offer:
        native.offer(key, digest, spec, args, inputs, scalars, out)
    return out


def _fusion_group_backward_py(key: int, digest: str, saved: list, scalars: list[float], meta: list[int],
                              grads: list) -> list:
    """The native hot path's recorded call, backward, for an output-gradient pattern it has no group for."""
    return native.python_backward(_spec_for(key, digest, ""), saved, scalars, meta, grads)


# CompositeImplicitAutograd: the function runs above autograd. When an input requires grad, autodiff wraps
# the group in an autograd Function with a generated backward, or the interpreter's eager ops record it.
_lib.impl("fusion_group", _fusion_group, "CompositeImplicitAutograd")
# vmap: without a kernel for the batched key functorch has no rule for the op; with one, the executor sees a
# transform in progress and the interpreter runs the group op by op, each op with its own batching rule
_lib.impl("fusion_group", _fusion_group, "FuncTorchBatched")
_lib.impl("fusion_group1", _fusion_group1, "CompositeImplicitAutograd")
_lib.impl("fusion_group1", _fusion_group1, "FuncTorchBatched")
for _n in range(1, graph_fuser.FIXED_INPUTS + 1):
    _lib.impl(f"fusion_group1_t{_n}", _fixed_inputs(_n), "CompositeImplicitAutograd")
    _lib.impl(f"fusion_group1_t{_n}", _fixed_inputs(_n), "FuncTorchBatched")
for _m in range(1, graph_fuser.CHUNK_OUTPUTS + 1):
    for _n in range(1, graph_fuser.FIXED_INPUTS + 1):
        for _key in ("CompositeImplicitAutograd", "FuncTorchBatched"):
            _lib.impl(graph_fuser.chunk_call(_m, _n).split("::")[1], _chunked(_m, _n), _key)
# the native hot path's hand-over (fuser/native/hotpath.cpp): its kernels for CPU and CUDA take precedence over the
# Python one above for those keys once the library is loaded
_lib.define("fusion_group_py(Tensor[] inputs, float[] scalars, int key, str digest, str ir, bool offer) -> Tensor[]")
_lib.impl("fusion_group_py", _fusion_group_py, "CompositeImplicitAutograd")
_lib.impl("fusion_group_py", lambda *a: _run_group(*a[:5])[2], "FuncTorchBatched")
_lib.define("fusion_group_backward_py(int key, str digest, Tensor?[] saved, float[] scalars, int[] meta, "
            "Tensor?[] grads) -> Tensor?[]")
_lib.impl("fusion_group_backward_py", _fusion_group_backward_py, "CompositeImplicitAutograd")


_lib.define("broadcasting_chunk(Tensor[] inputs, int chunks, int dim, int n) -> Tensor[]")


@functools.lru_cache(maxsize=1024)
def _chunk_sizes(shape: tuple, chunks: int, dim: int) -> tuple[int, ...]:
    """The sizes along ``dim`` of eager's ``chunk`` of a tensor of ``shape`` (its errors too): asked on a meta
    tensor once per shape, since that costs tens of us, on every call of an LSTM cell."""
    nd = len(shape)
    return tuple(p.shape[dim + nd if dim < 0 else dim] for p in torch.empty(shape, device="meta").chunk(chunks, dim))


def _broadcasting_chunk(inputs: list[torch.Tensor], chunks: int, dim: int, n: int) -> list[torch.Tensor]:
    """For chunk motion (graph_fuser.move_chunks): chunk ``k`` of every input as the chunked pointwise result
    would see it, input-major (input j's chunk k at j * n + k). An input broadcast along the chunked dim is
    passed whole; chunk sizes and errors come from chunking the broadcast shape, as eager's chunk would."""
    shape = autodiff.broadcast_shapes(*(t.shape for t in inputs))
    sizes = _chunk_sizes(tuple(shape), chunks, dim)
    if len(sizes) != n:
        raise RuntimeError(f"Expected {n} elements in a list but found {len(sizes)}")
    nd = len(shape)
    d = dim + nd if dim < 0 else dim
    out = []
    for t in inputs:
        td = d - (nd - t.dim())
        if td < 0 or (t.shape[td] == 1 and shape[d] != 1):
            out.extend([t] * n)
        else:
            out.extend(t.split(sizes, td))
    return out


_lib.impl("broadcasting_chunk", _broadcasting_chunk, "CompositeImplicitAutograd")
# the native hot path's hand-over for what its own broadcasting_chunk does not take (eager's errors)
_lib.define("broadcasting_chunk_py(Tensor[] inputs, int chunks, int dim, int n) -> Tensor[]")
_lib.impl("broadcasting_chunk_py", _broadcasting_chunk, "CompositeImplicitAutograd")


_lib.define("batch_norm_params(Tensor input, Tensor? weight, Tensor? bias, Tensor running_mean, "
            "Tensor running_var) -> Tensor[]")
_REDUCED = (torch.float16, torch.bfloat16)


def _batch_norm_params(input: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                       running_mean: torch.Tensor, running_var: torch.Tensor) -> list[torch.Tensor]:
    """For the inference batch_norm decomposition (prepare.decompose_batch_norm): the given per-channel vectors
    (weight, bias when present, mean, var) shaped to broadcast along dim 1 of ``input``, in the dtype eager's
    kernel computes them in (float32 for float16/bfloat16 vectors). Arguments eager would reject go through
    eager's batch_norm, which raises its error."""
    vecs = [t for t in (weight, bias, running_mean, running_var) if t is not None]
    shape = input.shape
    nd = len(shape)
    dtype = vecs[0].dtype
    if nd >= 2 and input.numel() and all(t.shape == (shape[1],) and t.dtype == dtype for t in vecs) and all(
            t.device == input.device for t in vecs) and (dtype == input.dtype or (dtype == torch.float32 and
                                                                                 input.dtype in _REDUCED)):
        if dtype in _REDUCED:
            vecs = [t.float() for t in vecs]
        # called once per batch norm per forward: as_strided is the cheapest view (a third of view's host
        # time), and eager's autograd records a view where a gradient is wanted
        grad = torch.is_grad_enabled()
        out_shape = (shape[1],) + (1,) * (nd - 2)
        strides = (1,) * (nd - 1)
        return [t.view(out_shape) if grad and t.requires_grad else t.as_strided(out_shape, (t.stride(0),) + strides[1:])
                for t in vecs]
    torch.batch_norm(input, weight, bias, running_mean, running_var, False, 0.0, 1e-5, False)
    if not input.numel():  # eager returns early without checking sizes; any broadcastable vector will do
        return [t.reshape(-1)[:1].reshape((1,) * nd) for t in vecs]
    # eager accepted what the fast path did not (a vector of another shape with the right number of elements)
    out_shape = (shape[1],) + (1,) * (nd - 2)
    return [(t.float() if t.dtype in _REDUCED else t).reshape(out_shape) for t in vecs]


_lib.impl("batch_norm_params", _batch_norm_params, "CompositeImplicitAutograd")
_lib.define("batch_norm_params_py(Tensor input, Tensor? weight, Tensor? bias, Tensor running_mean, "
            "Tensor running_var) -> Tensor[]")
_lib.impl("batch_norm_params_py", _batch_norm_params, "CompositeImplicitAutograd")


def register_graph(graph: torch._C.Graph) -> int:
    """The key of ``graph`` as one fusion group: lowered to the group IR (``ts_ir.lower``) and registered."""
    return STORE.register(ts_ir.lower(graph))
