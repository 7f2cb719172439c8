"""A compiled graph's kernels, built when the graph is compiled: every group's at once, on worker threads.

At its first call a graph would build its kernels one after another, each when its group first runs, and a training
step's backward kernels only once the forward has run. NVRTC (and the CPU's C compiler, a subprocess) runs without
the GIL, so here every group of a graph is planned as soon as the graph is lowered, from Dynamo's example inputs
(fake tensors carry the dtypes, devices, shapes and strides a plan reads), and its kernel built on a worker thread; and
the backward graph's groups are lowered and built already when AOTAutograd partitions the joint graph
(:func:`start_backward`). The group's first real call plans again and finds its kernel built or waits for it
(``KernelSpec.kernel_for``: one build per kernel, whoever asks), so nothing wraps the compiled graph: its calls cost
what they cost before. A backward graph that never runs (a forward called with grad on, outside training) has its
kernels built in the background, waited for by no one.

Each (group, example signature) is planned once (a stack of equal layers makes many calls of one group); a build that
fails here is forgotten: the first call meets the same failure and reports it, or falls back. Nothing raised here
reaches the compile. Symbolic shapes (``dynamic=True``) build nothing ahead: such a graph's first call plans its
sizes. A forked child starts with no workers and nothing pending (the parent's threads do not exist there).
"""
from __future__ import annotations

import copy
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .. import executor, settings

_lock = threading.Lock()
_pool: Optional[ThreadPoolExecutor] = None
_pending: list[Future] = []  # builds started and not yet waited for (:func:`wait`)
_ahead: set = set()  # (spec key, examples' signature) that start_backward planned: the backward compiler's graph
# makes these groups again, and its start plans none of them again
MAX_AHEAD = 4096  # bounded: a backward that is never compiled leaves its entries


def _forget_after_fork() -> None:
    global _lock, _pool, _pending, _ahead
    _lock, _pool, _pending, _ahead = threading.Lock(), None, [], set()


os.register_at_fork(after_in_child=_forget_after_fork)


def _workers() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 1)),
                                       thread_name_prefix="fuser-build")
        return _pool


def _example(node) -> Optional[torch.Tensor]:
    """The example tensor of a graph value, or None (not a tensor, or sizes or strides not plain ints)."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.layout != torch.strided:
        return None
    if not all(isinstance(x, int) for x in (*val.shape, *val.stride())):
        return None
    return val


def groups(gm: torch.fx.GraphModule) -> list:
    """(spec, example arguments) of each group call of a lowered graph whose arguments all have plain examples."""
    out = []
    for n in gm.graph.nodes:
        spec = getattr(n.target, "fuser_spec", None) if n.op == "call_function" else None
        if spec is None:
            continue
        args = [_example(a) for a in n.args]
        if args and all(a is not None for a in args):
            out.append((spec, args))
    return out


def start(gm: torch.fx.GraphModule, ahead: bool = False) -> int:
    """Plan ``gm``'s group calls (a lowered graph) here and start building their kernels on the workers; the number
    of builds started (``ahead``: of a backward graph's copy, whose groups the backward compiler will make again).
    Planning stays on this thread: a plan runs the group on its example tensors, and a fake tensor's mode (Dynamo's,
    shared with this thread) is not for two threads at once. Never raises."""
    if not settings.prebuild:
        return 0
    try:
        builders = _planned(gm, ahead)
        if not builders:
            return 0
        pool = _workers()
        futures = [pool.submit(build) for build in builders]
    except Exception:  # (a pool shut down at exit, ...): the first calls build
        return 0
    with _lock:
        _pending[:] = [f for f in _pending if not f.done()] + futures
    return len(futures)


def _planned(gm: torch.fx.GraphModule, ahead: bool) -> list:
    builders, seen_here = [], set()
    with unset_fake_temporarily():  # (the plan's meta tensors are to be meta tensors, not this mode's fakes)
        for spec, args in groups(gm):
            seen = (spec.key, tuple((a.dtype, a.device, tuple(a.shape), a.stride()) for a in args))
            if seen in seen_here:
                continue
            seen_here.add(seen)
            with _lock:
                if seen in _ahead and not ahead:
                    continue
                if ahead:
                    if len(_ahead) >= MAX_AHEAD:
                        _ahead.clear()
                    _ahead.add(seen)
            try:
                build = executor.kernel_builder(spec, args)
            except Exception:  # the first call plans again, and meets what this met
                build = None
            if build is not None:
                builders.append(build)
    return builders


def start_backward(bw: torch.fx.GraphModule, fuse: Callable) -> int:
    """Start building the kernels of a backward graph that AOTAutograd will compile only at the first backward:
    ``fuse`` (``aot.fuse_graph``) lowers a copy of it, and the backward compiler later makes the same groups (the same
    group text, one spec) from the graph itself. Never raises: a backward that cannot be lowered here is lowered,
    and reported, when it is compiled."""
    if not settings.prebuild:
        return 0
    try:
        copied = torch.fx.GraphModule(bw, copy.deepcopy(bw.graph))  # (node metas shared, not copied)
        return start(fuse(copied, "backward")[0], ahead=True)
    except Exception:
        return 0


def wait() -> None:
    """Wait for every build started so far (their failures are the first calls' to meet)."""
    with _lock:
        futures = list(_pending)
        _pending.clear()
    for f in futures:
        f.exception()
