"""Channels-last (NHWC) tensors through bie's conv modules: the same results as contiguous
(NCHW) input, and channels-last output as torch's conv2d gives. On CUDA the binary conv runs
NHWC kernels, so its output and its input gradient are channels last without copies;
elsewhere the module runs on an NCHW copy and converts the output back."""

import pytest
import torch

import bie
from bie import _lib

CUDA = torch.cuda.is_available() and bie.cuda_built() and _lib.lib().bie_cuda_device_count() > 0


def _pair(cls, args, device, dtype, seed):
    """Two modules with the same parameters (the same seed for their initialisation)."""
    made = []
    for _ in range(2):
        torch.manual_seed(seed)
        made.append(cls(*args, device=device, dtype=dtype) if device == "cuda" else cls(*args))
    a, b = made
    assert torch.equal(a.weight, b.weight)
    with torch.no_grad():
        if getattr(a, "bias_a", None) is not None:
            a.bias_a.uniform_(-0.3, 0.3)
            b.bias_a.copy_(a.bias_a)
    return a, b


def _step(mod, x, g):
    """Forward and backward; returns the output, grad_x and the parameters' gradients."""
    x = x.detach().requires_grad_(True)
    y = mod(x)
    y.backward(g)
    grads = {name: p.grad.clone() for name, p in mod.named_parameters() if p.grad is not None}
    for p in mod.parameters():
        p.grad = None
    return y, x.grad, grads


SHAPES = [  # (in_c, out_c, k, stride, padding), input (n, c, h, w)
    ((16, 24, 3, 1, 1), (2, 16, 9, 7)),
    ((33, 64, 3, 2, 1), (3, 33, 10, 11)),
    ((64, 64, 3, 1, 1), (4, 64, 8, 8)),
    ((40, 130, 3, 1, 1), (2, 40, 6, 7)),
    ((8, 8, 1, 1, 0), (1, 8, 5, 5)),
]


@pytest.mark.parametrize("args,shape", SHAPES)
@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32)] + (
    [("cuda", torch.bfloat16), ("cuda", torch.float16), ("cuda", torch.float32)] if CUDA
    else []))
def test_binary_conv_channels_last_matches_nchw(args, shape, device, dtype):
    nchw, nhwc = _pair(bie.BinaryConv2dCutlass, args, device, dtype, 5)
    for m in (nchw, nhwc):
        bie.prepare_bie_layers(m)
        m.train()
    torch.manual_seed(11)
    x = torch.randn(*shape, device=device, dtype=dtype)
    with torch.no_grad():
        g = torch.randn_like(nchw(x))
    y_ref, gx_ref, grads_ref = _step(nchw, x, g)
    xl = x.contiguous(memory_format=torch.channels_last)
    gl = g.contiguous(memory_format=torch.channels_last)
    y, gx, grads = _step(nhwc, xl, gl)
    assert torch.equal(y, y_ref)  # the binary forward bit for bit
    assert torch.equal(gx, gx_ref)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        if name in ("bias_a", "scale_a"):  # sums over pixels, in each layout's tile order
            ref = grads_ref[name]
            torch.testing.assert_close(grads[name], ref, rtol=1e-4,
                                       atol=1e-5 * float(ref.abs().max()) + 1e-30, msg=name)
        else:
            assert torch.equal(grads[name], grads_ref[name]), name
    if device == "cuda":  # NHWC kernels: the layout carries through
        assert y.is_contiguous(memory_format=torch.channels_last)
        assert gx.is_contiguous(memory_format=torch.channels_last)
        assert nhwc._layer.channels_last
    # back to NCHW input through the same module: the layout follows the input
    y2 = nhwc(x)
    assert y2.is_contiguous() and torch.equal(y2, y_ref)
    if device != "cuda":  # NCHW kernels: channels-last in, channels-last out all the same
        assert y.is_contiguous(memory_format=torch.channels_last)
    # inference
    nchw.eval()
    nhwc.eval()
    with torch.no_grad():
        assert torch.equal(nhwc(xl), nchw(x))


@pytest.mark.skipif(not CUDA, reason="no CUDA device or no CUDA backend")
def test_channels_last_network_trains_under_autocast():
    """A channels-last network (batch norm, shortcut add) with bie's binary conv under
    bf16 autocast: the same loss and gradients as the NCHW network, and the layout kept."""
    def net():
        torch.manual_seed(3)
        conv = bie.BinaryConv2dCutlass(32, 32, 3, padding=1, device="cuda", dtype=torch.bfloat16)
        m = torch.nn.Sequential(conv, torch.nn.BatchNorm2d(32)).cuda()
        bie.prepare_bie_layers(m)
        return m

    a, b = net(), net()
    b = b.to(memory_format=torch.channels_last)
    x = torch.randn(8, 32, 12, 12, device="cuda")
    outs = []
    for m, xi in ((a, x), (b, x.contiguous(memory_format=torch.channels_last))):
        xi = xi.detach().requires_grad_(True)
        with torch.autocast("cuda", torch.bfloat16):
            y = m(xi) + xi
        y.float().square().mean().backward()
        outs.append((y, xi.grad, m[0].weight.grad.clone()))
    (ya, ga, wa), (yb, gb, wb) = outs
    assert yb.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(yb.float(), ya.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(gb, ga, rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(wb.float(), wa.float(), rtol=0, atol=1)  # int8 gradients


def test_layer_refuses_channels_last_where_it_has_no_nhwc_kernels():
    lin = bie.BinaryLinearCutlass(8, 4)
    with pytest.raises(bie.BieError):
        lin._layer._set_channels_last(True)
    conv = bie.BinaryConv2dCutlass(4, 4, 3, padding=1)  # the CPU: NCHW kernels only
    with pytest.raises(bie.BieError):
        conv._layer._set_channels_last(True)
    x = torch.randn(2, 4, 5, 5)
    y = conv(x.contiguous(memory_format=torch.channels_last))  # run on an NCHW copy
    assert y.is_contiguous(memory_format=torch.channels_last)  # as torch's conv2d returns it
    assert torch.equal(y, conv(x))


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA else []))
def test_set_activation_takes_channels_last_input(device):
    """set_activation (scale_a from the input, x + bias_a returned) on channels-last input
    gives the NCHW result's values (in the input's layout where the layer has NHWC kernels)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a, b = _pair(bie.BinaryConv2dCutlass, (16, 8, 3, 1, 1), device, dtype, 9)
    x = torch.randn(2, 16, 5, 6, device=device, dtype=dtype)
    ya = a.set_activation(x)
    yb = b.set_activation(x.contiguous(memory_format=torch.channels_last))
    assert torch.equal(yb, ya)
    assert torch.equal(b.scale_a, a.scale_a)
    if device == "cuda":
        assert yb.is_contiguous(memory_format=torch.channels_last)
