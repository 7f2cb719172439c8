"""fuser: a JIT fusion compiler for PyTorch's pointwise ops, in the architecture of TorchScript's legacy
graph fuser. See README.md; the public API is re-exported from :mod:`fuser.interface`."""
from .interface import (can_fuse_on_cpu, can_fuse_on_gpu, debug_get_fused_kernel_code, debug_launch_graph, fuse,
                        graph_for, install, is_installed, n_cached_kernel_specs, n_compiled_kernels,
                        override_can_fuse_on_cpu, override_can_fuse_on_gpu, register_fusion, run_fusion,
                        uninstall)
from .explain import explain

__version__ = "0.1.0"

__all__ = [
    "install", "uninstall", "is_installed", "fuse", "graph_for", "register_fusion", "run_fusion",
    "debug_launch_graph", "debug_get_fused_kernel_code", "can_fuse_on_cpu", "can_fuse_on_gpu",
    "override_can_fuse_on_cpu", "override_can_fuse_on_gpu", "n_compiled_kernels", "n_cached_kernel_specs",
    "explain",
]
