"""``python -m fuser demo``: script an LSTM cell and a GELU block, show the fused graphs and a generated
kernel, check against eager and time eager vs fused (CUDA when a GPU is usable, else the CPU backend); then one
FusionDefinition (nvFuser's frontend) and its repro script."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import torch

import fuser
from fuser import graph_fuser
from fuser.kernel_cache import STORE


def lstm_cell(x, hx, cx, w_ih, w_hh, b_ih, b_hh):
    gates = torch.mm(x, w_ih.t()) + torch.mm(hx, w_hh.t()) + b_ih + b_hh
    ingate, forgetgate, cellgate, outgate = gates.chunk(4, 1)
    ingate = torch.sigmoid(ingate)
    forgetgate = torch.sigmoid(forgetgate)
    cellgate = torch.tanh(cellgate)
    outgate = torch.sigmoid(outgate)
    cy = forgetgate * cx + ingate * cellgate
    hy = outgate * torch.tanh(cy)
    return hy, cy


def gelu_block(x, b):
    y = x + b
    return 0.5 * y * (1 + torch.tanh(0.7978845608 * (y + 0.044715 * y * y * y)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_us(fn, args, device: torch.device, iters: int) -> float:
    """Median per-call wall time over 5 batches of ``iters`` calls, after warm-up."""
    for _ in range(3):
        fn(*args)
    samples = []
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn(*args)
        _sync(device)
        samples.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(samples)


def _max_err(a, b) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def _show(title: str, fn, eager_fn, args, device: torch.device, iters: int) -> bool:
    print(f"\n=== {title} ===")
    graph = fuser.graph_for(fn, *args)
    print("Fused graph:")
    print(graph)
    keys = [graph_fuser.group_call_key(n) for n in fn.graph.nodes() if graph_fuser.is_group_call(n)]
    spec = STORE.get(max(keys, key=lambda k: len(STORE.get(k).group.nodes))) if keys else None
    kernels = [k for k in spec.kernels().values() if k is not None] if spec else []
    if kernels:
        print(f"Generated kernel ({kernels[0].name}, {device.type}):")
        body = kernels[0].source
        print(body[body.index('extern "C"'):])
    out, ref = fn(*args), eager_fn(*args)
    out = out if isinstance(out, tuple) else (out,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    err = _max_err(out, ref)
    ok = err < 1e-4
    print(f"max |fused - eager| = {err:.3g}  ({'OK' if ok else 'MISMATCH'})")
    t_eager = _time_us(eager_fn, args, device, iters)
    t_fused = _time_us(fn, args, device, iters)
    print(f"time per call on {device}: eager {t_eager:.1f} us, fused {t_fused:.1f} us "
          f"({t_eager / t_fused:.2f}x)")
    return ok


def demo(device_name: str | None = None) -> int:
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    if device_name is None:
        device_name = "cuda" if fuser.can_fuse_on_gpu() else "cpu"
    device = torch.device(device_name)
    print(f"fuser {fuser.__version__}, torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    print(f"can_fuse_on_cpu={fuser.can_fuse_on_cpu()} can_fuse_on_gpu={fuser.can_fuse_on_gpu()}")
    torch.manual_seed(0)
    fuser.install()
    try:
        big = device.type == "cuda"
        batch, hidden = (4096, 1024) if big else (64, 256)
        inp = hidden
        lstm = torch.jit.script(lstm_cell)
        largs = (torch.randn(batch, inp, device=device), torch.randn(batch, hidden, device=device),
                 torch.randn(batch, hidden, device=device), torch.randn(4 * hidden, inp, device=device),
                 torch.randn(4 * hidden, hidden, device=device), torch.randn(4 * hidden, device=device),
                 torch.randn(4 * hidden, device=device))
        ok = _show("LSTM cell", lstm, lstm_cell, largs, device, 50 if big else 200)
        gelu = torch.jit.script(gelu_block)
        rows, cols = (16384, 4096) if big else (256, 1024)
        gargs = (torch.randn(rows, cols, device=device), torch.randn(cols, device=device))
        ok = _show("GELU block", gelu, gelu_block, gargs, device, 50 if big else 200) and ok
    finally:
        fuser.uninstall()
    from .frontend import demo as frontend_demo
    ok = frontend_demo.show(device) and ok
    print(f"\nkernels compiled: {fuser.n_compiled_kernels()}, kernel specs: {fuser.n_cached_kernel_specs()}")
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuser")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="fuse an LSTM cell and a GELU block, check and time them")
    d.add_argument("--device", choices=("cpu", "cuda"), default=None)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo(args.device)
    return 2


if __name__ == "__main__":
    sys.exit(main())
