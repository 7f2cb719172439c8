"""In-place ops -> functional ops where that cannot change a result."""
from __future__ import annotations

from typing import Optional

import torch

from .common import all_nodes, constant

# in-place activations whose functional form gives the in-place result's dtype for every input dtype (or both
# raise), so they need no dtype proof; tests/test_prepare.py checks each against eager in every dtype.
# (sigmoid, tanh and clamp with float bounds are not here: on integers the functional op returns float where
# the in-place op raises.) TODO(ops table): a flag of ops.OpDef once these ops are all in the table.
SAME_DTYPE_ACTIVATIONS = frozenset((
    "relu", "relu6", "hardtanh", "hardswish", "hardsigmoid", "leaky_relu", "elu", "selu", "celu", "silu",
    "mish", "gelu", "threshold"))

_FLOATING = frozenset(("Float", "Double", "Half", "BFloat16"))


def _inplace_name(kind: str) -> Optional[str]:
    """``add`` for ``aten::add_``; None for other kinds (``aten::__and__`` is not in place)."""
    if not kind.startswith("aten::"):
        return None
    name = kind[6:]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else None


def remove_mutation(graph: torch._C.Graph) -> int:
    """In-place ops -> functional ops where that cannot change a result. Returns the ops made functional.

    TorchScript's ``RemoveMutation`` (``torch._C._jit_pass_remove_mutation``) makes an op functional when its
    mutated value is fresh and unaliased, so no one can see the mutation. It does not check types: ``x.add_(y)``
    keeps ``x``'s dtype and shape and raises if the result cannot be cast or broadcast to them, ``x + y`` does
    neither. So each op it converted is kept only when

    * it is an activation that keeps every dtype (:data:`SAME_DTYPE_ACTIVATIONS`), or
    * the graph's types (a traced graph records them) show a floating ``self``, no complex operand, and operand
      shapes that broadcast to ``self``'s; then the functional result is cast back with ``type_as(r, self)``,
      which is the in-place op's rounding (compute in the promoted dtype, store in ``self``'s);

    the others are turned back into the in-place op. (``_jit_pass_remove_inplace_ops`` is not used: it rewrites
    without alias analysis, so a later use of the mutated tensor would read the unmutated value.)
    """
    inplace = {n.kind() for n in all_nodes(graph.block()) if _inplace_name(n.kind())}
    if not inplace:
        return 0
    first_new = 1 + max([v.unique() for n in all_nodes(graph.block()) for v in n.outputs()]
                        + [v.unique() for v in graph.inputs()])
    torch._C._jit_pass_remove_mutation(graph)
    kept = 0
    for node in list(all_nodes(graph.block())):
        if (node.outputsSize() != 1 or node.output().unique() < first_new or node.kind() + "_" not in inplace):
            continue  # not a functional op made from an in-place one (TorchScript's fill_/zero_ forms stay)
        name = node.kind()[6:]
        tensors = [v for v in node.inputs() if isinstance(v.type(), torch._C.TensorType)]
        if name in SAME_DTYPE_ACTIVATIONS and len(tensors) == 1:
            kept += 1
        elif _inplace_result_provably_equal(node, tensors):
            if len(tensors) > 1:
                _cast_like_self(graph, node)
            kept += 1
        else:
            _restore_inplace(graph, node)
    return kept


def _inplace_result_provably_equal(node: torch._C.Node, tensors: list) -> bool:
    self_t = node.inputsAt(0).type()
    if not isinstance(self_t, torch._C.TensorType) or self_t.scalarType() not in _FLOATING:
        return False
    shapes = []
    for v in tensors:
        t = v.type()
        sizes = t.sizes() if t.scalarType() is not None else None
        if sizes is None or "Complex" in t.scalarType():
            return False
        shapes.append(sizes)
    for v in node.inputs():
        if v.type().kind() == "ComplexType" or isinstance(constant(v)[1], complex):
            return False
    try:
        return list(torch.broadcast_shapes(*shapes)) == list(shapes[0])
    except RuntimeError:
        return False


def _cast_like_self(graph: torch._C.Graph, node: torch._C.Node) -> None:
    out = node.output()
    cast = graph.create("aten::type_as", [out, node.inputsAt(0)], 1)
    cast.insertAfter(node)
    cast.copyMetadata(node)
    cast.output().setType(out.type())
    out.replaceAllUsesWith(cast.output())
    cast.replaceInput(0, out)


def _restore_inplace(graph: torch._C.Graph, node: torch._C.Node) -> None:
    # RemoveMutation pointed the later uses of the mutated value at this node's output; the in-place op's
    # output is that value itself, so pointing them at it restores the original program
    back = graph.create(node.kind() + "_", list(node.inputs()), 1)
    back.insertBefore(node)
    back.copyMetadata(node)
    back.output().setType(node.output().type())
    node.output().replaceAllUsesWith(back.output())
    node.destroy()
