"""Code generation for the row kernels: (group, input dtypes, node types, target) → C++ or CUDA source.

The package: ``analysis.py`` (what a row or column kernel decides about its values: accumulator types, the
float16/bfloat16 values rounded as eager stores them, centered means, rooted variances, the inputs' names) →
``sum_slots.py`` (where a CUDA row kernel keeps its column sums) → ``cpu_vector.py`` (the CPU kernel's at::vec
loops) → ``kernel.py`` (:func:`generate`: the passes along the row and the kernel text per target, with the CPU
kernel's thresholds).
"""
from .analysis import (accumulator_type, centered_means, input_names, rooted_variances, rounded_operands,
                       stores_rounded)
from .kernel import (CPU_KEPT_OPS, CPU_MAX_PARTS, CPU_MIN_PARTS, CPU_PARALLEL_WORK, CPU_PART_ROWS, CPU_PART_WORK,
                     generate)
from .sum_slots import block_parts, trip_slot, trip_slot_chunk

__all__ = ["CPU_KEPT_OPS", "CPU_MAX_PARTS", "CPU_MIN_PARTS", "CPU_PARALLEL_WORK", "CPU_PART_ROWS", "CPU_PART_WORK",
           "accumulator_type", "block_parts", "centered_means", "generate", "input_names", "rooted_variances",
           "rounded_operands", "stores_rounded", "trip_slot", "trip_slot_chunk"]
