"""Thread block clusters in the CUDA host emulation (fuser.cuda.emulate, host_prelude.CLUSTER): hand-written
cluster kernels (valid CUDA: NVRTC compiles them for sm_90) run against torch, and the faults a cluster kernel
can have on a GPU are reported."""
import ctypes
from string import Template

import pytest
import torch

from fuser.cuda import emulate, host_prelude, templates

BLOCK = 64
N_CLUSTERS = 3  # clusters per launch
ARGS = """
struct FzArgs {
  int n;
  void* ptrs[2];
};
"""


class _Args(ctypes.Structure):
    _fields_ = [("n", ctypes.c_int32), ("ptrs", ctypes.c_void_p * 2)]


_TREE = """  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (t < s) tile[t] += tile[t + s];
    __syncthreads();
  }
  if (t == 0) fz_cluster_put(&slot, tile[0]);
  fz_cluster_sync();
"""
# a layer norm of each cluster's row (a block of the input per CTA): the row's sum and then its sum of squared
# deviations, each a tree of barriers per CTA and every CTA's part read from every CTA in rank order. ${free}: the
# cluster barrier that keeps a CTA from putting the second part while another still reads the first
_NORM = Template(r"""
extern "C" __global__ void __cluster_dims__(${cluster}, 1, 1) __launch_bounds__(64) ${name}(const FzArgs args) {
  __shared__ ${t} tile[64];
  __shared__ ${t} slot;
  const unsigned t = threadIdx.x;
  const unsigned n = ${cluster} * blockDim.x;
  const ${t} x = ((const ${t}*)args.ptrs[0])[blockIdx.x * blockDim.x + t];
  tile[t] = x;
${tree}  ${t} sum = 0;
  for (unsigned r = 0; r < ${cluster}; ++r) sum += fz_cluster_get(&slot, r);
  const ${t} d = x - sum / (${t})n;
${free}  tile[t] = d * d;
${tree}  ${t} squares = 0;
  for (unsigned r = 0; r < ${cluster}; ++r) squares += fz_cluster_get(&slot, r);
  ((${t}*)args.ptrs[1])[blockIdx.x * blockDim.x + t] = d / sqrt(squares / (${t})n + (${t})1e-5);
  fz_cluster_sync();  // no CTA exits while another reads its slot
}
""")
_TYPES = {torch.float32: "float", torch.float64: "double"}
CLUSTERS = (1, 2, 4)


def _norm(dtype, cluster, free=True):
    name = f"fz_test_cluster_norm_{_TYPES[dtype]}_{cluster}" + ("" if free else "_unfreed")
    return name, _NORM.substitute(name=name, cluster=cluster, t=_TYPES[dtype], tree=_TREE,
                                  free="  fz_cluster_sync();\n" if free else "")


# kernels of clusters of 2 that a GPU runs wrong, and what the emulation's report says of each
_FAULT = Template(r"""
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(64) ${name}(const FzArgs args) {
  __shared__ float slot;
  const unsigned t = threadIdx.x, rank = fz_cluster_rank();
  float* out = (float*)args.ptrs[1] + blockIdx.x * blockDim.x + t;
${body}}
""")
FAULTS = {
    # no cluster barrier at the end: a CTA reads the other's shared memory, which may be gone (the CTA that the
    # emulation runs second reads the first's: CTA 0's in the first round, CTA 1's in the second)
    "fz_test_cluster_read_after_exit": (
        """  if (t == 0) fz_cluster_put(&slot, (float)rank);
  fz_cluster_sync();
  *out = fz_cluster_get(&slot, 1 - rank);
""", r"reads the shared memory of CTA (0 \(block 0\)|1 \(block 1\)), which has exited \(kernel "
     r"fz_test_cluster_read_after_exit, block [01]\)"),
    "fz_test_cluster_barrier_not_reached": (
        """  if (rank == 1 && t == 3) return;
  fz_cluster_sync();
  *out = 1.f;
""", r"fz_cluster_sync\(\) waits for threads that have returned, among them thread 3 "
     r"\(kernel fz_test_cluster_barrier_not_reached, block 1\)"),
    "fz_test_cluster_never_put": (
        """  if (rank == 0 && t == 0) fz_cluster_put(&slot, 1.f);
  fz_cluster_sync();
  *out = fz_cluster_get(&slot, 1);
  fz_cluster_sync();
""", r"reads a slot that CTA 1 never put \(kernel fz_test_cluster_never_put, block [01]\)"),
    "fz_test_cluster_rank_past_the_cluster": (
        """  if (t == 0) fz_cluster_put(&slot, 1.f);
  fz_cluster_sync();
  *out = fz_cluster_get(&slot, 2);
  fz_cluster_sync();
""", r"reads CTA 2 of a cluster of 2"),
    "fz_test_cluster_mixed_barriers": (
        """  if (t == 0) fz_cluster_sync();
  else __syncthreads();
  *out = 1.f;
""", r"__syncthreads\(\) waits for threads that wait at the cluster barrier"),
}

KERNELS = ([_norm(dtype, cluster) for dtype in _TYPES for cluster in CLUSTERS] + [_norm(torch.float64, 2, False)] +
           [(name, _FAULT.substitute(name=name, body=body)) for name, (body, _) in FAULTS.items()])
SOURCES = {name: templates.PRELUDE + templates.CLUSTER + ARGS + text for name, text in KERNELS}


@pytest.fixture(scope="module")
def emulator():
    em = emulate.Emulator()
    for name, source in SOURCES.items():
        em.add(name, source)
    em.compile_pending()
    yield em
    em.close()


def _run(em, name, x: torch.Tensor, cluster: int, grid: int) -> torch.Tensor:
    """Launch ``name`` on ``grid`` blocks of :data:`BLOCK` threads in clusters of ``cluster``, input ``x``, an
    output like it (fake addresses stand for the tensors)."""
    args = _Args(x.numel(), (ctypes.c_void_p * 2)(0x10000, 0x90000))
    data = x.contiguous().view(torch.uint8).numpy().tobytes()
    out, = em.run(name, grid, BLOCK, bytes(args), [(0x10000, len(data), data), (0x90000, len(data), None)],
                  cluster=cluster)
    return torch.frombuffer(bytearray(out), dtype=x.dtype).view(x.shape)


@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("dtype", tuple(_TYPES), ids=str)
def test_a_row_reduced_across_the_cluster_matches_torch(emulator, dtype, cluster):
    """Several clusters per grid, each a row of its own; float and double slots; __syncthreads between the
    cluster barriers (with 1, fz_cluster_sync is a barrier of the one CTA)."""
    name, _ = _norm(dtype, cluster)
    x = torch.randn(N_CLUSTERS, cluster * BLOCK, dtype=dtype)
    out = _run(emulator, name, x, cluster, N_CLUSTERS * cluster)
    want = torch.nn.functional.layer_norm(x.double(), (cluster * BLOCK,), eps=1e-5).to(dtype)
    torch.testing.assert_close(out, want)


def test_a_missing_cluster_barrier_shows_as_a_race(emulator):
    """Without the barrier between the two parts, CTA 0 puts its second part before CTA 1 has read its first."""
    name, _ = _norm(torch.float64, 2, free=False)
    x = torch.randn(N_CLUSTERS, 2 * BLOCK, dtype=torch.float64) + 3  # no row's sum is near its sum of squares
    out = _run(emulator, name, x, 2, 2 * N_CLUSTERS)
    want = torch.nn.functional.layer_norm(x, (2 * BLOCK,), eps=1e-5)
    assert not torch.allclose(out, want)


@pytest.mark.parametrize("kernel", FAULTS)
def test_cluster_faults_are_reported(emulator, kernel):
    x = torch.zeros(4 * BLOCK)
    with pytest.raises(emulate.EmulationError, match=FAULTS[kernel][1]):
        _run(emulator, kernel, x, 2, 4)
    # the server starts again for the next launch
    name, _ = _norm(torch.float32, 2)
    assert not _run(emulator, name, torch.randn(2, 2 * BLOCK), 2, 4).isnan().any()


@pytest.mark.parametrize("grid,cluster", [(3, 2), (4, 0), (32, 32)])
def test_a_cluster_size_the_launch_cannot_have_is_an_error(emulator, grid, cluster):
    name, _ = _norm(torch.float32, 2)
    with pytest.raises(emulate.EmulationError, match=f"launched on {grid} blocks in clusters of {cluster}: "):
        _run(emulator, name, torch.zeros(grid * BLOCK), cluster, grid)


def test_the_host_source_swaps_the_cluster_primitives_once():
    name, _ = _norm(torch.float32, 2)
    host = emulate.host_source(SOURCES[name])
    assert templates.CLUSTER not in host and host.count(host_prelude.CLUSTER) == 1
    with pytest.raises(ValueError, match="CLUSTER at most once"):
        emulate.host_source(SOURCES[name] + templates.CLUSTER)


def test_cluster_kernels_are_cuda():
    from fuser.cuda import driver
    for name, source in SOURCES.items():
        driver.compile_source(source, name, driver.NvrtcOptions(90))
