"""bie.BatchNormAct(recompute=True) after a bie binary conv2d (or linear layer): y (the
layer's output) is not kept for the backward but computed again there by its C layer
(bie_layer_forward_again). Every output and gradient equals the run that keeps y, bit for
bit (CPU float32; CUDA float32 / bfloat16, NCHW and channels-last; odd shapes, batch 1,
stride 2); the saved tensors shrink by y; where y is not a conv's output as it returned it,
y is kept as before; a layer that ran another forward before this backward is restored from
its kept inputs or fails as its own backward would; and on CUDA a captured step replays as
the eager one does."""

import copy

import pytest
import torch
from torch import nn

import bie

try:
    bie._lib.function("bie_layer_forward_again")
except bie.BieError:
    pytest.skip("this libbie has no bie_layer_forward_again", allow_module_level=True)


def _cuda_ok():
    return (torch.cuda.is_available() and bie.cuda_built()
            and bie._lib.lib().bie_cuda_device_count() > 0)


needs_cuda = pytest.mark.skipif(not _cuda_ok(), reason="needs a CUDA device and a CUDA build")


class Unit(nn.Module):
    """bn(conv(x), res=x): a binary residual unit (identity shortcut)."""

    def __init__(self, c, stride, recompute, device, dtype, keep_inputs=False):
        super().__init__()
        self.conv = bie.BinaryConv2dCutlass(c, c, 3, stride=stride, padding=1, device=device,
                                            dtype=dtype, keep_inputs=keep_inputs)
        self.bn = bie.BatchNormAct(c, recompute=recompute, device=device)
        self.pool = nn.AvgPool2d(2) if stride == 2 else nn.Identity()
        with torch.no_grad():  # random affine parameters and slopes (some negative)
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-0.3, 0.3)
            self.bn.slope.uniform_(-0.3, 0.6)

    def forward(self, x):
        return self.bn(self.conv(x), self.pool(x))


def _pair(c, stride, device, dtype, keep_inputs=False):
    """Two identical units: y kept, and y computed again."""
    units = []
    for recompute in (False, True):
        torch.manual_seed(5)
        u = Unit(c, stride, recompute, device, dtype, keep_inputs)
        bie.prepare_bie_layers(u)
        units.append(u)
    return units


def _saved_elements(fn):
    """(fn's result, elements of the distinct storages autograd saved while it ran)."""
    seen = {}

    def pack(t):
        storage = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
        seen[storage.data_ptr()] = t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _step(unit, x, steps=2):
    """Training steps on x (new values each step); the outputs, x's gradients and the
    parameters' gradients of the last one, and the saved elements of its forward."""
    gen = torch.Generator().manual_seed(9)
    for _ in range(steps):
        unit.zero_grad(set_to_none=True)
        xs = (torch.randn(x.shape, generator=gen) * 1.5).to(device=x.device, dtype=x.dtype)
        xs = xs.contiguous(memory_format=torch.channels_last
                           if x.is_contiguous(memory_format=torch.channels_last)
                           and not x.is_contiguous() else torch.contiguous_format)
        xs.requires_grad_()
        out, saved = _saved_elements(lambda: unit(xs))
        out.float().square().sum().backward()
    grads = [p.grad for p in unit.parameters()]
    return out.detach(), xs.grad, grads, saved


def _check_same(a, b):
    assert torch.equal(a[0], b[0])
    assert torch.equal(a[1], b[1])
    assert len(a[2]) == len(b[2])
    for g, h in zip(a[2], b[2]):
        assert (g is None) == (h is None)
        if g is not None:
            assert torch.equal(g, h)


CASES = [  # (n, c, h, w, stride)
    (1, 3, 5, 7, 1), (2, 8, 6, 6, 2), (3, 17, 9, 4, 1), (2, 64, 8, 8, 1)]


@pytest.mark.parametrize("n,c,h,w,stride", CASES)
def test_cpu_recompute_is_bit_for_bit_and_saves_y(n, c, h, w, stride):
    kept, again = _pair(c, stride, "cpu", torch.float32)
    x = torch.empty(n, c, h, w)
    a, b = _step(kept, x), _step(again, x)
    _check_same(a, b)
    y_elements = a[0].numel()
    assert a[3] - b[3] == y_elements  # y (the conv output) no longer saved


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("n,c,h,w,stride", CASES)
def test_cuda_recompute_is_bit_for_bit_and_saves_y(dtype, channels_last, n, c, h, w, stride):
    kept, again = _pair(c, stride, "cuda", dtype)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.empty(n, c, h, w, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
    a, b = _step(kept, x), _step(again, x)
    _check_same(a, b)
    assert a[3] - b[3] == a[0].numel()


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32)] + (
    [("cuda", torch.bfloat16), ("cuda", torch.float32)] if _cuda_ok() else []))
@pytest.mark.parametrize("m,k,n", [(2, 5, 3), (7, 33, 17), (16, 64, 40)])
def test_binary_linear_recompute(device, dtype, m, k, n):
    """bn(linear(x)) on [N, C]: y computed again by the binary linear layer, bit for bit."""
    def run(recompute):
        torch.manual_seed(2)
        lin = bie.BinaryLinearCutlass(k, n, device=device, dtype=dtype)
        bie.prepare_bie_layers(lin)
        bn = bie.BatchNormAct(n, recompute=recompute, device=device)
        with torch.no_grad():
            bn.slope.uniform_(-0.3, 0.6)
        gen = torch.Generator().manual_seed(4)
        x = (torch.randn(m, k, generator=gen) * 1.5).to(device=device, dtype=dtype)
        x.requires_grad_()
        out, saved = _saved_elements(lambda: bn(lin(x)))
        out.float().square().sum().backward()
        grads = [p.grad for p in list(lin.parameters()) + list(bn.parameters())]
        return out.detach(), x.grad, grads, saved

    a, b = run(False), run(True)
    _check_same(a, b)
    assert a[3] - b[3] == a[0].numel()


def test_y_not_straight_from_a_conv_is_kept():
    """y = conv(x) * 1 (another producer) and a y of a non-binary source: kept as before,
    same results."""
    torch.manual_seed(1)
    conv = bie.BinaryConv2dCutlass(4, 4, 3, padding=1)
    bie.prepare_bie_layers(conv)
    bn = bie.BatchNormAct(4, recompute=True)
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    out, saved = _saved_elements(lambda: bn(conv(x) * 1.0, x))
    out.sum().backward()
    twin = copy.deepcopy(bn)
    twin.recompute = False
    y = torch.randn(2, 4, 5, 5, requires_grad=True)
    (o1, s1), (o2, s2) = (_saved_elements(lambda: m(y, None)) for m in (bn, twin))
    assert torch.equal(o1, o2) and s1 == s2


def test_a_later_forward_through_the_conv():
    """The conv ran another forward before the backward: restored from its kept inputs
    (keep_inputs=True) and bit for bit; without them the backward raises, as the conv's own
    backward does."""
    def twice(unit):
        gen = torch.Generator().manual_seed(3)
        x1, x2 = (torch.randn(2, 6, 5, 5, generator=gen).requires_grad_() for _ in range(2))
        out = unit(x1) + unit(x2)
        out.square().sum().backward()
        return out.detach(), x1.grad, x2.grad, [p.grad for p in unit.parameters()]

    kept, again = _pair(6, 1, "cpu", torch.float32, keep_inputs=True)
    a, b = twice(kept), twice(again)
    for s, t in zip(a[:3], b[:3]):
        assert torch.equal(s, t)
    _check_same((a[0], a[1], a[3]), (b[0], b[1], b[3]))
    _, lost = _pair(6, 1, "cpu", torch.float32)
    with pytest.raises(bie.BieError, match="keep_inputs"):
        twice(lost)


def test_module_repr_and_default():
    assert bie.BatchNormAct(3).recompute is False
    assert "recompute=True" in repr(bie.BatchNormAct(3, recompute=True))
    assert bie.BatchNormAct.from_modules(nn.BatchNorm2d(3), recompute=True).recompute
    assert not bie.BatchNormAct.from_modules(nn.BatchNorm2d(3), nn.PReLU(3)).recompute


@needs_cuda
def test_cuda_graph_capture_with_recompute():
    """A unit's forward and backward captured in a CUDA graph with y computed again: each
    replay gives what an eager step of an identical unit gives, bit for bit."""
    unit, twin = _pair(16, 1, "cuda", torch.bfloat16)
    twin.bn.recompute = True
    static_x = torch.randn(4, 16, 8, 8, device="cuda", dtype=torch.bfloat16).contiguous(
        memory_format=torch.channels_last).requires_grad_()

    def step(u, x):
        u.zero_grad(set_to_none=True)
        x.grad = None
        out = u(x)
        out.float().square().sum().backward()
        return out

    unit.bn.recompute = True
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(unit, static_x)
            step(twin, static_x.detach().clone().requires_grad_())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    unit.zero_grad(set_to_none=True)
    static_x.grad = None
    with torch.cuda.graph(graph):
        static_out = unit(static_x)
        static_out.float().square().sum().backward()
    for _ in range(3):
        with torch.no_grad():
            static_x.copy_(torch.randn_like(static_x))
        graph.replay()
        x = static_x.detach().clone().requires_grad_()
        out = step(twin, x)
        torch.cuda.synchronize()
        assert torch.equal(static_out, out)
        assert torch.equal(static_x.grad, x.grad)
        compared = 0
        for (name, p), q in zip(unit.named_parameters(), twin.parameters()):
            if p.grad is not None:  # (the int8 weight's gradient is set outside autograd)
                assert torch.equal(p.grad, q.grad), name
                compared += 1
        assert compared >= 5  # bias_a, scale_a and the batch norm's three
