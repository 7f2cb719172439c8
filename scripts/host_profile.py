"""Where a small fused call's host time goes, stage by stage (run on a CUDA machine):
PYTHONPATH=. python3 scripts/host_profile.py"""
import time
import warnings

import torch

import fuser
from fuser import executor, graph_fuser, torch_ops
from fuser.cuda import launch

warnings.filterwarnings("ignore", category=DeprecationWarning)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def per_call_us(fn, *args, n=20000):
    for _ in range(200):
        fn(*args)
    _sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn(*args)
    _sync()
    return (time.perf_counter() - t0) / n * 1e6


def f(a, b, c):
    return a * b + c


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a, b, c = (torch.randn(1024, device=dev) for _ in range(3))
    ff = fuser.fuse(torch.jit.script(f))
    for _ in range(5):
        ff(a, b, c)
    key = next(graph_fuser.group_call_key(n) for n in ff.graph.nodes() if graph_fuser.is_group_call(n))
    spec = fuser.interface.STORE.get(key)
    ir_text = next(graph_fuser.group_call_args(n)[4].toIValue() for n in ff.graph.nodes()
                   if graph_fuser.is_group_call(n))
    geo = next(iter(spec.geometries.values()))
    out = [torch.empty(1024, device=dev)]
    rows = [
        ("eager a*b+c", per_call_us(f, a, b, c)),
        ("scripted fused call", per_call_us(ff, a, b, c)),
        ("torch.ops.fuser.fusion_group", per_call_us(torch.ops.fuser.fusion_group, [a, b, c], [], key,
                                                      spec.digest, ir_text)),
        ("torch_ops._fusion_group", per_call_us(torch_ops._fusion_group, [a, b, c], [], key, spec.digest,
                                                  ir_text)),
        ("executor.run", per_call_us(executor.run, spec, [a, b, c])),
        ("torch.empty", per_call_us(lambda: torch.empty(geo.shape, dtype=torch.float32, device=geo.device))),
    ]
    if dev == "cuda":
        k = geo.kernel.backend
        rows += [
            ("backend.launch", per_call_us(k.launch, geo, [a, b, c], (), out)),
            ("raw stream", per_call_us(launch._raw_stream, 0)),
            ("current device", per_call_us(launch._current_device)),
            ("cuLaunchKernel (ctypes)", per_call_us(k._do_launch, k._buffers(), 1, launch._raw_stream(0))),
        ]
        if k._raw_launch is not None:
            raw, k._raw_launch = k._raw_launch, None
            rows.append(("cuLaunchKernel (cuda-python)", per_call_us(k._do_launch, k._buffers(), 1, launch._raw_stream(0))))
            rows.append(("backend.launch (cuda-python)", per_call_us(k.launch, geo, [a, b, c], (), out)))
            k._raw_launch = raw
    for name, us in rows:
        print(f"{name:32s} {us:8.2f} us")


if __name__ == "__main__":
    main()
