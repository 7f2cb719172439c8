"""Load compiled kernels with the CUDA driver API and launch them on torch's current stream.

Modules are loaded with ``cuLibraryLoadData`` into torch's primary context of the device. The by-value
argument struct and the one-entry parameter array are built once per thread and per kernel and only
refilled per call, so a launch costs a few attribute stores and one ``cuLaunchKernel``.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import threading
import weakref
from typing import Optional

import torch

from . import templates
from .. import disk_cache
from .driver import call, check, compile_source, nvrtc_version, options_for

BLOCK_SIZE = 256
# Blocks launched, in multiples of what the GPU holds at once; 0: enough for one trip per thread. Measured on
# an H200: kernels with only dense inputs ran fastest with one trip per thread (a*b+c 1.04-1.06 of the copy
# floor, against 1.02 at 4 waves); kernels with strided inputs, whose trips start with an index walk, with 8
# waves. H200 (2026-11-27), fuser alone, two runs each, fraction of the copy floor at 4 / 8 / 16 waves:
# lstm_cell 0.95-0.98 / 0.96-1.00 / 0.99-1.02, gelu_bias float32 0.92-0.93 / 0.94-0.96 / 0.96-0.98, outer_affine
# float32 0.93-0.95 / 0.96 / 0.97-0.98, reduced_plus_float_bias 0.89-0.90 / 0.90-0.92 / 0.93-0.94, but gelu_bias
# float16 and bfloat16 (bound by arithmetic) 0.80-0.84 / 0.81-0.84 / 0.78-0.82; one trip per thread gave those two
# 0.70-0.76 on another H200 that day.
# (codegen.grid_waves picks one trip a thread for cheap bodies over 4-element vectors and 32 waves for other bodies
# over 4-element vectors, unless the environment sets FUSER_GRID_WAVES_STRIDED or FUSER_GRID_WAVES_DENSE)
GRID_WAVES = int(os.environ.get("FUSER_GRID_WAVES_STRIDED", "8"))
_WAVES_SET = "FUSER_GRID_WAVES_STRIDED" in os.environ or "FUSER_GRID_WAVES_DENSE" in os.environ
GRID_WAVES_DENSE = int(os.environ.get("FUSER_GRID_WAVES_DENSE", "0"))
# The launch itself: "cuda-python" uses the binding with a prebuilt parameter array; "ctypes" calls libcuda's
# cuLaunchKernel directly. On an H200 host the binding took 3.9 us a launch and ctypes 5.2 us.
LAUNCH = os.environ.get("FUSER_LAUNCH", "cuda-python")


@functools.lru_cache(maxsize=None)
def _raw_cu_launch():
    """libcuda's cuLaunchKernel through ctypes, or None where the library cannot be opened."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    fn = lib.cuLaunchKernel
    u = ctypes.c_uint
    fn.argtypes = [ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def args_struct(index32: bool, n_strided: int, n_ptrs: int, n_scalars: int):
    """ctypes mirror of the kernel's ``FzArgs`` (see ``fuser/cuda/templates.py``); ``n_strided``: strided
    inputs and strided outputs (``fuser.codegen.strided_operands``)."""
    idx = ctypes.c_int32 if index32 else ctypes.c_int64
    d = templates.MAX_DIMS

    class FzArgs(ctypes.Structure):
        _fields_ = [
            ("numel", idx),
            ("sizes", idx * d),
            ("magic", ctypes.c_uint32 * d),
            ("shift", ctypes.c_uint32 * d),
            ("strides", (idx * d) * max(1, n_strided)),
            ("rank", ctypes.c_int32),
            ("vec", ctypes.c_int32),
            ("tile_dim", ctypes.c_int32),
            ("ptrs", ctypes.c_void_p * n_ptrs),
            ("scalars", ctypes.c_double * max(1, n_scalars)),
        ]

    return FzArgs


class LaunchArgs:
    """One kernel's ``FzArgs`` and the one-entry parameter array that points to it, refilled per launch.

    :meth:`fill` writes what the driver passes: a kernel keeps one per thread and launches with it, and the
    CUDA emulator (``fuser.cuda.emulate``) fills one to get the same bytes for its host run.
    """

    __slots__ = ("args", "params", "params_addr", "geometry", "context_ready", "vec_align")

    def __init__(self, struct, vec_align: tuple):
        self.args = struct()
        self.params = (ctypes.c_void_p * 1)(ctypes.addressof(self.args))
        self.params_addr = ctypes.addressof(self.params)
        self.geometry = None  # the geometry whose sizes and strides args holds
        self.context_ready = False  # the thread has a current context (CudaKernel._do_launch)
        self.vec_align = vec_align  # per pointer: bytes it must be aligned to for the vector path (0: any)

    def fill(self, geo, tensors, scalars, outputs) -> bool:
        """Fill for inputs of geometry ``geo`` (fuser.executor.Geometry), the tensors' data pointers (inputs,
        then outputs) and the float arguments; returns whether the vector path runs (``args.vec``)."""
        args = self.args
        if self.geometry is not geo:  # sizes and strides change only with the input signature
            args.numel = geo.numel
            args.rank = len(geo.sizes)
            args.tile_dim = geo.tile_dim
            for d, s in enumerate(geo.sizes):
                args.sizes[d] = s
                args.magic[d], args.shift[d] = divider(s)
            for j, st in enumerate(geo.strides):
                row = args.strides[j]
                for d, x in enumerate(st):
                    row[d] = x
            self.geometry = geo
        addrs = [t.data_ptr() for t in tensors]
        addrs += [o.data_ptr() for o in outputs]
        args.ptrs[:] = addrs
        vec_ok = geo.vec_shape
        if vec_ok:
            for ptr, a in zip(addrs, self.vec_align):
                if a and ptr % a:
                    vec_ok = False
                    break
        args.vec = vec_ok
        if scalars:
            args.scalars[:len(scalars)] = scalars
        return vec_ok


def _primary_context(device_index: int):
    """torch's context of the device (its primary context), made current on this thread.

    A thread that only ever used torch's caching allocator may have no current context yet: the runtime
    sets one lazily, and the driver API needs it, so every thread's first launch calls this."""
    from cuda.bindings import driver
    torch.cuda.init()
    dev = call(driver.cuDeviceGet, device_index)
    ctx = call(driver.cuDevicePrimaryCtxRetain, dev)
    current = call(driver.cuCtxGetCurrent)
    if int(current) != int(ctx):
        call(driver.cuCtxSetCurrent, ctx)
    return ctx


def primary_context_handle(device_index: int) -> int:
    """The address of torch's primary context of the device (made current on this thread)."""
    return int(_primary_context(device_index))


class CudaKernel:
    """A loaded kernel of one arg spec; :meth:`launch` runs it for a :class:`fuser.executor.Plan`. ``waves``: the
    most blocks a launch takes, in multiples of what the GPU holds at once (0: one trip a thread; None: GRID_WAVES
    for a kernel with strided operands, GRID_WAVES_DENSE otherwise)."""

    def __init__(self, name: str, image: bytes, device_index: int, index32: bool, n_strided: int,
                 n_ptrs: int, n_scalars: int, vec: int, vec_align: tuple, waves: Optional[int] = None):
        from cuda.bindings import driver
        self.name, self.device_index, self.vec = name, device_index, vec
        self.vec_align = vec_align  # per pointer: bytes it must be aligned to for the vector path (0: any)
        self.n_strided = n_strided
        with torch.cuda.device(device_index):
            _primary_context(device_index)
            self._library = call(driver.cuLibraryLoadData, image, [], [], 0, [], [], 0)
            weakref.finalize(self, _unload, self._library)
            kernel = call(driver.cuLibraryGetKernel, self._library, name.encode())
            self._function = call(driver.cuKernelGetFunction, kernel)
            per_sm = call(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor, self._function, BLOCK_SIZE, 0)
        self.per_sm = max(1, per_sm)  # blocks of BLOCK_SIZE threads an SM holds at once
        props = torch.cuda.get_device_properties(device_index)
        if waves is None or _WAVES_SET:  # codegen.grid_waves's choice, unless the environment sets the waves
            waves = GRID_WAVES if n_strided else GRID_WAVES_DENSE
        self.max_blocks = self.per_sm * props.multi_processor_count * waves if waves > 0 else 2 ** 31 - 1
        self._struct = args_struct(index32, n_strided, n_ptrs, n_scalars)
        self._local = threading.local()
        self._launch = driver.cuLaunchKernel
        self._success = driver.CUresult.CUDA_SUCCESS
        self._raw_launch = _raw_cu_launch() if LAUNCH == "ctypes" else None
        self._function_ptr = int(self._function)

    def launch(self, geo, tensors, scalars, outputs) -> None:
        """Launch on the current stream of the device for inputs of geometry ``geo`` (fuser.executor)."""
        try:
            loc = self._local.args
        except AttributeError:  # this thread's first launch of the kernel
            loc = self._local.args = LaunchArgs(self._struct, self.vec_align)
        vec_ok = loc.fill(geo, tensors, scalars, outputs)
        grid = geo.grid_vec if vec_ok else geo.grid_scalar
        if grid is None:
            grid = self.grid(geo, vec_ok)
            if vec_ok:
                geo.grid_vec = grid
            else:
                geo.grid_scalar = grid
        index = self.device_index
        stream = _raw_stream(index)
        if _current_device() != index:
            with torch.cuda.device(index):
                self._do_launch(loc, grid, stream)
        else:
            self._do_launch(loc, grid, stream)

    def grid(self, geo, vec_ok: bool) -> int:
        """Blocks to launch for geometry ``geo`` (fuser.executor), on the vector path or not."""
        work = geo.numel // self.vec if vec_ok else geo.numel
        if geo.tile_dim >= 0:  # the tiled path: a block per 32 x 32 tile
            work = geo.n_tiles * BLOCK_SIZE
        return min(self.max_blocks, max(1, (work + BLOCK_SIZE - 1) // BLOCK_SIZE))

    def _do_launch(self, loc, grid: int, stream: int) -> None:
        if not loc.context_ready:  # this thread's first launch: it may have no current context yet
            _primary_context(self.device_index)
            loc.context_ready = True
        if self._raw_launch is not None:
            err = self._raw_launch(self._function_ptr, grid, 1, 1, BLOCK_SIZE, 1, 1, 0, stream, loc.params_addr, None)
            if err:
                from cuda.bindings import driver
                check(driver.CUresult(err), "cuLaunchKernel")
            return
        err, = self._launch(self._function, grid, 1, 1, BLOCK_SIZE, 1, 1, 0, stream, loc.params_addr, 0)
        if err != self._success:
            check(err, "cuLaunchKernel")


@functools.lru_cache(maxsize=4096)
def divider(d: int) -> tuple[int, int]:
    """(magic, shift) with n // d == (umulhi(n, magic) + n) >> shift for 0 <= n < 2**31 and 1 <= d < 2**31
    (Granlund and Montgomery's round-up method, as the kernels' fz_div uses it); (0, 0) for larger d."""
    if not 1 <= d < 2 ** 31:
        return 0, 0
    shift = (d - 1).bit_length()
    magic = ((1 << 32) * ((1 << shift) - d)) // d + 1
    return magic & 0xFFFFFFFF, shift


def _unload(library) -> None:
    from cuda.bindings import driver
    try:
        driver.cuLibraryUnload(library)
    except Exception:  # interpreter shutdown: the driver may be gone already
        pass


def contracts(in_dtypes, out_dtypes) -> bool:
    """Whether a kernel with these inputs and outputs is compiled with multiplies and adds contracted into FMAs
    (``settings.cuda_contract``): where every output and every floating input is float16 or bfloat16. Such a
    kernel computes in float32 where eager rounds each op's result to 16 bits, so a contraction's difference (the
    product's rounding, 2^-24 of it) is far below what the kernel already differs by and below the output's own
    rounding (2^-11, 2^-8). A float32 or float64 input or output keeps eager's two roundings (eager computes such
    a kernel's ops in float32 or wider), and so does a bool or integer output (a comparison of a*b + c could
    flip). Not under ``settings.round_reduced`` (eager's bits asked for)."""
    from .. import settings
    if not settings.cuda_contract or settings.round_reduced or not out_dtypes:
        return False
    half = (torch.float16, torch.bfloat16)
    return all(dt in half for dt in out_dtypes) and all(dt in half for dt in in_dtypes if dt.is_floating_point)


def cached_image(source: str, name: str, index: int, fmad: bool = False) -> tuple[bytes, bool]:
    """The compiled image of ``source`` for device ``index``: NVRTC's, or the disk cache's; and whether NVRTC ran.
    ``fmad``: multiplies and adds contracted (:func:`contracts`)."""
    options = dataclasses.replace(options_for(torch.cuda.get_device_capability(index)), fmad=fmad)
    compiled = []

    def build() -> bytes:
        compiled.append(True)
        return compile_source(source, name, options)

    fields = [("nvrtc", repr(nvrtc_version())), ("arch", repr(options)),
              ("flags", b" ".join(options.flags())), ("name", name), ("source", source)]
    return disk_cache.get_or_build(fields, build, ".cubin" if options.cubin else ".ptx"), bool(compiled)


def load_kernel(source: str, name: str, arg_spec, n_strided: int, out_dtypes, n_scalars: int,
                vec: int, waves: Optional[int] = None) -> tuple[CudaKernel, bool]:
    """Compile ``source`` with NVRTC for the arg spec's device (or take it from the disk cache) and load it.
    Returns the kernel and whether NVRTC ran. ``waves``: see :class:`CudaKernel`."""
    index = arg_spec.device_index if arg_spec.device_index is not None else torch.cuda.current_device()
    image, compiled = cached_image(source, name, index, contracts([d.dtype for d in arg_spec.inputs], out_dtypes))
    kernel = CudaKernel(name, image, index, arg_spec.index32, n_strided, len(arg_spec.inputs) + len(out_dtypes),
                        n_scalars, vec, vector_alignment(arg_spec, out_dtypes, vec), waves)
    return kernel, compiled


def vector_alignment(arg_spec, out_dtypes, vec: int) -> tuple:
    """Per pointer (inputs, then outputs): the bytes it must be aligned to for the vector path, 0 where it
    is not read in vectors. Every tensor moves its own bytes per access: ``vec`` elements of a wider tensor
    than the narrowest (a float32 output beside a float16 input) are several 16-byte accesses, so 16 bytes
    is the most any pointer needs (``fz_vec``'s alignment)."""
    size = lambda dt: min(16, torch.empty((), dtype=dt).element_size() * vec)  # noqa: E731
    align = tuple(size(d.dtype) if d.layout in ("dense", "rows") else 0 for d in arg_spec.inputs)
    return align + tuple(size(dt) for dt in out_dtypes)


def _raw_stream(index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(index)


_current_device = torch.cuda.current_device
