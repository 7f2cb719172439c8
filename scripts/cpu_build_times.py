"""CPU kernel build times, each in a fresh process over one cache directory: the first vector kernel on a machine
(the at::vec header precompiled first), a cold kernel (header precompiled, kernel not cached), a second kernel in
that warm process, and both kernels again from the disk cache in a new process.

    python scripts/cpu_build_times.py [--repeats 3]

Build time is ``CompiledKernel.build_ms``: type probe, codegen, compile (or disk-cache load) and load.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, sys, time, torch, fuser
from fuser import ts_ir
from fuser.cpu import compiler
from fuser.kernel_cache import STORE
GELU = '''graph(%x : Tensor, %b : Tensor):
  %one : int = prim::Constant[value=1]()
  %c0 : float = prim::Constant[value=0.5]()
  %c1 : float = prim::Constant[value=0.044715]()
  %c2 : float = prim::Constant[value=0.7978845608]()
  %y : Tensor = aten::add(%x, %b, %one)
  %y3 : Tensor = aten::mul(%y, %y)
  %y4 : Tensor = aten::mul(%y3, %y)
  %t : Tensor = aten::mul(%y4, %c1)
  %u : Tensor = aten::add(%y, %t, %one)
  %v : Tensor = aten::mul(%u, %c2)
  %w : Tensor = aten::tanh(%v)
  %z : Tensor = aten::add(%w, %one, %one)
  %h : Tensor = aten::mul(%y, %c0)
  %r : Tensor = aten::mul(%h, %z)
  return (%r)'''
SILU = '''graph(%x : Tensor, %s : float):
  %a : Tensor = aten::sigmoid(%x)
  %b : Tensor = aten::mul(%x, %a)
  %r : Tensor = aten::mul(%b, %s)
  return (%r)'''
out = {}
t0 = time.perf_counter()
tc = compiler.toolchain()
out["toolchain_s"] = time.perf_counter() - t0
for name in sys.argv[1].split(","):
    ir, args = (GELU, [torch.randn(64, 256), torch.randn(256)]) if name == "gelu" else (SILU, [torch.randn(4096), 1.5])
    key = STORE.register(ts_ir.lower(torch.parse_ir(ir)))
    fuser.run_fusion(key, args)
    kernel = next(k for k in STORE.get(key).kernels().values() if k is not None)
    out[name] = {"build_ms": kernel.build_ms, "vector": compiler.is_vector_source(kernel.source)}
out["compiled"] = fuser.n_compiled_kernels()
print(json.dumps(out))
"""


def child(cache: str, kernels: str) -> dict:
    env = dict(os.environ, FUSER_CACHE_DIR=cache, PYTHONPATH=ROOT)
    env.pop("FUSER_DISABLE_CACHE", None)
    r = subprocess.run([sys.executable, "-c", CHILD, kernels], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(r.stderr)
    return json.loads(r.stdout.splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    rows: dict[str, list[float]] = {}

    def note(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="fuser-build-times-") as cache:
            first = child(cache, "gelu")
            note("first use on a machine: header precompiled (ms)", first["toolchain_s"] * 1e3)
            note("  then its first kernel (ms)", first["gelu"]["build_ms"])
            cold = child(cache, "silu")
            note("cold kernel: new process, header on disk (ms)", cold["silu"]["build_ms"])
            note("  before it, the header's digest checked (ms)", cold["toolchain_s"] * 1e3)
            warm = child(cache, "silu,gelu")  # silu from disk; gelu compiled, but after silu in the process
            note("warm disk: kernel loaded in a new process (ms)", warm["silu"]["build_ms"])
            assert warm["compiled"] == 0, warm
        with tempfile.TemporaryDirectory(prefix="fuser-build-times-") as cache:
            child(cache, "gelu")  # the header precompiled, GELU cached
            warm = child(cache, "gelu,silu")  # GELU from disk first: the process and its toolchain warm
            note("warm process: a new kernel after another (ms)", warm["silu"]["build_ms"])
    for name, values in rows.items():
        print(f"{name:50s} median {statistics.median(values):8.1f}   runs {', '.join(f'{v:.1f}' for v in values)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
