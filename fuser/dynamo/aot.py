"""The Dynamo backend: ``torch.compile(model, backend="fuser")``.

Dynamo hands over a torch-level FX graph; AOTAutograd (``aot_autograd``) turns it into ATen graphs: an inference
graph, or a forward and (at the first ``.backward()``) a backward graph. Each ATen graph is partitioned
(:mod:`.partition`), each region lowered to the group IR and registered (:mod:`.lower`), and the graph runs with
one call per group; everything else stays ATen, run by the graph as eager would run it.

Decompositions: core ATen's table, less every op that fuser's table fuses whole (``silu``, ``addcmul``, ...:
core ATen would split them) and attention (left to ATen's kernels). It splits the ``*_backward`` ops (GELU's,
layer norm's, dropout's) into pointwise ATen ops that the groups take. Inference batch norm is split too, into
pointwise ops that fuse with the activation after it.

A graph's kernels build when it is compiled, side by side (:mod:`.prebuild`); a training step's backward kernels
start when AOTAutograd partitions the joint graph, beside the forward's.

Nothing raised while compiling reaches the user: the graph then runs unfused, with one warning per process.
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import Callable, Optional

import torch

from .. import ops, settings
from . import broadcasts, norms, prebuild
from .lower import rewrite
from .partition import Partition, partition
from .support import Support

# called with (kind, graph module, Partition, specs) for every ATen graph compiled; fuser.explain listens here
listeners: list[Callable] = []
_warned = False
_n_graphs = 0  # Dynamo graphs compiled by this process: labels for fuser.explain and PYTORCH_FUSION_DEBUG=explain


def _warn_once(kind: str, e: BaseException) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"fuser: compiling a {kind} graph failed ({type(e).__name__}: {e}); it runs unfused "
                      "(later failures are not reported)", RuntimeWarning, stacklevel=3)


@functools.lru_cache(maxsize=None)
def decompositions() -> dict:
    """Core ATen's decompositions less those of ops fuser fuses whole, and of attention; plus inference batch
    norm's."""
    from torch._decomp import core_aten_decompositions
    table = dict(core_aten_decompositions().items())  # a plain dict: the same on every torch version
    keep_whole = [op for op in list(table.keys()) if isinstance(op, torch._ops.OpOverload) and (
        ops.of(op.name()) is not None or "scaled_dot_product" in op.name())]
    for op in keep_whole:
        del table[op]
    # inference batch norm (a model in eval mode) into its pointwise ops, as the TorchScript door's prepare/
    # does: they fuse with what follows (a ReLU)
    from torch._decomp import decomposition_table
    aten = torch.ops.aten
    table[aten._native_batch_norm_legit_no_training.default] = decomposition_table[
        aten._native_batch_norm_legit_no_training.default]  # calls _native_batch_norm_legit(training=False)
    legit = decomposition_table[aten._native_batch_norm_legit.default]

    def batch_norm_inference_only(input, weight, bias, running_mean, running_var, training, momentum, eps):
        if training:
            return NotImplemented  # training batch norm stays one ATen op
        return legit(input, weight, bias, running_mean, running_var, training, momentum, eps)

    table[aten._native_batch_norm_legit.default] = batch_norm_inference_only
    return table


def _boxed(fn: Callable) -> Callable:
    from functorch.compile import make_boxed_func
    return make_boxed_func(fn)


_TRANSPARENT = (torch.ops.aten.alias.default, torch.ops.aten.detach.default)


def drop_aliases(gm: torch.fx.GraphModule) -> None:
    """Replace ``alias``/``detach`` results by their input where only other nodes read them (not the graph's
    outputs, whose aliasing AOTAutograd tracks): in a functional graph they are the same values, and the
    rematerializing partitioner puts them between the ops a backward group would join."""
    changed = False
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in _TRANSPARENT and n.args and isinstance(n.args[0], torch.fx.Node) \
                and all(u.op != "output" for u in n.users):
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)
            changed = True
    if changed:
        gm.recompile()


def fuse_graph(gm: torch.fx.GraphModule, kind: str = "inference") -> tuple[torch.fx.GraphModule, Partition, list]:
    """``gm`` (an ATen graph) with its regions as group calls, the partition, and the groups' specs."""
    drop_aliases(gm)
    if norms.rewrite(gm.graph) + broadcasts.sink(gm.graph):
        gm.recompile()
    part = partition(gm.graph, Support())
    new_gm, specs = rewrite(gm, part.regions) if part.regions else (gm, [])
    return new_gm, part, specs


def compiler(kind: str, label: str = "") -> Callable:
    """An AOTAutograd compiler for ``kind`` graphs ("forward", "backward", "inference") of the Dynamo graph
    ``label``."""

    def compile_graph(gm: torch.fx.GraphModule, example_inputs) -> Callable:
        try:
            new_gm, part, specs = fuse_graph(gm, kind)
            name = f"{label} {kind}".strip()
            for listen in list(listeners):
                listen(name, new_gm, part, specs)
            if os.environ.get("PYTORCH_FUSION_DEBUG", "") == "explain":
                from .report import Explanation, graph_records
                print(Explanation(graph_records(name, part, specs)), flush=True)
            prebuild.start(new_gm)
            return _boxed(new_gm.forward)
        except Exception as e:  # never BackendCompilerFailed: the graph runs as AOTAutograd traced it
            if settings.strict_pass:
                raise
            _warn_once(kind, e)
            return _boxed(gm.forward)

    compile_graph.__name__ = f"fuser_{kind}_compiler"
    return compile_graph


def partition_joint(joint_module: torch.fx.GraphModule, joint_inputs, **kwargs):
    """AOTAutograd's partition function: Inductor's min-cut rematerializing partitioner (the backward recomputes
    pointwise values from fewer saved tensors rather than the forward writing every intermediate it needs: a fused
    group recomputes them for free), after training layer norms are split into their steps
    (``norms.split_training_layer_norms``), so that their normalized rows are recomputed too. The backward graph's
    kernels start building here (``prebuild.start_backward``), beside the forward's."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    if norms.split_training_layer_norms(joint_module.graph):
        joint_module.recompile()
    graphs = min_cut_rematerialization_partition(joint_module, joint_inputs, **kwargs)  # (forward, backward)
    prebuild.start_backward(graphs[1], fuse_graph)
    return graphs


def backend(gm: torch.fx.GraphModule, example_inputs: list, **kwargs) -> Callable:
    """The ``fuser`` Dynamo backend (``torch.compile(fn, backend="fuser")``); ``mode``/``options`` are ignored."""
    global _n_graphs
    _n_graphs += 1
    label = f"graph {_n_graphs}"
    try:
        from torch._dynamo.backends.common import aot_autograd
        return aot_autograd(fw_compiler=compiler("forward", label), bw_compiler=compiler("backward", label),
                            inference_compiler=compiler("inference", label), decompositions=decompositions(),
                            partition_fn=partition_joint,
                            keep_inference_input_mutations=True)(gm, example_inputs)
    except Exception as e:
        if settings.strict_pass:
            raise
        _warn_once("Dynamo", e)
        return gm.forward


def register(name: str = "fuser") -> Optional[Callable]:
    """Register :func:`backend` under ``name`` unless that name is taken (by this backend through its entry
    point, or by another): registering twice is an error in Dynamo."""
    from torch._dynamo.backends import registry
    registry._lazy_import()  # discovers the entry points: ours may already be there
    if name in registry._BACKENDS or name in registry._COMPILER_FNS:
        return None
    return registry.register_backend(compiler_fn=backend, name=name)
