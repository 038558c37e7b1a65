"""Every autograd Function (standalone, as the seed's are used) against the SPEC formulas:
forward bit-exact, gradients within float tolerance."""

import pytest
import torch

import bie
import reference as ref

LINEAR_SHAPES = [  # (leading shape of x, in, out)
    ((1,), 1, 1), ((1,), 37, 5), ((3,), 64, 16), ((7,), 130, 33), ((2, 3), 17, 9),
    ((2, 1, 3), 70, 4), ((1, 2, 1, 2, 3), 9, 6),
]
CONV_SHAPES = [  # (N, C, H, W, O, k, stride, padding, dilation)
    (1, 1, 5, 5, 1, 1, 1, 0, 1), (2, 3, 7, 6, 5, 3, 1, 1, 1), (1, 5, 9, 8, 4, 3, 2, 2, 2),
    (3, 2, 6, 6, 3, 2, 1, 0, 1), (1, 33, 4, 5, 2, 3, 1, 1, 1),
]


def _scales(x):
    # scale_a near the layer's own initialisation, so both clip regions occur
    scale_a = torch.tensor([float(2 * x.abs().mean()) * 0.7])
    return scale_a.requires_grad_(), torch.tensor([0.37])


def _close(actual, expected, rtol=2e-4, atol=2e-4):
    scale = float(expected.abs().max()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol * max(scale, 1.0))


@pytest.mark.parametrize("lead,k,n", LINEAR_SHAPES)
@pytest.mark.parametrize("int8_weight", [False, True])
def test_binary_linear_forward(lead, k, n, int8_weight):
    x = torch.randn(*lead, k, requires_grad=True)
    w = torch.randn(n, k)
    if int8_weight:
        w = ref.quantize_i8(w)
        w[w == 0] = 1
    bias = (0.3 * torch.randn(k)).requires_grad_()
    scale_a, scale_w = _scales(x)
    out = bie.BinaryLinearForward.apply(x, w, scale_a, scale_w, -1, True, bias)
    expect, backward = ref.binary_linear(x.detach().reshape(-1, k), w, float(scale_a),
                                         float(scale_w), bias.detach())
    assert out.shape == (*lead, n)
    assert torch.equal(out.detach().reshape(-1, n), expect)

    g = torch.randn_like(out)
    out.backward(g)
    gx, gw, gs, gb = backward(g.reshape(-1, n))
    _close(x.grad.reshape(-1, k), gx)
    _close(scale_a.grad, gs.reshape(1), rtol=1e-3)
    _close(bias.grad, gb)
    if int8_weight:  # the int8-quantized gradient for the sign-flip optimizer
        assert w.grad.dtype == torch.int8
        assert (w.grad.int() - ref.quantize_i8(gw).int()).abs().max() <= 1
        assert w.grad.abs().max() == 127


def test_binary_linear_weight_gradient_float():
    x = torch.randn(5, 23)
    w = torch.randn(7, 23, requires_grad=True)
    scale_a, scale_w = _scales(x)
    out = bie.BinaryLinearForward.apply(x, w, scale_a, scale_w, -1, True)
    g = torch.randn_like(out)
    out.backward(g)
    _, backward = ref.binary_linear(x, w.detach(), float(scale_a), float(scale_w))
    _close(w.grad, backward(g)[1])


@pytest.mark.parametrize("lead,k,n", LINEAR_SHAPES)
def test_q4_linear(lead, k, n):
    x = torch.randn(*lead, k, requires_grad=True)
    w = (0.2 * torch.randn(n, k)).requires_grad_()
    bias = (0.3 * torch.randn(k)).requires_grad_()
    scale_a = torch.tensor([float(2 * x.abs().mean() / 11.269)], requires_grad=True)
    scale_w = torch.tensor([float(2 * w.abs().mean() / 5.6345)])
    out = bie.Q4LinearForward.apply(x, w, scale_a, scale_w, True, bias)
    expect, backward = ref.q4_linear(x.detach().reshape(-1, k), w.detach(), float(scale_a),
                                     float(scale_w), bias.detach())
    assert torch.equal(out.detach().reshape(-1, n), expect)
    g = torch.randn_like(out)
    out.backward(g)
    gx, gw, gs, gb = backward(g.reshape(-1, n))
    _close(x.grad.reshape(-1, k), gx)
    _close(w.grad, gw)
    _close(bias.grad, gb)
    # bie keeps an 8-bit rounding residual (resolution 1/254) instead of the float input
    resolution = float(gx.abs().sum()) / 254 / (gx.numel() * 7) ** 0.5
    assert abs(float(scale_a.grad) - float(gs)) <= resolution + 1e-4 * abs(float(gs))


@pytest.mark.parametrize("shape", CONV_SHAPES)
@pytest.mark.parametrize("int8_weight", [False, True])
def test_binary_conv2d(shape, int8_weight):
    n, c, h, wd, o, k, s, p, d = shape
    x = torch.randn(n, c, h, wd, requires_grad=True)
    w = torch.randn(o, c, k, k, requires_grad=not int8_weight)
    if int8_weight:
        w = ref.quantize_i8(w)
        w[w == 0] = -1
    bias = (0.3 * torch.randn(c)).requires_grad_()
    scale_a, scale_w = _scales(x)
    out = bie.BinaryConv2dForward.apply(x, w, scale_a, scale_w, True, k, s, p, d, bias)
    expect, backward = ref.binary_conv2d(x.detach(), w.detach(), float(scale_a),
                                         float(scale_w), s, p, d, bias.detach())
    assert torch.equal(out.detach(), expect)
    g = torch.randn_like(out)
    out.backward(g)
    gx, gw, gs, gb = backward(g)
    _close(x.grad, gx)
    _close(scale_a.grad, gs.reshape(1), rtol=1e-3)
    _close(bias.grad, gb)
    if int8_weight:
        assert (w.grad.int() - ref.quantize_i8(gw).int()).abs().max() <= 1
    else:
        _close(w.grad, gw)


@pytest.mark.parametrize("shape", CONV_SHAPES)
def test_q4_conv2d(shape):
    n, c, h, wd, o, k, s, p, d = shape
    x = torch.randn(n, c, h, wd, requires_grad=True)
    w = (0.2 * torch.randn(o, c, k, k)).requires_grad_()
    scale_a = torch.tensor([float(2 * x.abs().mean() / 11.269)], requires_grad=True)
    scale_w = torch.tensor([float(2 * w.abs().mean() / 5.6345)])
    # the seed's call: input already shifted, no bias argument
    out = bie.Q4Conv2dCutlassForward.apply(x, w, scale_a, scale_w, True, k, s, p, d)
    expect, backward = ref.q4_conv2d(x.detach(), w.detach(), float(scale_a), float(scale_w),
                                     s, p, d)
    assert torch.equal(out.detach(), expect)
    g = torch.randn_like(out)
    out.backward(g)
    gx, gw, gs, _ = backward(g)
    _close(x.grad, gx)
    _close(w.grad, gw)
    resolution = float(gx.abs().sum()) / 254 / (gx.numel() * 7) ** 0.5
    assert abs(float(scale_a.grad) - float(gs)) <= resolution + 1e-4 * abs(float(gs))


def test_inference_mode_output_has_no_backward():
    x = torch.randn(4, 10, requires_grad=True)
    w = torch.randn(3, 10)
    scale_a, scale_w = _scales(x)
    out = bie.BinaryLinearForward.apply(x, w, scale_a, scale_w, -1, False)
    expect, _ = ref.binary_linear(x.detach(), w, float(scale_a), float(scale_w))
    assert torch.equal(out.detach(), expect)
    with pytest.raises(bie.BieError, match="inference mode"):
        out.sum().backward()
