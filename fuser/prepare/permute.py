"""Permutes moved ahead of the pointwise ops that make their input, so those ops fuse with what reads the result.

ConvNeXt's block ends in ``residual + (gamma * x).permute(0, 3, 1, 2)`` (Hugging Face's and timm's alike): the
permute stands between the layer scale and the residual add, and the pass groups only ops that feed each other
directly, so each op ran as an eager kernel of its own. An element-by-element op commutes with moving elements:

    permute(op(a, b), dims)  ==  op(permute(a', dims), permute(b', dims))

where ``a'`` and ``b'`` are the operands broadcast to the op's result shape (``broadcast_tensors``: views with stride
0 along broadcast dims, no copy; skipped where one operand alone decides the shape). The rewrite adds views only,
moves no data and computes the same values. Then ``residual + gamma' * x'`` is one group, reading ``x`` through the
permuted view (a layout the kernels take: fuser/layout.py, the tiled path); its output layout is eager's for those
inputs (a permuted dense operand's layout, as the permute gave).

It moves a permute through a tree of ops, each one the pass fuses element by element (not a reduction, a ``cat``,
or a random op, whose numbers follow the element order), each used only inside the tree (else it would run twice),
and applies only where

* the tree's leaves are made by ops the pass does not fuse (a matmul, a convolution, a parameter): a permute that
  would land between two fusable ops would split a group rather than join one;
* something the pass fuses reads the permute's result (else the move gains nothing and costs views);
* ``dims`` is a constant and no op with side effects stands among the tree's nodes (the moved ops run where the
  tree's last op stood, which must read the same values);
* every leaf that needs broadcasting has a rank the graph shows (a traced graph's types), or is a module's parameter
  or buffer (``prim::GetAttr``, untyped even in traced graphs): broadcast_tensors would expand a 0-dim CPU tensor,
  which eager takes as a scalar beside CUDA tensors, into one it refuses. 0-dim leaves stay as they are.
  (A 0-dim CPU tensor kept as a plain attribute of a module moved to CUDA is the case this does not cover.)

Returns the permutes moved.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import graph_fuser
from .common import all_nodes, create

_PERMUTE = "aten::permute(Tensor(a) self, int[] dims) -> Tensor(a)"


def move_permutes(graph: torch._C.Graph) -> int:
    done = 0
    for node in list(all_nodes(graph.block())):
        if node.kind() != "aten::permute" or node.schema() != _PERMUTE:
            continue
        dims = _int_list(node.inputsAt(1))
        if dims is None:
            continue
        tree = _tree(node)
        if tree is None:
            continue
        _move(graph, node, dims, *tree)
        done += 1
    return done


def _int_list(v: torch._C.Value) -> Optional[list]:
    n = v.node()
    if n.kind() == "prim::Constant":
        val = v.toIValue()
        return list(val) if isinstance(val, (list, tuple)) and all(isinstance(d, int) for d in val) else None
    if n.kind() == "prim::ListConstruct":
        items = [_int_list_item(i) for i in n.inputs()]
        return None if any(i is None for i in items) else items
    return None


def _int_list_item(v: torch._C.Value) -> Optional[int]:
    if v.node().kind() != "prim::Constant":
        return None
    val = v.toIValue()
    return val if isinstance(val, int) and not isinstance(val, bool) else None


def _elementwise(node: torch._C.Node) -> Optional[tuple]:
    """The inputs that decide ``node``'s shape, if it is an op the pass fuses element by element; else None."""
    op = graph_fuser.fusable_op(node)
    if op is None or op.reduction is not None or op.concat or op.random:
        return None
    tensors = [i for i, v in enumerate(node.inputs()) if isinstance(v.type(), torch._C.TensorType)]
    shape = [i for i in tensors if op.shape_args is None or i in op.shape_args]
    return tuple(shape) if shape else None


def _tree(permute: torch._C.Node) -> Optional[tuple]:
    """(nodes in graph order, leaf values) of the op tree under ``permute`` that may move, or None."""
    root = permute.inputsAt(0).node()
    block = permute.owningBlock()
    if root.owningBlock() != block or len(permute.inputsAt(0).uses()) != 1 or _elementwise(root) is None:
        return None
    if not any(u.user.owningBlock() == block and graph_fuser.fusable_op(u.user) is not None
               for u in permute.output().uses()):
        return None
    members, leaves, todo = {_id(root): root}, {}, [root]
    while todo:
        n = todo.pop()
        for i in _elementwise(n):
            v = n.inputsAt(i)
            p = v.node()
            if p.owningBlock() == block and _elementwise(p) is not None and len(v.uses()) == 1:
                if _id(p) not in members:
                    members[_id(p)] = p
                    todo.append(p)
            elif v.type().dim() == 0:
                # a 0-dim tensor (a traced Python number, a constant) broadcasts from any position, and stays as
                # it is: a 0-dim CPU tensor is a scalar beside CUDA tensors, a broadcast view of it would not be
                continue
            elif graph_fuser.fusable_op(p) is not None:
                return None  # the permute would split a fusable region
            else:
                leaves.setdefault(v.unique(), v)
    if len(leaves) > 1 and any(v.type().dim() is None and v.node().kind() != "prim::GetAttr"
                               for v in leaves.values()):
        # a leaf of unknown rank could be a 0-dim CPU tensor beside CUDA ones, which broadcast_tensors would expand;
        # a module's parameter or buffer (a traced graph does not type them) moves with the module
        return None
    nodes = list(block.nodes())
    at = [k for k, n in enumerate(nodes) if n.outputsSize() == 1 and _id(n) in members]
    order = [nodes[k] for k in at]
    # no side effect among the members: they will all run where the root stands
    if any(graph_fuser._has_side_effects(n) for n in nodes[at[0]:at[-1]]):
        return None
    return (order, list(leaves.values())) if leaves else None


def _id(node: torch._C.Node) -> int:
    return node.output().unique()  # members have one output; Python's wrappers of one node are not one object


def _move(graph: torch._C.Graph, permute: torch._C.Node, dims: list, members: list, leaves: list) -> None:
    root = members[-1]
    dims_v = graph.insertConstant(dims)
    dims_v.node().moveBefore(root)
    known = [v.type().dim() if isinstance(v.type(), torch._C.TensorType) else None for v in leaves]
    if len(leaves) > 1 and any(r != len(dims) for r in known):
        # broadcast every leaf to the result's shape first: views, so that each takes the same permute
        lst = create(graph, "prim::ListConstruct", leaves, root)
        lst.output().setType(torch._C.ListType.ofTensors())
        bcast = create(graph, "aten::broadcast_tensors", [lst.output()], root)
        bcast.output().setType(torch._C.ListType.ofTensors())
        views = list(create(graph, "prim::ListUnpack", [bcast.output()], root, len(leaves)).outputs())
    else:
        views = list(leaves)
    env = {}
    for leaf, view in zip(leaves, views):
        moved = create(graph, "aten::permute", [view, dims_v], root)
        moved.copyMetadata(permute)
        moved.output().setType(_of_rank(leaf, len(dims)))  # a later move through this view reads its rank
        env[leaf.unique()] = moved.output()
    for n in members:
        clone = graph.createClone(n, lambda v: env.get(v.unique(), v))
        clone.insertBefore(root)
        clone.output().setType(_with_dtype_of(n.output()))
        env[n.output().unique()] = clone.output()
    new_root = env[root.output().unique()]
    new_root.setType(permute.output().type())
    permute.output().replaceAllUsesWith(new_root)
    dims_list = permute.inputsAt(1).node()
    permute.destroy()
    if dims_list.kind() == "prim::ListConstruct" and not dims_list.output().uses():
        dims_list.destroy()
    for n in reversed(members):
        n.destroy()


def _of_rank(v: torch._C.Value, rank: int):
    """A tensor type of ``v``'s dtype (where known) and of ``rank`` dims of unknown sizes."""
    return _with_dtype_of(v).with_sizes([None] * rank)


def _with_dtype_of(v: torch._C.Value):
    t = v.type()
    dtype = t.dtype() if isinstance(t, torch._C.TensorType) else None
    return torch._C.TensorType.get().with_dtype(dtype) if dtype is not None else torch._C.TensorType.get()
