"""Layouts through the torch.compile door: transposed, permuted, channels_last and broadcast inputs.

A region fuses when the strides its group gives its outputs (``fuser/layout.py``, TensorIterator's rule, from the
inputs' strides) are the strides eager gave them while Dynamo traced (``node.meta["val"]``); the refusal stays
where they would differ, and where sizes are symbolic (a non-contiguous output is then refused, no guard
installed). Checked against eager PyTorch on fresh inputs: output values and strides, gradients and their strides,
one group per graph; the groups' CUDA kernels through the host emulation; CUDA twins marked gpu."""
import pytest
import torch
import torch.nn.functional as F

import fuser
import fuser.dynamo  # noqa: F401 (registers backend="fuser")
from fuser import layout
from test_compile_backend import assert_every_compute_node_is_explained, assert_ran_fused, group_calls, recording


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def gelu_residual(x, b):
    return F.gelu(x) * torch.sigmoid(b) + b


def affine_relu(x, scale, shift):
    return torch.relu(x * scale + shift)


def _transposed(device, dtype):  # bench row gelu_transposed_residual's layout: x transposed, b contiguous
    return [torch.randn(40, 24, device=device, dtype=dtype).t(), torch.randn(24, 40, device=device, dtype=dtype)]


def _permuted(device, dtype):  # both 3-d inputs permuted, in different orders
    return [torch.randn(3, 4, 5, device=device, dtype=dtype).permute(2, 0, 1),
            torch.randn(5, 4, 3, device=device, dtype=dtype).permute(0, 2, 1)]


def _channels_last(device, dtype):  # bench row channels_last_affine_relu's layout
    return [torch.randn(2, 8, 5, 7, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last),
            torch.randn(8, 1, 1, device=device, dtype=dtype), torch.randn(8, 1, 1, device=device, dtype=dtype)]


def _broadcast(device, dtype):  # a transposed input with a broadcast row: the result follows the transpose
    return [torch.randn(24, 40, device=device, dtype=dtype).t(), torch.randn(24, device=device, dtype=dtype)]


def _expanded(device, dtype):  # an input expanded from a row (stride 0) and a column
    return [torch.randn(24, device=device, dtype=dtype).expand(40, 24), torch.randn(40, 1, device=device, dtype=dtype)]


# name: (function, inputs)
CASES = {
    "transposed": (gelu_residual, _transposed),
    "permuted": (gelu_residual, _permuted),
    "channels_last": (affine_relu, _channels_last),
    "broadcast": (gelu_residual, _broadcast),
    "expanded": (gelu_residual, _expanded),
}
PARAMS = [(name, dtype) for name in CASES for dtype in (torch.float32, torch.float16)]
IDS = [f"{name}-{str(dtype)[6:]}" for name, dtype in PARAMS]


def assert_like_eager(out, ref, ref64):
    """Eager's strides, and values as close to float64's as eager's are (a fused kernel rounds less, not more)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape and out.device == ref.device
    assert out.stride() == ref.stride(), (out.stride(), ref.stride())
    err, eager_err = (out.double() - ref64).abs().max().item(), (ref.double() - ref64).abs().max().item()
    assert err <= 4 * eager_err + 4 * torch.finfo(ref.dtype).eps * max(1.0, ref64.abs().max().item()), (err, eager_err)


def layout_reasons(graphs) -> list:
    return [why for *_, part, _ in graphs for why in part.left_out.values()
            if "strides" in why or "contiguous" in why]


def _check_forward(name, dtype, device):
    fn, make = CASES[name]
    args = make(device, dtype)
    compiled = torch.compile(fn, backend="fuser", dynamic=False)
    with recording() as graphs:
        out = compiled(*args)
    assert_like_eager(out, fn(*args), fn(*[a.double() for a in args]))
    [(kind, gm, part, specs)] = graphs
    assert kind.endswith("inference")
    assert len(part.regions) == 1 and group_calls(gm) == 1, [r.nodes for r in part.regions]
    assert not part.left_out, part.left_out  # every op of the function is in the one group
    assert_ran_fused(specs, device)
    again = make(device, dtype)  # the same layouts, new values: the cached plan
    assert_like_eager(compiled(*again), fn(*again), fn(*[a.double() for a in again]))


def _train_once(fn, inputs, grad_of):
    """Compiled forward and backward on leaves of ``inputs``' strides: (output, gradients, recorded graphs)."""
    leaves = [a.detach().requires_grad_() for a in inputs]  # detach keeps the strides
    torch._dynamo.reset()
    with recording() as graphs:
        out = torch.compile(fn, backend="fuser", dynamic=False)(*leaves)
        out.backward(grad_of(out))
    return out.detach(), [a.grad for a in leaves], graphs


def _regions(graphs) -> list:
    return [(kind.split()[-1], [[n.name for n in r.nodes] for r in part.regions]) for kind, _, part, _ in graphs]


def _check_backward(name, dtype, device):
    """Eager's output and gradients, values and strides; and the graphs fuse exactly as those of the same
    inputs made contiguous do (layouts cost no group), the forward as one group."""
    fn, make = CASES[name]
    inputs = make(device, dtype)
    eager_leaves = [a.detach().requires_grad_() for a in inputs]
    ref = fn(*eager_leaves)
    grad = torch.empty_like(ref).normal_()  # eager's strides
    ref.backward(grad)
    leaves64 = [a.detach().double().requires_grad_() for a in inputs]
    ref64 = fn(*leaves64)
    ref64.backward(grad.double())

    out, grads, graphs = _train_once(fn, inputs, lambda o: grad)
    assert_like_eager(out, ref.detach(), ref64.detach())
    for g, e, e64 in zip(grads, eager_leaves, leaves64):
        assert_like_eager(g, e.grad, e64.grad)
    assert [kind.split()[-1] for kind, *_ in graphs] == ["forward", "backward"]
    (_, fw, fw_part, fw_specs), (_, bw, bw_part, bw_specs) = graphs
    assert len(fw_part.regions) == 1 and group_calls(fw) == 1 and not fw_part.left_out
    assert bw_part.regions and group_calls(bw) == len(bw_part.regions)
    assert not layout_reasons(graphs), layout_reasons(graphs)
    # every group ran as a kernel, the row kernels summing a broadcast input's gradient included (a region whose
    # row-shaped output is no reduction's result would fall back on every call: the partition refuses it)
    assert_ran_fused(fw_specs + bw_specs, device)

    twin = [a.contiguous() for a in inputs]
    _, _, twin_graphs = _train_once(fn, twin, lambda o: grad.contiguous())
    assert _regions(graphs) == _regions(twin_graphs)


@pytest.mark.parametrize("name,dtype", PARAMS, ids=IDS)
def test_a_strided_region_is_one_group_with_eagers_strides(name, dtype):
    _check_forward(name, dtype, "cpu")


@pytest.mark.parametrize("name,dtype", PARAMS, ids=IDS)
def test_a_strided_region_trains_fused_with_eagers_gradients_and_strides(name, dtype):
    _check_backward(name, dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name,dtype", PARAMS, ids=IDS)
def test_a_strided_region_is_one_group_with_eagers_strides_cuda(name, dtype):
    _check_forward(name, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name,dtype", PARAMS, ids=IDS)
def test_a_strided_region_trains_fused_with_eagers_gradients_and_strides_cuda(name, dtype):
    _check_backward(name, dtype, "cuda")


def _random_like(v):
    """A CPU tensor of fresh random values with the sizes, strides and dtype of the fake value ``v``."""
    t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype)
    return t.normal_() if v.is_floating_point() else t.copy_(torch.rand(v.shape) > 0.5)


def test_the_strided_groups_run_as_cuda_kernels_in_the_host_emulation():
    """Each group of the door, forward and backward, through its CUDA kernel emulated on the host
    (fuser/cuda/emulate.py) on inputs of the strides it was traced with, against eager's ops: values and strides."""
    from fuser import fallback
    from fuser.cuda import emulate

    checked, strided = 0, 0
    for name in ("transposed", "channels_last", "broadcast"):
        fn, make = CASES[name]
        torch._dynamo.reset()
        leaves = [a.requires_grad_() for a in (t.detach() for t in make("cpu", torch.float32))]
        with recording() as graphs:
            out = torch.compile(fn, backend="fuser", dynamic=False)(*leaves)
            out.backward(torch.empty_like(out).normal_())
        for _, _, part, specs in graphs:
            for region, spec in zip(part.regions, specs):
                if spec.has_reduction:
                    continue  # row kernels: fuser/rows/emulate.py
                inputs = [_random_like(n.meta["val"]) for n in region.inputs]
                got = emulate.run_graph(spec.group, inputs)
                assert got is not None, spec.text
                for o, r, v in zip(got, fallback.evaluate(spec.group, inputs), [n.meta["val"] for n in region.outputs]):
                    assert o.stride() == r.stride() == v.stride(), (o.stride(), r.stride(), v.stride())
                    torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
                checked += 1
                strided += any(not t.is_contiguous() for t in inputs + got)
    assert checked >= 6 and strided >= 4, (checked, strided)


def test_a_region_whose_layouts_would_differ_from_eagers_is_refused_with_the_reason(monkeypatch):
    """Where the layout rule disagrees with the traced strides (here made to: contiguous outputs claimed), the
    region is refused with both strides named, and the graph runs eager's ops: eager's values and strides."""
    def contiguous_claim(group, args):
        return [(sz, layout.contiguous_strides(sz)) for sz, _ in real(group, args)]

    real = layout.group_layouts
    monkeypatch.setattr(layout, "group_layouts", contiguous_claim)
    x, b = _transposed("cpu", torch.float32)
    with recording() as graphs:
        out = torch.compile(gelu_residual, backend="fuser", dynamic=False)(x, b)
    ref = gelu_residual(x, b)
    assert out.stride() == ref.stride() and torch.equal(out, ref)
    [(_, gm, part, _)] = graphs
    assert not part.regions and group_calls(gm) == 0
    reasons = layout_reasons(graphs)
    named = (f"has strides {list(ref.stride())} as traced (eager's meta kernels), and the group would write "
             f"{list(layout.contiguous_strides(ref.shape))}")
    assert reasons and all(named in why for why in reasons), reasons


def test_symbolic_sizes_keep_the_contiguous_rule_without_a_guard():
    """Under dynamic=True a transposed input's strides are symbols: its region is refused (reading them would
    install a guard and recompile per size), with its reason; one compiled graph serves both sizes."""
    compiled = torch.compile(gelu_residual, backend="fuser", dynamic=True)
    with recording() as graphs:
        for n in (40, 56):
            x, b = torch.randn(n, 24).t(), torch.randn(24, n)
            out = compiled(x, b)
            ref = gelu_residual(x, b)
            assert out.stride() == ref.stride()
            torch.testing.assert_close(out, ref)
    assert len(graphs) == 1  # one graph for both sizes
    [(_, _, part, _)] = graphs
    assert not part.regions
    assert any("with symbolic sizes" in why for why in layout_reasons(graphs)), part.left_out


def test_a_channels_last_conv_block_fuses_as_its_contiguous_twin():
    """A conv block on channels_last tensors (eval batch norm, ReLU): the pointwise ops after the conv fuse as they
    do on contiguous tensors, with channels_last outputs; every other compute node has its reason."""
    block = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).eval()
    x = torch.randn(2, 3, 6, 6)
    made = {}
    for fmt in (torch.channels_last, torch.contiguous_format):
        torch._dynamo.reset()
        model, inp = block.to(memory_format=fmt), x.contiguous(memory_format=fmt)
        with torch.no_grad(), recording() as graphs:
            out = torch.compile(model, backend="fuser", dynamic=False)(inp)
            ref = model(inp)
        assert out.stride() == ref.stride() and out.is_contiguous(memory_format=fmt)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        [(_, gm, part, specs)] = graphs
        assert part.regions and group_calls(gm) == len(part.regions)
        assert_ran_fused(specs)
        assert_every_compute_node_is_explained(graphs)
        assert not layout_reasons(graphs), layout_reasons(graphs)
        made[fmt] = _regions(graphs)
    assert made[torch.channels_last] == made[torch.contiguous_format]
