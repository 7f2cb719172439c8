"""Load compiled kernels with the CUDA driver API and launch them on torch's current stream.

Modules are loaded with ``cuLibraryLoadData`` into torch's primary context of the device. The by-value
argument struct and the one-entry parameter array are built once per thread and per kernel and only
refilled per call, so a launch costs a few attribute stores and one ``cuLaunchKernel``.
"""
from __future__ import annotations

import ctypes
import threading
import weakref

import torch

from . import templates
from .driver import call, check, compile_source, options_for

BLOCK_SIZE = 256


def _args_struct(index32: bool, n_strided: int, n_ptrs: int, n_scalars: int):
    """ctypes mirror of the kernel's ``FzArgs`` (see ``fuser/cuda/templates.py``)."""
    idx = ctypes.c_int32 if index32 else ctypes.c_int64
    d = templates.MAX_DIMS

    class FzArgs(ctypes.Structure):
        _fields_ = [
            ("numel", idx),
            ("sizes", idx * d),
            ("strides", (idx * d) * max(1, n_strided)),
            ("rank", ctypes.c_int32),
            ("vec", ctypes.c_int32),
            ("ptrs", ctypes.c_void_p * n_ptrs),
            ("scalars", ctypes.c_double * max(1, n_scalars)),
        ]

    return FzArgs


def _ensure_context(device_index: int) -> None:
    """Make torch's primary context of the device current on this thread (torch creates it)."""
    from cuda.bindings import driver
    with torch.cuda.device(device_index):
        torch.cuda.current_stream(device_index)  # initializes the device in torch if needed
        torch.cuda.synchronize(device_index)
    ctx = call(driver.cuCtxGetCurrent)
    if int(ctx) == 0 or call(driver.cuCtxGetDevice) != device_index:
        dev = call(driver.cuDeviceGet, device_index)
        call(driver.cuCtxSetCurrent, call(driver.cuDevicePrimaryCtxRetain, dev))


class CudaKernel:
    """A loaded kernel of one arg spec; :meth:`launch` runs it for a :class:`fuser.executor.Plan`."""

    def __init__(self, name: str, image: bytes, device_index: int, index32: bool, n_strided: int,
                 n_ptrs: int, n_scalars: int, vec: int):
        from cuda.bindings import driver
        self.name, self.device_index, self.vec = name, device_index, vec
        self.n_strided = n_strided
        with torch.cuda.device(device_index):
            _ensure_context(device_index)
            self._library = call(driver.cuLibraryLoadData, image, [], [], 0, [], [], 0)
            weakref.finalize(self, _unload, self._library)
            kernel = call(driver.cuLibraryGetKernel, self._library, name.encode())
            self._function = call(driver.cuKernelGetFunction, kernel)
            per_sm = call(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor, self._function, BLOCK_SIZE, 0)
        props = torch.cuda.get_device_properties(device_index)
        self.max_blocks = max(1, per_sm) * props.multi_processor_count
        self._struct = _args_struct(index32, n_strided, n_ptrs, n_scalars)
        self._local = threading.local()
        self._launch = driver.cuLaunchKernel
        self._success = driver.CUresult.CUDA_SUCCESS

    def _buffers(self):
        loc = self._local
        args = getattr(loc, "args", None)
        if args is None:
            args = loc.args = self._struct()
            loc.params = (ctypes.c_void_p * 1)(ctypes.addressof(args))
            loc.params_addr = ctypes.addressof(loc.params)
        return args, loc.params_addr

    def launch(self, p, outputs) -> None:
        args, params = self._buffers()
        args.numel = p.numel
        rank = len(p.sizes)
        args.rank = rank
        for d, s in enumerate(p.sizes):
            args.sizes[d] = s
        for j, st in enumerate(p.strides):
            row = args.strides[j]
            for d, x in enumerate(st):
                row[d] = x
        ptrs = args.ptrs
        k = 0
        vec_ok = self.vec > 1
        for t in p.tensors:
            ptr = t.data_ptr()
            ptrs[k] = ptr
            k += 1
            if vec_ok and ptr % (t.element_size() * self.vec) and p.arg_spec.inputs[k - 1].layout == "dense":
                vec_ok = False
        for o in outputs:
            ptr = o.data_ptr()
            ptrs[k] = ptr
            k += 1
            if vec_ok and ptr % (o.element_size() * self.vec):
                vec_ok = False
        args.vec = 1 if vec_ok else 0
        for j, s in enumerate(p.scalars):
            args.scalars[j] = s
        work = p.numel // self.vec if vec_ok else p.numel
        grid = min(self.max_blocks, max(1, (work + BLOCK_SIZE - 1) // BLOCK_SIZE))
        stream = torch.cuda.current_stream(self.device_index).cuda_stream
        if torch.cuda.current_device() != self.device_index:
            with torch.cuda.device(self.device_index):
                self._do_launch(grid, stream, params)
        else:
            self._do_launch(grid, stream, params)

    def _do_launch(self, grid: int, stream: int, params: int) -> None:
        err, = self._launch(self._function, grid, 1, 1, BLOCK_SIZE, 1, 1, 0, stream, params, 0)
        if err != self._success:
            check(err, "cuLaunchKernel")


def _unload(library) -> None:
    from cuda.bindings import driver
    try:
        driver.cuLibraryUnload(library)
    except Exception:  # interpreter shutdown: the driver may be gone already
        pass


def load_kernel(source: str, name: str, arg_spec, n_strided: int, n_outputs: int, n_scalars: int,
                vec: int) -> CudaKernel:
    """Compile ``source`` with NVRTC for the arg spec's device and load it."""
    index = arg_spec.device_index if arg_spec.device_index is not None else torch.cuda.current_device()
    options = options_for(torch.cuda.get_device_capability(index))
    image = compile_source(source, name, options)
    return CudaKernel(name, image, index, arg_spec.index32, n_strided, len(arg_spec.inputs) + n_outputs,
                      n_scalars, vec)
