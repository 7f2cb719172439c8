"""The public API of fuser: a thin facade over the pipeline's stages.

``graph_fuser`` (the pass) -> ``kernel_cache`` (specs by key) -> ``executor`` (plan, compile, launch) with
``compiler``/``codegen`` and the ``cpu``/``cuda`` backends -> ``fallback`` (the interpreter) when fusion is
not possible.
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import compiler, executor, integration, settings
from .kernel_cache import STORE


def install() -> None:
    """Make ``torch.jit.script`` and ``torch.jit.trace`` return fused code, and keep TorchScript's own NNC
    fuser off the pointwise ops, until :func:`uninstall`."""
    integration.INSTALLER.install()


def uninstall() -> None:
    """Restore stock ``torch.jit.script`` / ``torch.jit.trace`` and TorchScript's fuser settings."""
    integration.INSTALLER.uninstall()


def is_installed() -> bool:
    return integration.INSTALLER.installed


def fuse(scripted):
    """Apply the fusion pass to a scripted or traced function or module (submodule calls inlined).

    Returns the fused callable: a new ``ScriptFunction`` for functions, the same module (methods edited in
    place) for modules. A module's method that has already run keeps running the graph it ran first (TorchScript's
    executor compiled it then): fuse a module before its first call, e.g. ``torch.jit.trace(m, x,
    check_trace=False)`` (the check runs it), or trace under :func:`install`, which does so.
    """
    return integration.fuse(scripted)


def graph_for(scripted, *inputs) -> torch.Graph:
    """The graph that runs for ``inputs``: each fused region is one ``prim::FusionGroup`` node with its
    ``Subgraph`` attribute; ops left outside keep their kinds. Runs ``scripted(*inputs)`` once."""
    return integration.graph_for(scripted, *inputs)


def register_fusion(fusion_group: torch._C.Node) -> int:
    """Register a ``prim::FusionGroup`` node's subgraph; alpha-equivalent subgraphs share one key."""
    return integration.register(fusion_group)


def run_fusion(key: int, inputs: Sequence) -> list[torch.Tensor]:
    """Run the registered group ``key`` on ``inputs`` (tensors and floats in the group's input order):
    as a generated kernel when possible, through the fallback interpreter otherwise."""
    return integration.run_key(key, list(inputs))


def debug_launch_graph(graph: torch.Graph, inputs: Sequence) -> list[torch.Tensor]:
    """Treat the whole ``graph`` (e.g. from ``torch.parse_ir``) as one fusion group and run it."""
    return run_fusion(integration.register_graph(graph), inputs)


def debug_get_fused_kernel_code(graph: torch.Graph, inputs: Sequence) -> str:
    """The generated kernel source for ``graph`` as one fusion group on ``inputs``.

    Raises RuntimeError saying why when these inputs would run through the fallback instead.
    """
    spec = STORE.get(integration.register_graph(graph))
    plan = executor.plan(spec, list(inputs))
    if isinstance(plan, str):
        raise RuntimeError(f"these inputs are not fused: {plan}")
    kernel = executor.kernel_for(spec, plan)
    if kernel is None:
        raise RuntimeError("these inputs are not fused: the group has an op or dtype the code generator "
                           "does not support for them (or eager rejects them)")
    return kernel.source


def can_fuse_on_cpu() -> bool:
    """Whether CPU tensors run as generated kernels (needs a working C++ compiler)."""
    return settings.can_fuse_on_cpu()


def can_fuse_on_gpu() -> bool:
    """Whether CUDA tensors run as generated kernels (needs a GPU and cuda-python)."""
    return settings.can_fuse_on_gpu()


def override_can_fuse_on_cpu(value: bool) -> None:
    """Turn CPU fusion on or off (groups then run through the fallback)."""
    settings.override_can_fuse_on_cpu(value)


def override_can_fuse_on_gpu(value: bool) -> None:
    """Turn GPU fusion on or off (groups then run through the fallback)."""
    settings.override_can_fuse_on_gpu(value)


def n_compiled_kernels() -> int:
    """Kernels compiled by this process so far."""
    return compiler.n_compiled_kernels()


def n_cached_kernel_specs() -> int:
    """Registered (deduplicated) fusion groups."""
    return len(STORE)
