"""Code generation: a pure function from (group IR, input descriptions, value types, target) to source.

No CUDA or compiler imports here, so every kernel's text can be generated and checked on any machine; the
backends (``fuser.cpu``, ``fuser.cuda``) compile what this returns.

Values are computed in their *compute* type (float for float16/bfloat16/float32, double for float64, the
integer type itself for integers and bool): float16/bfloat16 intermediates are held in float, as in the legacy
fuser. With ``KernelOptions.round_reduced`` (``settings.round_reduced``) the result of each op that is an eager op of
its own is rounded to its dtype before the next op reads it, as eager stores it; the steps of one decomposed eager op
(``ir.Node.origin``: batch norm, dropout, a backward) stay unrounded, as eager's single kernel holds them.

The package: ``common.py`` (options, value types, literals, layout facts) → ``body.py`` (:func:`generate`: one
statement per node) → ``cpu_vector.py`` (the CPU vector path's lines) → ``emit.py`` (the kernel text per target).
"""
from .body import generate
from .common import (CHEAP_OPS, CHEAP_WAVES, CPU_PARALLEL_MIN, CPU_PARALLEL_WORK, CPU_ROW_CHUNK, CPU_VECTORS_PER_TRIP,
                     HEAVY_WAVES, REDUCED, TARGETS, TILE_SCALAR, VECTOR_BYTES, KernelOptions, NodeTypes, NotFusable,
                     grid_waves, has_tiled_path, has_vector_path, literal, strided_operands, tile_shape, tiled_vector,
                     value_type, vector_width)
from .cpu_vector import VECTOR_TYPES, vector_ready, vector_template

__all__ = ["CHEAP_OPS", "CHEAP_WAVES", "HEAVY_WAVES", "CPU_PARALLEL_MIN", "CPU_PARALLEL_WORK", "CPU_ROW_CHUNK",
           "CPU_VECTORS_PER_TRIP", "REDUCED", "TARGETS", "TILE_SCALAR", "VECTOR_BYTES", "VECTOR_TYPES",
           "KernelOptions", "NodeTypes", "NotFusable", "generate", "grid_waves", "has_tiled_path", "has_vector_path",
           "literal", "strided_operands", "tile_shape", "tiled_vector", "value_type", "vector_ready",
           "vector_template", "vector_width"]
