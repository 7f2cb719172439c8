"""Inference batch norm -> pointwise ops over the running statistics, in eager's CPU formula."""
from __future__ import annotations

import torch

from .. import graph_fuser
from .common import all_nodes, constant, create

BATCH_NORM_SCHEMA = ("aten::batch_norm(Tensor input, Tensor? weight, Tensor? bias, Tensor? running_mean, "
                     "Tensor? running_var, bool training, float momentum, float eps, bool cudnn_enabled) -> Tensor")


def decompose_batch_norm(graph: torch._C.Graph) -> int:
    """Inference ``batch_norm`` -> pointwise ops. Returns the nodes decomposed.

    Eager's CPU kernel computes, per channel, ``alpha = invstd * weight`` with ``invstd = 1 / sqrt(var + eps)``
    and ``beta = bias - mean * alpha``, then ``x * alpha + beta`` in the parameters' compute dtype (float32 for
    float16/bfloat16), stored in ``x``'s dtype. The decomposition is that formula, op for op, over the
    statistics shaped to broadcast along dim 1 by ``fuser::batch_norm_params`` (which also checks the arguments
    as eager does), ending in ``type_as(y, x)``; in a group the per-channel terms are recomputed per element,
    which costs arithmetic but no memory traffic. It applies only when ``training`` is a constant False and
    the running statistics are tensors (not None): training-mode batch norm reduces over the batch. A batch
    norm with no fusable op beside it (conv -> batch norm -> conv) stays eager's one kernel.
    """
    done = 0
    for node in list(all_nodes(graph.block())):
        if node.kind() != "aten::batch_norm" or node.schema() != BATCH_NORM_SCHEMA:
            continue
        x, weight, bias, mean, var, training, _momentum, eps, _cudnn = list(node.inputs())
        if constant(training) != (True, False):
            continue
        if not all(isinstance(v.type(), torch._C.TensorType) for v in (mean, var)):
            continue
        if not all(isinstance(v.type(), torch._C.TensorType) or constant(v) == (True, None)
                   for v in (weight, bias)):
            continue  # an Optional[Tensor] decided at run time
        if not (constant(eps)[0] or eps.type().kind() == "FloatType"):
            continue
        if not _fusable_neighbour(node):
            continue  # a group of it alone would replace eager's one kernel with one of ours: no memory saved
        _decompose_batch_norm(graph, node)
        done += 1
    return done


def _fusable_neighbour(node: torch._C.Node) -> bool:
    """Whether the op producing ``node``'s input, or one using its output, is one the pass may group with it."""
    return graph_fuser.fusable_op(node.inputsAt(0).node()) is not None or any(
        graph_fuser.fusable_op(u.user) is not None for u in node.output().uses())


def _decompose_batch_norm(graph: torch._C.Graph, node: torch._C.Node) -> None:
    x, weight, bias, mean, var, _training, _momentum, eps, _cudnn = list(node.inputs())
    has_w = isinstance(weight.type(), torch._C.TensorType)
    has_b = isinstance(bias.type(), torch._C.TensorType)
    n_params = 2 + has_w + has_b
    params = create(graph, "fuser::batch_norm_params", [x, weight, bias, mean, var], node)
    params.output().setType(torch._C.ListType.ofTensors())
    unpack = create(graph, "prim::ListUnpack", [params.output()], node, n_params)
    vecs = list(unpack.outputs())
    w = vecs.pop(0) if has_w else None
    b = vecs.pop(0) if has_b else None
    m, v = vecs

    def op(kind, *args):  # eager's batch norm kernel computes all of it in float, rounding once at the end
        return create(graph, kind, list(args), node, origin="aten::batch_norm").output()

    invstd = op("aten::rsqrt", op("aten::add", v, eps, 1))
    alpha = op("aten::mul", invstd, w) if has_w else invstd
    mean_alpha = op("aten::mul", m, alpha)
    # eager's bias is 0 when absent: 0 - m * alpha (rsub), not -(m * alpha), for the sign of a zero result
    beta = op("aten::sub", b, mean_alpha, 1) if has_b else op("aten::rsub", mean_alpha, 0, 1)
    y = op("aten::add", op("aten::mul", x, alpha), beta, 1)
    out = create(graph, "aten::type_as", [y, x], node).output()  # batch norm's result: stored
    out.setType(node.output().type())
    node.output().replaceAllUsesWith(out)
    node.destroy()
