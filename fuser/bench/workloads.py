"""The benchmark's workloads: TorchScript-compatible sources, their input shapes per size, and the
functions each cell builds from them."""
from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Workload:
    """One benchmark function: TorchScript-compatible source and how to make its inputs."""

    name: str
    source: str  # defines one function named ``name``; valid as both Python and TorchScript
    shapes: dict  # size name ("large", "small", "quick") -> shape parameters for make_inputs
    make_inputs: Callable[[tuple, torch.dtype, torch.device], list]
    train: bool = False  # time forward + backward: gradients of every floating input for random output grads
    random: bool = False  # draws random numbers: outputs are checked for shape and dtype, not values
    dtypes: tuple = DTYPES


def _randn(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=device)


WORKLOADS = (
    Workload(
        "mul_add",
        "def mul_add(a: Tensor, b: Tensor, c: Tensor) -> Tensor:\n"
        "    return a * b + c\n",
        {"large": (2 ** 26,), "small": (1024,), "quick": (2 ** 16,)},
        lambda s, dt, dev: [_randn(s, dt, dev) for _ in range(3)],
    ),
    Workload(
        "gelu_bias",
        "def gelu_bias(x: Tensor, b: Tensor) -> Tensor:\n"
        "    y = x + b\n"
        "    return 0.5 * y * (1 + torch.tanh(0.7978845608 * (y + 0.044715 * y * y * y)))\n",
        {"large": (16384, 4096), "small": (8, 128), "quick": (256, 256)},
        lambda s, dt, dev: [_randn(s, dt, dev), _randn(s[1:], dt, dev)],
    ),
    Workload(
        "lstm_cell",
        "def lstm_cell(gates: Tensor, cx: Tensor) -> Tuple[Tensor, Tensor]:\n"
        "    ingate, forgetgate, cellgate, outgate = gates.chunk(4, 1)\n"
        "    ingate = torch.sigmoid(ingate)\n"
        "    forgetgate = torch.sigmoid(forgetgate)\n"
        "    cellgate = torch.tanh(cellgate)\n"
        "    outgate = torch.sigmoid(outgate)\n"
        "    cy = forgetgate * cx + ingate * cellgate\n"
        "    hy = outgate * torch.tanh(cy)\n"
        "    return hy, cy\n",
        # (batch, hidden): gates are batch x 4*hidden, cx batch x hidden
        {"large": (16384, 2048), "small": (8, 32), "quick": (256, 128)},
        lambda s, dt, dev: [_randn((s[0], 4 * s[1]), dt, dev), _randn(s, dt, dev)],
    ),
    Workload(
        "silu_scale",
        "def silu_scale(x: Tensor, s: float) -> Tensor:\n"
        "    return x * torch.sigmoid(x) * s\n",
        {"large": (2 ** 26,), "small": (1024,), "quick": (2 ** 16,)},
        lambda s, dt, dev: [_randn(s, dt, dev), 1.7],
    ),
)


WORKLOADS += (
    Workload(
        "dropout_residual",
        "def dropout_residual(x: Tensor, bias: Tensor, residual: Tensor) -> Tensor:\n"
        "    return bias + (torch.rand_like(x) > 0.1).type_as(x) * x * (1.0 / 0.9) + residual\n",
        {"large": (16384, 4096), "small": (8, 128), "quick": (256, 256)},
        lambda s, dt, dev: [_randn(s, dt, dev), _randn(s[1:], dt, dev), _randn(s, dt, dev)],
        random=True,
    ),
)
_GELU_SRC = WORKLOADS[1].source.replace("def gelu_bias(", "def gelu_bias_train(")
_LSTM_SRC = WORKLOADS[2].source.replace("def lstm_cell(", "def lstm_cell_train(")
WORKLOADS += (
    Workload("gelu_bias_train", _GELU_SRC, WORKLOADS[1].shapes, WORKLOADS[1].make_inputs, train=True,
             dtypes=(torch.float32, torch.bfloat16)),
    Workload("lstm_cell_train", _LSTM_SRC, WORKLOADS[2].shapes, WORKLOADS[2].make_inputs, train=True,
             dtypes=(torch.float32, torch.bfloat16)),
)


def _as_list(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _train_step(fn: Callable) -> Callable:
    """fn's forward and backward: the inputs' gradients for the output gradients passed last."""
    def step(*args):
        inputs, grad_outputs = args[:-1], args[-1]
        wrt = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
        return torch.autograd.grad(_as_list(fn(*inputs)), wrt, grad_outputs)
    return step


def _python_function(wl: Workload) -> Callable:
    """A fresh Python function object from the workload's source (fresh code, so torch.compile's caches,
    keyed on the code object, start empty)."""
    namespace = {"torch": torch, "Tensor": torch.Tensor, "Tuple": typing.Tuple}
    exec(compile(wl.source, f"<fuser.bench:{wl.name}>", "exec"), namespace)
    return namespace[wl.name]


def _script_function(wl: Workload) -> torch.jit.ScriptFunction:
    """A fresh ScriptFunction: a new CompilationUnit each time, so no executor state (profiled shapes,
    legacy ArgumentSpecs, torch.jit.script's per-function cache) carries over between cells."""
    return getattr(torch.jit.CompilationUnit(wl.source), wl.name)


# issue 10 (layouts): a transposed view, the same beside a contiguous residual (the tensors disagree on their fastest
# dim), a column and a row vector broadcast together, a float16/bfloat16 tensor plus a float32 bias, and a
# channels_last conv activation. Broadcast operands are passed small (the copy floor counts their bytes once). The
# channels_last row is ResNet-50's first stage at batch 64 (51M elements, near the other rows' 67M): at batch 32 a
# 2-byte call moved 103 MB in about 25 us on an H200, where a kernel's ramp and tail weighed (fuser 0.86-0.88 of the
# copy floor there, 0.92-0.93 at batch 64, 0.95-0.97 at 128; 2026-11-29).
def _transposed(shape, dtype, device):
    return _randn(shape[::-1], dtype, device).t()


WORKLOADS += (
    Workload(
        "gelu_bias_transposed",
        WORKLOADS[1].source.replace("def gelu_bias(", "def gelu_bias_transposed("),
        {"large": (16384, 4096), "small": (8, 128), "quick": (256, 256)},
        lambda s, dt, dev: [_transposed(s, dt, dev), _randn(s[1:], dt, dev)],
    ),
    Workload(
        "gelu_transposed_residual",  # b: a full-size residual here
        WORKLOADS[1].source.replace("def gelu_bias(", "def gelu_transposed_residual("),
        {"large": (16384, 4096), "small": (8, 128), "quick": (256, 256)},
        lambda s, dt, dev: [_transposed(s, dt, dev), _randn(s, dt, dev)],
    ),
    Workload(
        "outer_affine",
        "def outer_affine(x: Tensor, col: Tensor, row: Tensor) -> Tensor:\n"
        "    return x * col + row\n",
        {"large": (16384, 4096), "small": (8, 128), "quick": (256, 256)},
        lambda s, dt, dev: [_randn(s, dt, dev), _randn((s[0], 1), dt, dev), _randn(s[1:], dt, dev)],
    ),
    Workload(
        "reduced_plus_float_bias",
        "def reduced_plus_float_bias(x: Tensor, b: Tensor) -> Tensor:\n"
        "    return torch.relu(x + b)\n",
        {"large": (16384, 4096), "small": (8, 128), "quick": (256, 256)},
        lambda s, dt, dev: [_randn(s, dt, dev), _randn(s[1:], torch.float32, dev)],
        dtypes=(torch.float16, torch.bfloat16),
    ),
    Workload(
        "channels_last_affine_relu",
        "def channels_last_affine_relu(x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:\n"
        "    return torch.relu(x * scale + shift)\n",
        {"large": (64, 256, 56, 56), "small": (2, 8, 7, 7), "quick": (4, 32, 14, 14)},
        lambda s, dt, dev: [_randn(s, dt, dev).contiguous(memory_format=torch.channels_last),
                            _randn((s[1], 1, 1), dt, dev), _randn((s[1], 1, 1), dt, dev)],
    ),
)


# ---- issue 12: normalizations (row kernels, fuser/rows/), forward. The normalized shape is a constant of the
# source (the TorchScript pass fuses a layer_norm/rms_norm whose normalized_shape is one), so each row length is a
# workload of its own, its sizes sharing the row length: [16384 x 4096] (no suffix), and rows of 512, 16384 and
# 65536 elements at about the same element count (2^26). Each normalization comes with the pointwise op real models
# put next to it (attention's scale; the weight, or weight and bias, applied outside the norm, as Hugging Face's
# RMSNorm and T5's layer norm do): a normalization alone is eager's one kernel, which the pass leaves to eager
# (graph_fuser.MIN_GROUP_KERNELS).
_ROW_LENGTHS = {"": (16384, 4096), "_r512": (131072, 512), "_r16k": (4096, 16384), "_r64k": (1024, 65536)}
_NORM_SOURCES = {
    "softmax_scale": "def {name}(x: Tensor) -> Tensor:\n"
                     "    return torch.softmax(x * 0.125, -1)\n",
    "layer_norm_affine": "def {name}(x: Tensor, w: Tensor, b: Tensor) -> Tensor:\n"
                         "    return torch.layer_norm(x, [{cols}], None, None, 1e-5) * w + b\n",
    "rms_norm_weight": "def {name}(x: Tensor, w: Tensor) -> Tensor:\n"
                       "    return torch.rms_norm(x, [{cols}], None, 1e-6) * w\n",
}
_NORM_VECTORS = {"softmax_scale": 0, "layer_norm_affine": 2, "rms_norm_weight": 1}  # vectors of the row length


def _norm_inputs(n_vectors: int) -> Callable:
    return lambda s, dt, dev: [_randn(s, dt, dev)] + [_randn(s[1:], dt, dev) for _ in range(n_vectors)]


def _norm_shapes(rows: int, cols: int) -> dict:
    return {"large": (rows, cols), "small": (8, cols), "quick": (max(2, 2 ** 18 // cols), cols)}


# the workloads of this block: their groups run as row kernels (tests/test_normalizations.py emulates them; the
# pointwise emulation of tests/test_cuda_emulated.py takes the others)
ROW_WORKLOADS = frozenset([f"{op}{suffix}" for op in _NORM_SOURCES for suffix in _ROW_LENGTHS]
                          + ["bias_residual_layer_norm"])
WORKLOADS += tuple(
    Workload(f"{op}{suffix}", src.format(name=f"{op}{suffix}", cols=cols), _norm_shapes(rows, cols),
             _norm_inputs(_NORM_VECTORS[op]), dtypes=(torch.float32, torch.bfloat16))
    for op, src in _NORM_SOURCES.items() for suffix, (rows, cols) in _ROW_LENGTHS.items()
) + (
    Workload(
        "bias_residual_layer_norm",
        "def bias_residual_layer_norm(x: Tensor, bias: Tensor, residual: Tensor, w: Tensor, b: Tensor) -> Tensor:\n"
        "    return torch.layer_norm(x + bias + residual, [4096], w, b, 1e-5)\n",
        _norm_shapes(16384, 4096),
        lambda s, dt, dev: [_randn(s, dt, dev), _randn(s[1:], dt, dev), _randn(s, dt, dev), _randn(s[1:], dt, dev),
                            _randn(s[1:], dt, dev)],
        dtypes=(torch.float32, torch.bfloat16),
    ),
)


# ---- issue 12: normalizations forward + backward (fuser/derivatives.py's softmax, layer_norm and rms_norm: the
# backward a row group of its own, reading the row statistics the forward saved). The forward rows' sources above,
# as training steps: gradients of x and of the weight and bias vectors (those summed over the rows: inside the
# backward row kernel, fuser/rows/passes.py's column sum form, or by a column kernel, fuser/grad_sums.py, where the row
# takes several trips on CUDA), at [16384 x 4096] and rows of 512, 16384 and 65536 elements.
NORM_TRAIN_WORKLOADS = tuple(
    Workload(f"{op}{suffix}_train", src.format(name=f"{op}{suffix}_train", cols=cols), _norm_shapes(rows, cols),
             _norm_inputs(_NORM_VECTORS[op]), train=True, dtypes=(torch.float32, torch.bfloat16))
    for op, src in _NORM_SOURCES.items() for suffix, (rows, cols) in _ROW_LENGTHS.items()
)
WORKLOADS += NORM_TRAIN_WORKLOADS


# ---- issue 12: outer reductions (column kernels, fuser/rows/outer*.py). A sum over dim 0 with its pointwise
# prologue: a bias gradient's form, [16384 x 4096] -> [4096]. Its copy floor (fuser/bench/rows.py) is the inputs read
# once and the output written: the reduction's one pass reads each element once, and the column results are small.
OUTER_WORKLOADS = frozenset(["sum0_mul"])
ROW_WORKLOADS = ROW_WORKLOADS | OUTER_WORKLOADS  # (groups with reductions: tests/test_normalizations.py emulates them)
WORKLOADS += (
    Workload(
        "sum0_mul",
        "def sum0_mul(x: Tensor, y: Tensor) -> Tensor:\n"
        "    return (x * y).sum(0)\n",
        _norm_shapes(16384, 4096),
        lambda s, dt, dev: [_randn(s, dt, dev), _randn(s, dt, dev)],
        dtypes=(torch.float32, torch.bfloat16),
    ),
)
