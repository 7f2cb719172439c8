"""The systems (columns) the benchmark compares: each a context manager that builds its own function from a
workload, with that system's settings in effect while the cell runs."""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Iterator

import torch

import fuser
from fuser import native

from .workloads import Workload, _python_function, _script_function

# torch.jit.script and friends warn about TorchScript's deprecation since torch 2.11; the warning says
# nothing about the numbers measured here.
warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", category=FutureWarning)


SYSTEMS = ("eager", "ts_nnc", "ts_legacy", "compile", "fuser", "compile_fuser")
# the systems whose functions can be alive at once (the benchmark's interleaved rounds): TorchScript's columns
# depend on process-global executor flags and on whether fuser's pass is installed
INTERLEAVED_SYSTEMS = ("eager", "compile", "fuser", "compile_fuser")
_side_by_side = [False]


@contextlib.contextmanager
def systems_side_by_side() -> Iterator[None]:
    """While it holds, the torch.compile columns leave Dynamo's caches alone when they open and close (each
    compiles a fresh code object: their caches do not meet), so one column's function keeps its compiled code
    while another's opens; Dynamo is reset once before and once after."""
    torch._dynamo.reset()
    _side_by_side[0] = True
    try:
        yield
    finally:
        _side_by_side[0] = False
        torch._dynamo.reset()


def _reset_dynamo() -> None:
    if not _side_by_side[0]:
        torch._dynamo.reset()


@contextlib.contextmanager
def _eager(wl: Workload) -> Iterator[Callable]:
    yield _python_function(wl)


@contextlib.contextmanager
def _ts_nnc(wl: Workload) -> Iterator[Callable]:
    yield _script_function(wl)


@contextlib.contextmanager
def _ts_legacy(wl: Workload) -> Iterator[Callable]:
    # The executor is chosen when a function first runs, so the flags must hold while the cell runs; they are
    # process-global, so they are restored afterwards for the other columns.
    old_profiling = torch._C._jit_set_profiling_executor(False)
    old_texpr = torch._C._jit_texpr_fuser_enabled()
    old_gpu = torch._C._jit_can_fuse_on_gpu()
    try:
        torch._C._jit_set_texpr_fuser_enabled(False)
        torch._C._jit_override_can_fuse_on_gpu(True)
        yield _script_function(wl)
    finally:
        torch._C._jit_set_profiling_executor(old_profiling)
        torch._C._jit_set_texpr_fuser_enabled(old_texpr)
        torch._C._jit_override_can_fuse_on_gpu(old_gpu)


@contextlib.contextmanager
def _compile(wl: Workload) -> Iterator[Callable]:
    _reset_dynamo()  # drop earlier cells' compiled code and guards
    try:
        yield torch.compile(_python_function(wl))
    finally:
        _reset_dynamo()


@contextlib.contextmanager
def _fuser(wl: Workload) -> Iterator[Callable]:
    fuser.install()  # also keeps NNC off the pointwise ops, as a user of install() would have it
    native.ensure(block=True)  # steady state: the hot path loaded (a first build runs in a background thread)
    try:
        yield fuser.fuse(_script_function(wl))
    finally:
        fuser.uninstall()


@contextlib.contextmanager
def _compile_fuser(wl: Workload) -> Iterator[Callable]:
    """torch.compile with fuser's backend (the torch.compile door, fuser/dynamo/); first_call_ms is its compile."""
    import fuser.dynamo  # noqa: F401  (registers backend="fuser" where fuser is not installed)
    native.ensure(block=True)
    _reset_dynamo()
    try:
        yield torch.compile(_python_function(wl), backend="fuser")
    finally:
        _reset_dynamo()


SYSTEM_CONTEXTS = {"eager": _eager, "ts_nnc": _ts_nnc, "ts_legacy": _ts_legacy, "compile": _compile,
                   "fuser": _fuser, "compile_fuser": _compile_fuser}
