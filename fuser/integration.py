"""TorchScript integration: the ``fuser::fusion_group`` operator, applying the pass to scripted code, and
``install()``'s hooks on ``torch.jit.script`` / ``torch.jit.trace``.

There is no Python binding to register a pass with TorchScript's executor, so the pass runs on a function's
graph before its first call: functions get a fresh ``ScriptFunction`` built from the fused graph (an
executed function ignores later edits of its graph), modules get their methods' graphs edited in place.
"""
from __future__ import annotations

import functools
import threading
import warnings
import weakref
from typing import Callable, Optional

import torch

from . import autodiff, executor, graph_fuser, prepare, settings
from .errors import PassError
from .kernel_cache import STORE

_SPECS = STORE._specs  # key -> spec; read without a lock on the hot path (a plain dict read under the GIL)
_lib = torch.library.Library("fuser", "DEF")
# key: this process's spec key (the fast path); digest and ir: the group's identity and its graph, so that a
# module saved with torch.jit.save and loaded in another process finds (or rebuilds) the same group
_lib.define("fusion_group(Tensor[] inputs, float[] scalars, int key, str digest, str ir) -> Tensor[]")


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
        spec = STORE.get(STORE.register(torch.parse_ir(ir, parse_tensor_constants=True)))
        if spec.digest != digest:
            raise RuntimeError("this fused TorchScript code was saved by another process and its fusion group "
                               "cannot be rebuilt exactly from the saved text (a tensor constant printed with "
                               "rounding?). Load the unfused module and apply fuser.fuse() again.")
    return spec


def _fusion_group(inputs: list[torch.Tensor], scalars: list[float], key: int, digest: str,
                  ir: str) -> list[torch.Tensor]:
    spec = _spec_for(key, digest, ir)
    if spec.all_tensors:
        args = inputs
    else:
        tensors, floats = iter(inputs), iter(scalars)
        args = [next(tensors) if is_t else next(floats) for is_t in spec.input_is_tensor]
    return autodiff.run(spec, args)


# CompositeImplicitAutograd: the function runs above autograd. When an input requires grad, autodiff wraps
# the group in an autograd Function with a generated backward, or the interpreter's eager ops record it.
_lib.impl("fusion_group", _fusion_group, "CompositeImplicitAutograd")
# vmap: without a kernel for the batched key functorch has no rule for the op; with one, the executor sees a
# transform in progress and the interpreter runs the group op by op, each op with its own batching rule
_lib.impl("fusion_group", _fusion_group, "FuncTorchBatched")


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


def register(node: torch._C.Node) -> int:
    if node.kind() != "prim::FusionGroup":
        raise ValueError(f"register_fusion expects a prim::FusionGroup node, got {node.kind()}")
    return STORE.register(node.g("Subgraph"))


def _register_for_lowering(node: torch._C.Node) -> tuple[int, str, str]:
    spec = STORE.get(register(node))
    return spec.key, spec.digest, spec.ir


def run_pass(graph: torch._C.Graph) -> int:
    """Every stage of the pass on ``graph``, in place, each result checked by TorchScript's lint.

    Returns the groups made; raises :class:`PassError` naming the stage that failed or left an invalid graph.
    """
    # constant propagation after inlining folds the ``if inplace:`` of functional activations (F.hardswish,
    # F.relu, F.leaky_relu... scripted), which would otherwise hide the op in a branch
    stages = (("inline", torch._C._jit_pass_inline), ("constants", torch._C._jit_pass_constant_propagation),
              ("prepare", prepare.prepare_graph),
              ("fuse", graph_fuser.fuse_graph),
              ("lower", lambda g: graph_fuser.lower_fusion_groups(g, _register_for_lowering)))
    made = 0
    for name, stage in stages:
        try:
            result = stage(graph)
            torch._C._jit_pass_lint(graph)
        except Exception as e:
            raise PassError(name, e) from e
        if name == "fuse":
            made = result
    return made


_warned = False


def fuse_graph_in_place(graph: torch._C.Graph) -> int:
    """Inline calls, prepare, group fusable ops, lower groups to ``fuser::fusion_group``. Returns groups made.

    The pass works on a copy, which replaces ``graph``'s nodes only when every stage succeeded and the result
    passed lint. Otherwise ``graph`` stays as it was (it runs unfused, as eager would) and the first such
    failure in this process is reported by a warning; with ``settings.strict_pass`` (the tests) it raises.
    """
    global _warned
    work = graph.copy()
    try:
        made = run_pass(work)
        _install_graph(graph, work)
    except PassError as e:
        if settings.strict_pass:
            raise
        if not _warned:
            _warned = True
            warnings.warn(f"{e} This graph runs unfused (as eager would); later failures are not reported. "
                          "Please report this with the model.", RuntimeWarning, stacklevel=2)
        return 0
    return made


def _install_graph(graph: torch._C.Graph, fused: torch._C.Graph) -> None:
    original = graph.copy()
    try:
        replace_graph(graph, fused)
        torch._C._jit_pass_lint(graph)
    except Exception as e:
        replace_graph(graph, original)
        raise PassError("install", e) from e


def replace_graph(dst: torch._C.Graph, src: torch._C.Graph) -> None:
    """Make ``dst``'s nodes and outputs copies of ``src``'s, in place (a module's method keeps its graph
    object). Precondition: the inputs correspond one to one, as for a copy of ``dst`` that the pass edited."""
    if len(list(dst.inputs())) != len(list(src.inputs())):
        raise ValueError("replace_graph: the graphs' inputs differ")
    for i in reversed(range(len(list(dst.outputs())))):
        dst.eraseOutput(i)
    for n in reversed(list(dst.nodes())):
        n.destroy()
    env = {s.unique(): d for s, d in zip(src.inputs(), dst.inputs())}
    for n in src.nodes():
        c = dst.createClone(n, lambda v: env[v.unique()])
        dst.appendNode(c)
        for a, b in zip(n.outputs(), c.outputs()):
            env[a.unique()] = b
    for v in src.outputs():
        dst.registerOutput(env[v.unique()])


_fused = weakref.WeakSet()  # objects that already went through the pass


def fuse(scripted):
    if isinstance(scripted, torch.jit.ScriptFunction):
        if scripted in _fused:
            return scripted
        graph = scripted.graph.copy()
        fuse_graph_in_place(graph)
        fn = torch._C._create_function_from_graph(scripted.name, graph)
        _fused.add(fn)
        return fn
    if isinstance(scripted, torch.jit.ScriptModule):
        if scripted in _fused:
            return scripted
        for mod in scripted.modules():  # itself first, then its submodules
            if not isinstance(mod, torch.jit.ScriptModule):
                continue
            for name in mod._c._method_names():
                fuse_graph_in_place(mod._c._get_method(name).graph)
        _fused.add(scripted)
        return scripted
    raise TypeError(f"fuse expects a torch.jit.ScriptFunction or ScriptModule (from torch.jit.script or "
                    f"torch.jit.trace), got {type(scripted).__name__}")


def graph_for(scripted, *inputs) -> torch._C.Graph:
    # the profiling executor optimizes after its profiled runs: run past them to see the graph that stays
    for _ in range(torch._C._jit_get_num_profiled_runs() + 1):
        scripted(*inputs)
    graph = torch.jit.last_executed_optimized_graph().copy()

    def subgraph(key: int) -> Optional[torch._C.Graph]:
        spec = STORE.get(key)
        return None if spec is None else spec.graph

    graph_fuser.raise_fusion_calls(graph, subgraph)
    return graph


class _Installer:
    def __init__(self):
        self.lock = threading.Lock()
        self.local = threading.local()
        self.saved: Optional[tuple] = None

    def install(self) -> None:
        with self.lock:
            if self.saved is not None:
                return
            script, trace = torch.jit.script, torch.jit.trace
            self.saved = (script, trace, (torch._C._jit_can_fuse_on_cpu(), torch._C._jit_can_fuse_on_gpu()))
            # NNC must not take the pointwise ops first. Its device switches are these (shared with the legacy
            # C++ fuser); _jit_set_texpr_fuser_enabled(False) would also keep it off, but then the profiling
            # executor never leaves its profiling plan and every call pays for prim::profile nodes.
            torch._C._jit_override_can_fuse_on_cpu(False)
            torch._C._jit_override_can_fuse_on_gpu(False)

            def fused_script(obj, *args, **kwargs):
                return self._outermost(script, obj, *args, **kwargs)

            def fused_trace(*args, **kwargs):
                return self._outermost(trace, *args, **kwargs)

            fused_script.__wrapped__, fused_trace.__wrapped__ = script, trace
            fused_script.__doc__, fused_trace.__doc__ = script.__doc__, trace.__doc__
            torch.jit.script, torch.jit.trace = fused_script, fused_trace

    def uninstall(self) -> None:
        with self.lock:
            if self.saved is None:
                return
            script, trace, (cpu, gpu) = self.saved
            torch.jit.script, torch.jit.trace = script, trace
            torch._C._jit_override_can_fuse_on_cpu(cpu)
            torch._C._jit_override_can_fuse_on_gpu(gpu)
            self.saved = None

    def _outermost(self, fn, *args, **kwargs):
        # torch.jit.trace checks its result by tracing again through the module attribute, and scripting can
        # script helpers: only the outermost call's result is fused, so inner results stay stock
        if getattr(self.local, "depth", 0):
            return fn(*args, **kwargs)
        self.local.depth = 1
        try:
            result = fn(*args, **kwargs)
        finally:
            self.local.depth = 0
        return _maybe_fuse(result)

    @property
    def installed(self) -> bool:
        return self.saved is not None


def _maybe_fuse(obj):
    if isinstance(obj, (torch.jit.ScriptFunction, torch.jit.ScriptModule)):
        return fuse(obj)
    return obj


INSTALLER = _Installer()
