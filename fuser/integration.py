"""TorchScript integration: applying the pass to scripted and traced code, and ``install()``'s hooks on
``torch.jit.script`` / ``torch.jit.trace`` (the operators the fused graphs call are in ``torch_ops.py``).

There is no Python binding to register a pass with TorchScript's executor, so the pass runs on a function's
graph before its first call: functions get a fresh ``ScriptFunction`` built from the fused graph (an
executed function ignores later edits of its graph), modules get their methods' graphs edited in place.
"""
from __future__ import annotations

import threading
import warnings
import weakref
from typing import Optional

import torch

from . import graph_fuser, prepare, settings, ts_ir
from .errors import PassError
from .kernel_cache import STORE
from .torch_ops import register_graph, run_key  # noqa: F401 (run_key: the API's; the operators defined on import)


def register(node: torch._C.Node) -> int:
    if node.kind() != "prim::FusionGroup":
        raise ValueError(f"register_fusion expects a prim::FusionGroup node, got {node.kind()}")
    return register_graph(node.g("Subgraph"))


def _register_for_lowering(node: torch._C.Node) -> tuple[int, str, str]:
    spec = STORE.get(register(node))
    # the call carries the group's TorchScript text, from which another process rebuilds it (torch.jit.load)
    return spec.key, spec.digest, ts_ir.raise_group(spec.group).str(False)


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
        return None if spec is None else ts_ir.raise_group(spec.group)

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
            if fn is self.saved[1] and isinstance(result, torch.jit.ScriptModule) and kwargs.get(
                    "check_trace", args[3] if len(args) > 3 else True):
                # the trace's check ran the module, and a method that ran keeps running the graph its executor
                # compiled then (an edit of its graph does not reach it): trace again, unchecked, and fuse that one.
                # The module's buffers (a batch norm's running statistics) are put back as the first trace left them
                module = args[0] if args else kwargs.get("func")
                buffers = [(b, b.detach().clone()) for b in module.buffers()] if isinstance(
                    module, torch.nn.Module) else []
                if len(args) > 3:
                    args = (*args[:3], False, *args[4:])
                else:
                    kwargs = {**kwargs, "check_trace": False}
                result = fn(*args, **kwargs)
                with torch.no_grad():
                    for b, kept in buffers:
                        b.copy_(kept)
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
