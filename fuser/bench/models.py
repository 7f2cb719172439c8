"""``python -m fuser.bench --models``: the model zoo timed end to end, eager vs TorchScript+NNC vs fuser vs
torch.compile.

Models: Hugging Face transformers built from configs in place (random weights, no download): GPT-2, BERT,
ViT, ConvNeXt, ResNet, MobileNetV2. On CUDA at realistic sizes (the configs' defaults: GPT-2 small, BERT
base, ViT-B/16, ConvNeXt-T, ResNet-50, MobileNetV2 1.0; batch 8, 128 tokens or 224x224 images); on the CPU
(and with ``--quick``) at the zoo's tiny sizes (tests/test_models.py), where host time dominates.

Systems: ``eager`` (the module), ``ts_nnc`` (stock ``torch.jit.trace``, TorchScript's profiling executor
with its defaults, i.e. NNC on CUDA), ``fuser`` (``torch.jit.trace`` under ``fuser.install()``) and
``compile`` (``torch.compile`` defaults). Eval mode, ``torch.no_grad()``, float32 (``--dtype`` for others).

Method: each system's first call is checked against eager's output (max abs error relative to max |eager|)
and timed (fuser's includes its kernel builds); then warm-up calls past the profiling executor's profiled
runs and for ``warmup_s`` more; then ``runs`` single forwards, each timed by CUDA events around it (CPU:
time.perf_counter), in ``rounds`` rounds that take each system in turn (these forwards are host-bound, and the
machines' host speed drifts over minutes: timed one system after another, the same code moved 30-60% between
runs), reported as the median in ms per forward. fuser's row also gives its fusion groups. On a
shared CPU, run with ``OMP_NUM_THREADS=1``: intra-op threads beyond the CPU quota stall for whole scheduler
periods (about 100 ms), which swamps millisecond forwards.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

import fuser

from .timing import _sync, elapsed_ms

SYSTEMS = ("eager", "ts_nnc", "fuser", "compile")
_PROFILED_RUNS = torch._C._jit_get_num_profiled_runs()


@dataclass(frozen=True)
class Timing:
    warmup: int
    warmup_s: float
    runs: int
    rounds: int


FULL = Timing(warmup=max(5, _PROFILED_RUNS + 3), warmup_s=1.0, runs=60, rounds=6)
QUICK = Timing(warmup=max(3, _PROFILED_RUNS + 2), warmup_s=0.05, runs=6, rounds=2)


class _ReturnTuple(torch.nn.Module):
    """A Hugging Face model called with ``return_dict=False`` (a tuple of tensors, which trace accepts)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor):
        return self.model(x, return_dict=False)


def _tiny(name: str) -> dict:
    return {
        "gpt2": dict(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=16, bos_token_id=0,
                     eos_token_id=0),
        "bert": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
                     vocab_size=100, max_position_embeddings=16),
        "vit": dict(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=37),
        "convnext": dict(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, image_size=16),
        "resnet": dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic"),
        "mobilenetv2": dict(image_size=16, depth_multiplier=0.25),
    }[name]


MODELS = ("gpt2", "bert", "vit", "convnext", "resnet", "mobilenetv2")


def build(name: str, small: bool, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, tuple]:
    """The model (eval mode, on ``device`` in ``dtype``) and one input batch."""
    import transformers
    transformers.logging.set_verbosity_error()
    classes = {"gpt2": ("GPT2Model", "GPT2Config"), "bert": ("BertModel", "BertConfig"),
               "vit": ("ViTModel", "ViTConfig"), "convnext": ("ConvNextModel", "ConvNextConfig"),
               "resnet": ("ResNetModel", "ResNetConfig"), "mobilenetv2": ("MobileNetV2Model", "MobileNetV2Config")}
    model_cls, config_cls = (getattr(transformers, c) for c in classes[name])
    kwargs = _tiny(name) if small else {}
    if name == "gpt2":
        kwargs["use_cache"] = False
    torch.manual_seed(0)
    model = _ReturnTuple(model_cls(config_cls(**kwargs))).eval().to(device=device, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    batch = 2 if small else 8
    if name in ("gpt2", "bert"):
        x = torch.randint(0, model.model.config.vocab_size, (batch, 8 if small else 128), generator=g)
    else:
        size = 16 if small else 224
        x = torch.randn(batch, 3, size, size, generator=g).to(dtype)
    return model, (x.to(device),)


@contextlib.contextmanager
def _installed() -> Iterator[None]:
    fuser.install()
    try:
        yield
    finally:
        fuser.uninstall()


def make(name: str, model: torch.nn.Module, inputs: tuple) -> tuple[Callable, Callable]:
    """(the callable ``name`` makes of ``model``, traced on ``inputs`` where it traces; a factory of the context
    that system's calls run in: fuser's calls run installed, the others' not, so that NNC takes only ts_nnc's)."""
    if name == "eager":
        return model, contextlib.nullcontext
    if name == "ts_nnc":
        return torch.jit.trace(model, inputs, check_trace=False), contextlib.nullcontext
    if name == "fuser":
        fuser.native.ensure(block=True)  # steady state: the hot path loaded (a first build runs in a thread)
        with _installed():
            return torch.jit.trace(model, inputs, check_trace=False), _installed
    if name == "compile":
        return torch.compile(model), contextlib.nullcontext
    raise ValueError(f"unknown system {name!r} (choose from {', '.join(SYSTEMS)})")


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _tensors(o)] if isinstance(out, (tuple, list)) else []


def rel_error(out, ref) -> float:
    """Largest |out - ref| over all output tensors relative to max |ref|, in float64 (inf if they differ in number)."""
    a, e = _tensors(out), _tensors(ref)
    if len(a) != len(e):
        return float("inf")
    worst = 0.0
    for x, y in zip(a, e):
        scale = float(y.double().abs().max()) if y.numel() else 1.0
        worst = max(worst, float((x.double() - y.double()).abs().max()) / max(scale, 1e-30) if y.numel() else 0.0)
    return worst


def warm_up(fn: Callable, inputs: tuple, device: torch.device, timing: Timing) -> None:
    """Calls past the profiling executor's profiled runs, then for ``timing.warmup_s`` more."""
    for _ in range(timing.warmup):
        fn(*inputs)
    _sync(device)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timing.warmup_s:
        fn(*inputs)
        _sync(device)


def _n_groups(fn) -> Optional[int]:
    graph = getattr(fn, "graph", None)
    if graph is None:
        return None
    from .. import graph_fuser
    return sum(1 for n in graph_fuser._all_nodes(graph.block()) if graph_fuser.is_group_call(n))


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"


def run_model(name: str, systems: list[str], small: bool, device: torch.device, dtype: torch.dtype,
              timing: Timing) -> list[dict]:
    """One model under every system: each its own copy of the model, its first call (checked against eager's
    output) and warm-up; then ``timing.rounds`` rounds that time ``timing.runs // timing.rounds`` single forwards
    of each system in turn (so that a slow spell of the machine falls on every system alike); per system the
    median ms per forward, fuser's groups; or the error a system raised."""
    torch._dynamo.reset()
    model, inputs = build(name, small, device, dtype)
    with torch.no_grad():
        ref = model(*inputs)
    cells, live = {}, {}
    for s in systems:
        cell = cells[s] = {"model": name, "system": s}
        t0 = time.perf_counter()
        try:
            m, inp = (model, inputs) if s == "eager" else build(name, small, device, dtype)
            with torch.no_grad():
                fn, settings = make(s, m, inp)
                with settings():
                    _sync(device)
                    t = time.perf_counter()
                    out = fn(*inp)
                    _sync(device)
                    cell["first_call_ms"] = (time.perf_counter() - t) * 1e3
                    cell["rel_error"] = rel_error(out, ref)
                    warm_up(fn, inp, device, timing)
            live[s] = (fn, inp, settings)
            if s == "fuser":
                cell["groups"] = _n_groups(fn)
        except Exception as e:  # a failing system records its error; the run goes on
            cell["error"] = _error(e)
        print(f"  {name:<12} {s:<8} {time.perf_counter() - t0:6.1f}s  {cell.get('error', '')}", file=sys.stderr)
    samples = {s: [] for s in live}
    for _ in range(timing.rounds):
        for s, (fn, inp, settings) in list(live.items()):
            try:
                with torch.no_grad(), settings():
                    samples[s] += [elapsed_ms(lambda: fn(*inp), device) for _ in range(timing.runs // timing.rounds)]
            except Exception as e:
                cells[s]["error"] = _error(e)
                del live[s]
    for s in live:
        cells[s]["ms"] = statistics.median(samples[s])
        cells[s]["samples_ms"] = samples[s]
    live.clear()
    torch._dynamo.reset()
    return [cells[s] for s in systems]


def _cell_text(cell: dict) -> str:
    if "error" in cell:
        return "error"
    text = f"{cell['ms']:.3f}"
    if cell.get("rel_error", 0) > 1e-3:
        text += " (!)"
    return text


def format_table(rows: list[dict], systems) -> str:
    """ms per forward, a row per model and a column per system, and fuser's group count."""
    head = ["model"] + list(systems) + ["fuser groups"]
    lines = [head]
    for model in dict.fromkeys(r["model"] for r in rows):
        cells = {r["system"]: r for r in rows if r["model"] == model}
        groups = cells.get("fuser", {}).get("groups")
        lines.append([model] + [_cell_text(cells[s]) if s in cells else "-" for s in systems]
                     + ["-" if groups is None else str(groups)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    """Called by :func:`fuser.bench.cli.main` for ``--models``; uses its --device, --quick, --only, --systems, --json.
    Exits 1 when any system raised on any model (the table says ``error``, and the error is printed below it)."""
    device = torch.device(args.device)
    small = args.quick or device.type == "cpu"
    timing = QUICK if args.quick else FULL
    dtype = getattr(torch, args.dtype)
    systems = [s for s in args.systems if s in SYSTEMS] or list(SYSTEMS)
    models = [m for m in MODELS if args.only in m]
    rows, started = [], time.perf_counter()
    for name in models:
        rows += run_model(name, systems, small, device, dtype, timing)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    size = "tiny configs, batch 2" if small else "default configs, batch 8 (128 tokens / 224x224)"
    print(f"\n{device_name}, torch {torch.__version__}, {args.dtype}, {size}: ms per forward (median of "
          f"{timing.runs} {'CUDA-event' if device.type == 'cuda' else 'perf_counter'}-timed forwards after warm-up, in "
          f"{timing.rounds} rounds over the systems); "
          "(!) marks an output off eager's by more than 1e-3 relative\n")
    print(format_table(rows, systems))
    for r in rows:
        if "error" in r:
            print(f"  {r['model']} / {r['system']}: {r['error']}")
    print(f"\ntotal {time.perf_counter() - started:.1f}s")
    with open(args.json, "w") as f:
        json.dump({"meta": {"device": device_name, "torch": torch.__version__, "dtype": args.dtype,
                            "size": size, "timing": timing.__dict__},
                   "rows": rows}, f, indent=1, default=str)
    print(f"wrote {args.json}")
    return 1 if any("error" in r for r in rows) else 0  # scripts/gpu_check.sh fails a zoo model that raised
