"""The torch.compile door: a Dynamo backend that runs pointwise regions of ATen graphs as fuser groups.

``torch.compile(model, backend="fuser")`` works once this package is imported, or with no import when fuser is
installed (setup.py's ``torch_dynamo_backends`` entry point names :func:`backend`). One job per file:
``support.py`` (which nodes a group takes, and why not), ``partition.py`` (graph -> regions), ``lower.py``
(region -> group IR -> registered group -> one call in the graph), ``prebuild.py`` (a graph's kernels built side by side
when it is compiled), ``aot.py`` (the backend: AOTAutograd, decompositions,
fallback), ``report.py`` (the records ``fuser.explain`` shows).
"""
from .aot import backend, decompositions, fuse_graph, register

register()

__all__ = ["backend", "decompositions", "fuse_graph"]
