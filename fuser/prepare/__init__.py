"""Before the fusion pass: rewrite what real networks contain into the pointwise ops the pass fuses.

Five rewrites, each exact to eager's semantics where it applies and a no-op elsewhere:

* :func:`remove_dropout`: dropout that is off (``train`` a constant False, or ``p`` a constant 0) is the
  identity, as eager returns its input; dropout that is on (a constant ``0 < p < 1``) becomes
  ``(rand_like(x) > p).type_as(x) * x * (1 / (1 - p))``, which fuses through the in-kernel Philox generator.
  Its numbers are not eager's (eager draws a Bernoulli mask from another generator), its distribution and
  its gradient (the same mask times the same scale) are.
* :func:`remove_mutation`: in-place ops become functional where nothing observes the alias (TorchScript's own
  ``RemoveMutation`` decides that), and only where the functional op gives the in-place op's dtype and shape.
* :func:`decompose_batch_norm`: inference ``batch_norm`` (``training`` a constant False, running statistics
  present) becomes pointwise ops over the running statistics, in eager's CPU formula.
* :func:`densify_attention_masks`: an attention mask (say one made by ``expand``, a broadcast view: stride 0 in its
  last dim) is made contiguous before ``scaled_dot_product_attention``. Eager's fused attention kernels refuse such a
  mask and run the math path (two bmm and a softmax); a traced Hugging Face model builds exactly that mask (an
  all-True ``expand`` where eager passes None). Same values, so the same result; the copy costs a small kernel.
  Before it, :func:`drop_all_true_attention_masks` passes None for a bool mask that is provably all True (that
  traced mask: ``expand(ge(arange(n) + 0, 0))``), as eager does, so the flash kernel can run.

Precondition: calls are inlined. The graph may have nested blocks; every rewrite walks them.
"""
from __future__ import annotations

import torch

from .attention import densify_attention_masks, drop_all_true_attention_masks
from .batch_norm import BATCH_NORM_SCHEMA, decompose_batch_norm
from .dropout import remove_dropout
from .mutation import SAME_DTYPE_ACTIVATIONS, remove_mutation

__all__ = ["prepare_graph", "remove_dropout", "remove_mutation", "decompose_batch_norm",
           "drop_all_true_attention_masks", "densify_attention_masks", "SAME_DTYPE_ACTIVATIONS", "BATCH_NORM_SCHEMA"]


def prepare_graph(graph: torch._C.Graph) -> dict[str, int]:
    """Apply the rewrites in place, in the order they need; returns how many nodes each rewrote.

    Mutation goes before batch_norm: the decomposition ends in ``type_as``, whose result may alias its input,
    and RemoveMutation leaves an in-place op on such a value alone (``bn(x).relu_()`` would stay in place).
    """
    return {"dropout": remove_dropout(graph), "mutation": remove_mutation(graph),
            "batch_norm": decompose_batch_norm(graph), "all_true_mask": drop_all_true_attention_masks(graph),
            "attention_mask": densify_attention_masks(graph)}
