"""The native hot path of the TorchScript door: ``fuser::fusion_group`` served in C++ for prepared signatures.

A fused call in Python costs the dispatcher's crossing into Python and the executor's checks, some 30-60 us a
call; eager's op costs 10-20. Once loaded, ``hotpath.cpp`` is the operator's kernel for CPU and CUDA tensors: it
matches the inputs against the signatures Python prepared (:func:`offer`, from what the executor planned and the
outputs it returned), allocates the outputs and launches, and hands every other call to the Python operator
``fuser::fusion_group_py``. Nothing is decided twice: the record replays a plan the executor made.

Loading: the first fused call loads the library from the disk cache, or starts building it in a background
thread (calls meanwhile run in Python); ``FUSER_NATIVE=0`` turns it off. :func:`ensure` with ``block=True``
waits for it (the tests and the benchmark do).
"""
from __future__ import annotations

import threading
import warnings
from typing import Optional, Sequence

import torch

from .. import settings
from . import build, record

_lock = threading.Lock()
_state: dict = {}  # "built": build.Built once loaded; "error": why it is off; "thread": a build under way
_kept: dict = {}  # fn address -> the kernel object that owns it, while the library's table may use it
MAX_KEPT = 4096


def loaded() -> bool:
    return "built" in _state


def ensure(block: bool = False) -> bool:
    """Load the library, or start building it; whether it is loaded now. ``block``: wait for a build."""
    if "built" in _state:
        return True
    if "error" in _state:
        return False
    with _lock:
        if "built" in _state or "error" in _state:
            return "built" in _state
        if not build.wanted():
            _state["error"] = "off (FUSER_NATIVE=0, or no disk cache without FUSER_NATIVE=1)"
            return False
        thread = _state.get("thread")
        if thread is None:
            thread = _state["thread"] = threading.Thread(target=_build, name="fuser-native-build", daemon=True)
            thread.start()
    if block:
        thread.join()
    return "built" in _state


def _build() -> None:
    try:
        built = build.build_and_load()
    except Exception as e:  # no compiler, headers of another torch, a link error: the Python path stays
        _state["error"] = f"{type(e).__name__}: {e}"
        warnings.warn(f"fuser: the native hot path could not be built; fused calls run in Python ({e})",
                      RuntimeWarning, stacklevel=2)
        return
    _state["built"] = built


def status() -> str:
    if "built" in _state:
        b = _state["built"]
        return f"loaded ({'built' if b.compiled else 'from the disk cache'} in {b.seconds:.1f} s)"
    return _state.get("error", "building" if "thread" in _state else "not started")


def offer(key: int, digest: str, spec, args: Sequence, tensors: Sequence[torch.Tensor], scalars: Sequence[float],
          outputs: Sequence[torch.Tensor]) -> None:
    """Prepare the signature of a call the hot path handed over unprepared (from the executor's geometry of
    these inputs and the outputs Python returned), or mark it as one for Python. A call autograd records gets
    its backward prepared too."""
    if "built" not in _state:
        return
    from .. import autodiff, executor
    try:
        sig = executor.signature(tensors)
    except (AttributeError, RuntimeError, TypeError):
        return
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    call = autodiff.prepare_call(spec, list(args)) if grad and not spec.random else None
    geo = (spec if call is None else call.forward).geometries.get(sig)
    kernel = getattr(geo, "kernel", None)  # None: the executor found no kernel for these inputs
    if kernel is not None and call is not None and call.forward is not spec:  # the kernel's extra outputs (call.save),
        n = len(outputs)  # as it allocates them
        outputs = [*outputs, *((torch.empty(sz, dtype=dt, device=geo.device) for sz, dt in  # (a row kernel's)
                                zip(geo.out_shapes[n:], geo.out_dtypes[n:])) if hasattr(geo, "out_shapes") else
                               (torch.empty_strided(sz, st, dtype=dt, device=geo.device) for sz, st, dt in
                                zip(geo.out_sizes[n:], geo.out_strides[n:], geo.out_dtypes[n:])))]
    got = None if kernel is None or not settings.fusion_enabled(geo.device.type) or (
        grad and (call is None or not getattr(geo, "hot_path_grad", True))) else record.launch_record(
        geo, tensors, scalars, outputs)
    if got is None:
        rec, floats = record.PYTHON, []
    else:
        rec, floats, owner = got
        with _lock:
            if len(_kept) >= MAX_KEPT:
                clear()
            _kept[id(owner)] = owner
    signature = record.signature(tensors, len(scalars))
    if not grad:
        torch.ops.fuser._native_put(key, digest, signature, rec, floats)
        return
    requires = [int(t.requires_grad) for t in tensors]
    if got is None:
        torch.ops.fuser._native_put_train(key, digest, signature, rec, floats, requires, [], "", [], [])
        return
    bw_rec, bw_digest, step_digests = record.train_record(spec, call, got, outputs, tensors)
    torch.ops.fuser._native_put_train(key, digest, signature, rec, floats, requires, bw_rec, bw_digest, step_digests,
                                      record.backward_meta(call, tensors))


def python_backward(spec, saved: Sequence, scalars: Sequence[float], meta: Sequence[int], grads: Sequence) -> list:
    """The gradients of a call the hot path recorded, computed as the autograd Function's backward computes them
    (for an output-gradient pattern the prepared backward group does not cover). ``saved``: per tensor input, then
    per output (the kernel's: then its extra outputs, ``autodiff._Call.save``), the saved tensor or None. Per chunked
    tensor (``autodiff._chunked_inputs``), one more gradient,
    that tensor's, at the end."""
    from .. import autodiff
    needs, tensors, chunks, save = record.parse_backward_meta(meta)
    device = next(g.device for g in grads if g is not None)
    sig = tuple((dt, len(shape) == 0) for dt, shape in tensors)
    call = autodiff._Call(spec, tuple(scalars), needs, sig, (), (), chunks=chunks)
    call.save = save
    n = len(tensors)
    outputs = {k: t for k, t in enumerate(saved[n:]) if t is not None}
    return autodiff.input_grads(call, list(saved[:n]), [(shape, dt, device) for dt, shape in tensors],
                                list(grads[:len(spec.group.outputs)]), outputs)


def clear() -> None:
    """Forget every prepared signature (the device switches changed, or the table is full)."""
    if "built" in _state:
        torch.ops.fuser._native_clear()
    _kept.clear()


def stats() -> Optional[dict]:
    """Counters of the loaded library: calls served, calls handed over to prepare, calls handed over for Python,
    prepared signatures, backwards that ran a fused group (weight/bias gradients summed in the row kernel), column
    groups backwards launched (broadcast inputs' gradients summed apart), backwards that ran such a split
    (``record.train_record``), CUDA launches of a row kernel with column sums (partial rows, then the second kernel)
    and of a column kernel, and the blocks the CPU block cache took from the heap (small outputs' memory: a dropped
    output's block is the next one's) and the large blocks it mapped (outputs of more than 32 MB, whose freed blocks
    it keeps too: ``hotpath.cpp``'s LargeCache); None when it is not loaded."""
    if "built" not in _state:
        return None
    (hits, misses, handed, launches, fused, columns, split, row_sums, column_kernels,
     new_blocks, new_large) = torch.ops.fuser._native_stats()
    return {"hits": hits, "misses": misses, "handed": handed, "signatures": launches, "fused_backwards": fused,
            "column_sums": columns, "split_backwards": split, "cuda_row_sums": row_sums,
            "cuda_column_kernels": column_kernels, "new_blocks": new_blocks, "new_large_blocks": new_large}


# the phases of a served call's host time (hotpath.cpp's Phase): the dispatch keys and autograd checked, the prepared
# launch found (the signature: sizes, strides, dtypes), the scalars' limits and the current device, the outputs
# allocated, the arguments packed (a random kernel's state drawn), the launch (on the CPU: the kernel itself), and
# autograd's record of a training call
PHASES = ("classify", "lookup", "checks", "alloc", "pack", "launch", "record")


def phases(on: bool) -> Optional[dict]:
    """The host time (ns, summed) of each of :data:`PHASES` over the calls served since the last call, under
    ``"calls"`` how many; timing on from now on if ``on`` (off by default: it reads the clock per phase). None when
    the library is not loaded."""
    if "built" not in _state:
        return None
    calls, *ns = torch.ops.fuser._native_phases(on)
    return {"calls": calls, **dict(zip(PHASES, ns))}


settings.on_change.append(clear)
