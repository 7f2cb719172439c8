"""Where a CUDA row kernel keeps its column sums: one partial row a block or a row of the block
(:func:`block_parts`), and the layout of a long row's trip sums' slots in shared memory (:func:`trip_slot_chunk`,
:func:`trip_slot`)."""
from __future__ import annotations


def block_parts(shape) -> bool:
    """Whether a CUDA row kernel with column sums writes one partial row a block (its rows' shared slots added
    first: ``templates.CUDA_PARTS_STORE_BLOCK``) rather than one a row of the block (``launch.part_layout``)."""
    return shape.sums_shared and shape.block > shape.tpr


def trip_slot_chunk(shape, acc_type: str) -> int:
    """Sums a thread adds to its trip sums' slots at once (``CudaShape.trip_sums``): its vector of an item's sums
    where that is 16 bytes or less, else 16 bytes of it, each 16-byte chunk k of the vectors in a region of its own
    (k * span / chunks + its vector's index * chunk), so that a warp's adds touch consecutive 16-byte slots (a
    thread's 8 float sums as one 32-byte vector: 9.06M shared-memory bank conflicts against 249k, a layer_norm
    backward of rows of 16384 bfloat16 elements, ncu, H200)."""
    size = 8 if acc_type == "double" else 4
    return min(shape.vec, max(1, 16 // size))


def trip_slot(shape, acc_type: str, chunk: str, vector: str) -> str:
    """The first trip-sums slot of 16-byte chunk ``chunk`` of vector ``vector`` of a row's sums (C expressions), in
    :func:`trip_slot_chunk`'s layout: chunk k of every vector in a region of its own."""
    q = trip_slot_chunk(shape, acc_type)
    return f"{chunk} * (fz_span / {shape.vec // q}) + {vector} * {q}"
