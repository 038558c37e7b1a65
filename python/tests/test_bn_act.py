"""bie.BatchNormAct / bie.batch_norm_act (bie_bn_act_forward / _backward, bie.h §7) against
PyTorch's composition ``F.prelu(bn(y) + res, slope)`` with an ``nn.BatchNorm{1,2,3}d`` holding
the same parameters, computed in float64 from the same (float32-rounded) inputs: outputs,
gradients of y, res, weight, bias and slope, running statistics after several training steps,
inference; shapes with N = 1, C = 1, 3, 17, [N, C] and [N, C, L] inputs, NCHW and channels
last, no residual, no activation, one shared slope, momentum None. Then dtypes and layouts
the package converts, state dicts shared with nn.BatchNorm2d, torch.compile, errors (which
change nothing), and on CUDA (skipped without a device) bfloat16 / float16, autocast and a
CUDA-graph capture of forward + backward."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bie
from bie import _compile

try:
    bie._lib.function("bie_bn_act_forward")
except bie.BieError:
    pytest.skip("this libbie has no bie_bn_act_forward", allow_module_level=True)

_BN = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


def _cuda_ok():
    return (torch.cuda.is_available() and bie.cuda_built()
            and bie._lib.lib().bie_cuda_device_count() > 0)


def _module(c, prelu=True, prelu_parameters=None, momentum=0.1, device=None, seed=0):
    """A BatchNormAct with random affine parameters and slopes (some negative)."""
    m = bie.BatchNormAct(c, momentum=momentum, prelu=prelu, prelu_parameters=prelu_parameters,
                         device=device)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m.weight.copy_(torch.randn(c, generator=gen) * 0.5 + 1)
        m.bias.copy_(torch.randn(c, generator=gen) * 0.3)
        if m.slope is not None:
            m.slope.copy_(torch.rand(m.slope.shape, generator=gen) - 0.3)
    return m


class Reference:
    """F.prelu(bn(y) + res, slope) in float64 with copies of a BatchNormAct's state."""

    def __init__(self, m, ndim):
        self.bn = _BN[ndim](m.num_features, eps=m.eps, momentum=m.momentum).double()
        self.bn.load_state_dict({k: v.detach().cpu().double() if v.is_floating_point() else
                                 v.detach().cpu() for k, v in m.state_dict().items()
                                 if k != "slope"})
        self.slope = (None if m.slope is None
                      else m.slope.detach().cpu().double().clone().requires_grad_())
        self.bn.train(m.training)

    def __call__(self, y, res):
        z = self.bn(y)
        if res is not None:
            z = z + res
        return z if self.slope is None else F.prelu(z, self.slope)

    def zero_grad(self):
        self.bn.zero_grad(set_to_none=True)
        if self.slope is not None:
            self.slope.grad = None

    def train(self, mode):
        self.bn.train(mode)


def _close(got, want, tol, what):
    got = got.detach().double().cpu()
    want = want.detach().double().cpu()
    assert got.shape == want.shape, what
    err = (got - want).abs().max().item() if got.numel() else 0.0
    scale = 1.0 + (want.abs().max().item() if want.numel() else 0.0)
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol:.3g} x {scale:.3g}"


def _inputs(shape, channels_last, with_res, device=None, dtype=torch.float32, gen=None):
    y = torch.randn(shape, generator=gen) * 1.5 + 0.4
    res = torch.randn(shape, generator=gen) if with_res else None
    y = y.to(device=device, dtype=dtype)
    res = None if res is None else res.to(device=device, dtype=dtype)
    if channels_last:
        y = y.contiguous(memory_format=torch.channels_last)
        res = None if res is None else res.contiguous(memory_format=torch.channels_last)
    y.requires_grad_()
    if res is not None:
        res.requires_grad_()
    return y, res


def _step_and_compare(m, ref, shape, channels_last, with_res, tol, device=None,
                      dtype=torch.float32, gen=None):
    """One forward + backward of m and of the reference on the same (rounded) inputs;
    compares output, its format and dtype, and every gradient."""
    y, res = _inputs(shape, channels_last, with_res, device, dtype, gen)
    yd = y.detach().double().cpu().requires_grad_()
    rd = None if res is None else res.detach().double().cpu().requires_grad_()
    m.zero_grad(set_to_none=True)
    ref.zero_grad()
    out = m(y, res)
    want = ref(yd, rd)
    assert out.dtype == dtype and out.shape == y.shape
    if channels_last:
        assert out.is_contiguous(memory_format=torch.channels_last)
    else:
        assert out.is_contiguous()
    _close(out, want, tol, "output")
    g = torch.randn(shape, generator=gen).to(dtype)
    out.backward(g.to(device))
    want.backward(g.double())
    _close(y.grad, yd.grad, tol, "grad y")
    assert y.grad.dtype == dtype
    if channels_last:
        assert y.grad.is_contiguous(memory_format=torch.channels_last)
    if res is not None:
        _close(res.grad, rd.grad, tol, "grad res")
    _close(m.weight.grad, ref.bn.weight.grad, tol, "grad weight")
    _close(m.bias.grad, ref.bn.bias.grad, tol, "grad bias")
    if m.slope is not None:
        _close(m.slope.grad, ref.slope.grad, tol, "grad slope")
    return out


def _compare_stats(m, ref, tol):
    _close(m.running_mean, ref.bn.running_mean, tol, "running_mean")
    _close(m.running_var, ref.bn.running_var, tol, "running_var")
    assert int(m.num_batches_tracked) == int(ref.bn.num_batches_tracked)


CASES = [  # shape, channels_last, res, prelu, prelu_parameters, momentum
    ((4, 3, 5, 5), False, True, True, None, 0.1),
    ((4, 3, 5, 5), True, True, True, None, 0.1),
    ((1, 17, 3, 4), False, True, True, None, 0.1),  # N = 1
    ((1, 17, 3, 4), True, False, True, 1, 0.1),  # N = 1, channels last, no res, shared slope
    ((6, 1, 4, 4), False, True, True, None, None),  # one channel, cumulative average
    ((2, 17, 5, 3), True, True, False, None, None),  # channels last, no activation
    ((8, 3), False, True, True, None, 0.1),  # [N, C]
    ((8, 17), False, False, False, None, None),
    ((2, 1), False, True, True, 1, 0.2),  # [N, C] with N = 2, C = 1
    ((5, 3, 7), False, True, True, 1, 0.3),  # [N, C, L]
    ((2, 3, 2, 3, 2), False, True, True, None, 0.1),  # 5-D: runs as [N, C, D*H*W]
]


@pytest.mark.parametrize("shape,channels_last,with_res,prelu,prelu_parameters,momentum", CASES)
def test_matches_torch_composition(shape, channels_last, with_res, prelu, prelu_parameters,
                                   momentum):
    m = _module(shape[1], prelu, prelu_parameters, momentum)
    ref = Reference(m, len(shape))
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):  # training: batch statistics, running ones updated
        _step_and_compare(m, ref, shape, channels_last, with_res, 2e-5, gen=gen)
    _compare_stats(m, ref, 1e-5)
    m.eval()
    ref.train(False)
    before = [b.clone() for b in m.buffers()]
    _step_and_compare(m, ref, shape, channels_last, with_res, 2e-5, gen=gen)  # inference
    for b, a in zip(m.buffers(), before):
        assert torch.equal(b, a)  # eval() changes no running statistic


def test_channels_last_matches_nchw():
    """The [N*H*W, C, 1] reading of channels-last memory gives NCHW's results (to the rounding
    of the per-channel sums, which the two layouts add in different orders)."""
    m = _module(5)
    twin = copy.deepcopy(m)
    y, res = _inputs((3, 5, 4, 6), False, True)
    yc = y.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    rc = res.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    out, outc = m(y, res), twin(yc, rc)
    assert outc.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(outc, out, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(out)
    out.backward(g)
    outc.backward(g)
    for a, b in ((y.grad, yc.grad), (res.grad, rc.grad), (m.weight.grad, twin.weight.grad),
                 (m.bias.grad, twin.bias.grad), (m.slope.grad, twin.slope.grad),
                 (m.running_mean, twin.running_mean), (m.running_var, twin.running_var)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_converted_inputs():
    """res of another dtype and memory format, y neither contiguous nor channels last: the
    results of the converted inputs, in y's dtype and format; gradients in the inputs'."""
    m = _module(4)
    twin = copy.deepcopy(m)
    base = torch.randn(4, 3, 5, 6)
    y = base.permute(1, 0, 2, 3).detach().requires_grad_()  # [3, 4, 5, 6], neither layout
    assert not y.is_contiguous() and not y.is_contiguous(memory_format=torch.channels_last)
    res = torch.randn(3, 4, 5, 6, dtype=torch.float64).contiguous(
        memory_format=torch.channels_last).requires_grad_()
    out = m(y, res)
    assert out.dtype == torch.float32 and out.is_contiguous()
    y2 = y.detach().contiguous().requires_grad_()
    r2 = res.detach().float().contiguous().requires_grad_()
    want = twin(y2, r2)
    assert torch.equal(out, want)
    out.sum().backward()
    want.sum().backward()
    assert torch.equal(y.grad, y2.grad)
    assert res.grad.dtype == torch.float64 and torch.equal(res.grad, r2.grad.double())
    # channels-last y with a contiguous float64 res: the output is channels last
    y3 = y2.detach().contiguous(memory_format=torch.channels_last)
    out3 = copy.deepcopy(twin)(y3, res.detach().contiguous())
    assert out3.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 2e-5), (torch.bfloat16, 3e-2),
                                       (torch.float16, 4e-3)])
def test_cpu_dtypes_compute_in_float32(dtype, tol):
    m = _module(3)
    ref = Reference(m, 4)
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        _step_and_compare(m, ref, (2, 3, 4, 4), False, True, tol, dtype=dtype, gen=gen)
    _compare_stats(m, ref, tol)


def test_module_in_float64():
    """A module converted with .double(): float64 parameters and running statistics (computed
    in float32, the statistics copied back), float64 gradients."""
    m = _module(3).double()
    ref = Reference(m, 4)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        _step_and_compare(m, ref, (3, 3, 4, 4), False, True, 2e-5, dtype=torch.float64,
                          gen=gen)
    assert m.weight.grad.dtype == torch.float64 and m.running_mean.dtype == torch.float64
    _compare_stats(m, ref, 1e-5)


def test_autocast_cpu():
    """Under CPU autocast the conv output is bfloat16 and the parameters float32."""
    conv = nn.Conv2d(3, 6, 3, padding=1, bias=False)
    m = _module(6)
    x = torch.randn(2, 3, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = conv(x)
        out = m(y, y)
    assert y.dtype == torch.bfloat16 and out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert conv.weight.grad is not None and m.weight.grad.dtype == torch.float32
    ref = Reference(_module(6), 4)
    yd = y.detach().double()
    _close(out, ref(yd, yd), 3e-2, "autocast output")


def test_no_grad_inference_is_the_same_call():
    m = _module(4)
    y, res = _inputs((3, 4, 3, 3), False, True)
    m.eval()
    with torch.no_grad():
        a = m(y, res)
    b = m(y, res)
    assert a.grad_fn is None and b.grad_fn is not None and torch.equal(a, b)


def test_functional():
    """No affine parameters, no running statistics: training with the batch statistics."""
    y = torch.randn(6, 5, 3, 2, requires_grad=True)
    slope = torch.full((1,), 0.1, requires_grad=True)
    out = bie.batch_norm_act(y, None, None, None, slope, None, None, True, 0.1, 1e-3)
    yd = y.detach().double().requires_grad_()
    sd = slope.detach().double().requires_grad_()
    want = F.prelu(F.batch_norm(yd, None, None, training=True, eps=1e-3), sd)
    _close(out, want, 2e-5, "output")
    g = torch.randn_like(y)
    out.backward(g)
    want.backward(g.double())
    _close(y.grad, yd.grad, 2e-5, "grad y")
    _close(slope.grad, sd.grad, 2e-5, "grad slope")
    # momentum None with an int count: the cumulative average
    rm, rv = torch.zeros(5), torch.ones(5)
    bie.batch_norm_act(y.detach(), None, None, None, None, rm, rv, True, None,
                       num_batches_tracked=2)
    yd = y.detach().double()
    mean = yd.mean((0, 2, 3))
    var = yd.var((0, 2, 3), unbiased=True)
    _close(rm, mean / 2, 1e-6, "cumulative mean")
    _close(rv, (1 + var) / 2, 1e-6, "cumulative var")


def test_state_dict_shared_with_batchnorm2d():
    m = _module(6)
    bn = nn.BatchNorm2d(6)
    bie_keys = set(m.state_dict())
    assert bie_keys - {"slope"} == set(bn.state_dict())
    y = torch.randn(4, 6, 3, 3)
    m(y)
    m(y)
    bn.load_state_dict({k: v for k, v in m.state_dict().items() if k != "slope"})
    assert int(bn.num_batches_tracked) == 2
    twin = bie.BatchNormAct(6)
    missing = twin.load_state_dict(bn.state_dict(), strict=False)
    assert list(missing.missing_keys) == ["slope"] and not missing.unexpected_keys
    for k, v in bn.state_dict().items():
        assert torch.equal(twin.state_dict()[k], v)


def test_from_modules():
    torch.manual_seed(3)
    bn = nn.BatchNorm2d(5, momentum=None)
    prelu = nn.PReLU(5, init=0.1)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
        prelu.weight.uniform_(-0.2, 0.4)
    bn(torch.randn(4, 5, 3, 3))  # running statistics and a count
    m = bie.BatchNormAct.from_modules(bn, prelu)
    assert m.momentum is None and m.training and int(m.num_batches_tracked) == 1
    y, res = torch.randn(4, 5, 3, 3), torch.randn(4, 5, 3, 3)
    bn_ref, prelu_ref = copy.deepcopy(bn).double(), copy.deepcopy(prelu).double()
    _close(m(y, res), prelu_ref(bn_ref(y.double()) + res.double()), 2e-5, "from_modules")
    _close(m.running_var, bn_ref.running_var, 1e-5, "running_var")
    bn.eval()
    plain = bie.BatchNormAct.from_modules(bn)
    assert plain.slope is None and not plain.training
    _close(plain(y), bn.double()(y.double()), 2e-5, "no activation")
    with pytest.raises(ValueError):
        bie.BatchNormAct.from_modules(nn.BatchNorm2d(3, track_running_stats=False))


def test_module_basics():
    m = bie.BatchNormAct(7, prelu_parameters=1, prelu_init=0.2)
    assert m.slope.shape == (1,) and m.slope.detach().item() == pytest.approx(0.2)
    assert [n for n, _ in m.named_parameters()] == ["weight", "bias", "slope"]
    assert [n for n, _ in m.named_buffers()] == ["running_mean", "running_var",
                                                 "num_batches_tracked"]
    assert "prelu_parameters=1" in repr(m)
    assert bie.BatchNormAct(3, prelu=False).slope is None
    m2 = copy.deepcopy(m)
    m2(torch.randn(3, 7))
    assert int(m2.num_batches_tracked) == 1 and int(m.num_batches_tracked) == 0


# ------------------------------------------------------------------ errors


def _snapshot(m):
    return [t.detach().clone() for t in list(m.parameters()) + list(m.buffers())]


def _unchanged(m, before):
    for t, b in zip(list(m.parameters()) + list(m.buffers()), before):
        assert torch.equal(t, b)


@pytest.mark.parametrize("training", [True, False])
def test_channel_mismatch_raises_and_changes_nothing(training):
    m = _module(3, momentum=None)
    m(torch.randn(4, 3, 2, 2))
    m.train(training)
    before = _snapshot(m)
    with pytest.raises(bie.BieError) as info:
        m(torch.randn(2, 4, 5, 5))
    assert info.value.status_name == "BIE_ERR_SHAPE"
    _unchanged(m, before)
    with pytest.raises(bie.BieError) as info:
        m(torch.randn(2, 3, 5, 5), torch.randn(2, 3, 5, 4))  # res of another shape
    assert info.value.status_name == "BIE_ERR_SHAPE"
    _unchanged(m, before)


def test_bad_arguments_raise_and_change_nothing():
    m = _module(3)
    before = _snapshot(m)
    with pytest.raises(bie.BieError, match="at least 2"):
        m(torch.randn(1, 3))  # one value a channel in training (nn.BatchNorm1d: ValueError)
    with pytest.raises(bie.BieError, match="rank"):
        m(torch.randn(3))
    with pytest.raises(bie.BieError, match="momentum"):
        bie.BatchNormAct(3, momentum=1.5)(torch.randn(4, 3))
    with pytest.raises(bie.BieError, match="eps"):
        bie.BatchNormAct(3, eps=0.0)(torch.randn(4, 3))
    with pytest.raises(bie.BieError):
        m(torch.randint(0, 5, (4, 3)))  # not floating point
    _unchanged(m, before)
    with pytest.raises(bie.BieError, match="running"):  # inference needs running statistics
        bie.batch_norm_act(torch.randn(4, 3), training=False)
    with pytest.raises(bie.BieError, match="num_batches_tracked"):
        bie.batch_norm_act(torch.randn(4, 3), None, None, None, None, torch.zeros(3),
                           torch.ones(3), True, None)
    with pytest.raises(ValueError):
        bie.BatchNormAct(3, prelu_parameters=2)
    with pytest.raises(ValueError):
        bie.BatchNormAct(0)


# ------------------------------------------------------------------ torch.compile

needs_compile = pytest.mark.skipif(
    not _compile.AVAILABLE or not hasattr(torch, "compile"),
    reason="needs torch >= 2.4 (torch.library.custom_op)")


class Block(nn.Module):
    def __init__(self, momentum=0.1, device=None):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1, bias=False, device=device)
        self.norm = _module(4, momentum=momentum, device=device)

    def forward(self, x):
        return self.norm(self.conv(x), x)


@needs_compile
def test_compile_one_graph():
    torch._dynamo.reset()
    explained = torch._dynamo.explain(Block())(torch.randn(2, 4, 6, 6))
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


@needs_compile
@pytest.mark.parametrize("momentum,channels_last", [(0.1, False), (None, True)])
def test_compile_matches_eager(momentum, channels_last):
    torch._dynamo.reset()
    torch.manual_seed(2)
    eager = Block(momentum)
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, backend="aot_eager")
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    for step in range(3):
        x = torch.randn(3, 4, 6, 6).contiguous(memory_format=fmt)
        outs = []
        for model in (eager, compiled):
            model.zero_grad(set_to_none=True)
            out = model(x)
            out.square().sum().backward()
            outs.append(out.detach())
        assert torch.equal(outs[0], outs[1]), step
        for (name, p), q in zip(eager.named_parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad), (step, name)
        for (name, b), c in zip(eager.named_buffers(), twin.buffers()):
            assert torch.equal(b, c), (step, name)
    eager.eval()
    twin.eval()
    x = torch.randn(3, 4, 6, 6)
    with torch.no_grad():
        assert torch.equal(eager(x), compiled(x))


# ------------------------------------------------------------------ CUDA

needs_cuda = pytest.mark.skipif(not _cuda_ok(),
                                reason="needs a CUDA device and a libbie with the CUDA backend")


@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2),
                                       (torch.float16, 4e-3)])
@pytest.mark.parametrize("shape,channels_last,with_res,prelu,prelu_parameters,momentum", [
    ((4, 3, 5, 5), False, True, True, None, 0.1),
    ((4, 17, 6, 5), True, True, True, None, None),
    ((1, 3, 3, 4), True, False, True, 1, 0.1),
    ((16, 64, 8, 8), True, True, True, None, 0.1),  # vectorised rows
    ((16, 64, 8, 8), False, True, False, None, 0.1),  # vectorised planes
    ((32, 17), False, True, True, None, 0.1),
    ((5, 3, 7), False, False, True, 1, 0.3),
])
def test_cuda_matches_torch_composition(dtype, tol, shape, channels_last, with_res, prelu,
                                        prelu_parameters, momentum):
    m = _module(shape[1], prelu, prelu_parameters, momentum, device="cuda")
    ref = Reference(m, len(shape))
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        _step_and_compare(m, ref, shape, channels_last, with_res, tol, "cuda", dtype, gen)
    _compare_stats(m, ref, 1e-4)
    m.eval()
    ref.train(False)
    _step_and_compare(m, ref, shape, channels_last, with_res, tol, "cuda", dtype, gen)


@needs_cuda
def test_cuda_autocast():
    conv = nn.Conv2d(8, 8, 3, padding=1, bias=False, device="cuda")
    m = _module(8, device="cuda")
    x = torch.randn(4, 8, 6, 6, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = conv(x)
        out = m(y, x)  # res float32, converted to y's bfloat16
    assert y.dtype == torch.bfloat16 and out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    assert m.weight.grad.dtype == torch.float32 and conv.weight.grad is not None
    ref = Reference(_module(8), 4)
    _close(out, ref(y.detach().double().cpu(), x.to(torch.bfloat16).double().cpu()), 3e-2,
           "autocast output")


@needs_cuda
@pytest.mark.parametrize("dtype,momentum,channels_last", [
    (torch.float32, 0.1, False), (torch.bfloat16, None, True)])
def test_cuda_graph_capture(dtype, momentum, channels_last):
    """Forward and backward captured in a CUDA graph (no host synchronisation in either):
    each replay on new data gives bit for bit what an eager step gives, running statistics
    and the cumulative average's count included."""
    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    m = _module(24, momentum=momentum, device="cuda")
    static_y = torch.randn(8, 24, 6, 6, device="cuda", dtype=dtype).contiguous(
        memory_format=fmt).requires_grad_()
    static_r = torch.randn(8, 24, 6, 6, device="cuda", dtype=dtype).contiguous(
        memory_format=fmt).requires_grad_()

    def step(model, y, r):
        model.zero_grad(set_to_none=True)
        y.grad = r.grad = None
        out = model(y, r)
        out.float().square().sum().backward()
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(m, static_y, static_r)
    torch.cuda.current_stream().wait_stream(side)
    twin = copy.deepcopy(m)
    graph = torch.cuda.CUDAGraph()
    m.zero_grad(set_to_none=True)
    static_y.grad = static_r.grad = None
    with torch.cuda.graph(graph):
        static_out = m(static_y, static_r)
        static_out.float().square().sum().backward()
    for _ in range(3):
        with torch.no_grad():
            static_y.copy_(torch.randn_like(static_y))
            static_r.copy_(torch.randn_like(static_r))
        graph.replay()
        y = static_y.detach().clone().requires_grad_()
        r = static_r.detach().clone().requires_grad_()
        out = step(twin, y, r)
        torch.cuda.synchronize()
        assert torch.equal(static_out, out)
        assert torch.equal(static_y.grad, y.grad) and torch.equal(static_r.grad, r.grad)
        for (name, p), q in zip(m.named_parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad), name
        for (name, b), c in zip(m.named_buffers(), twin.buffers()):
            assert torch.equal(b, c), name
