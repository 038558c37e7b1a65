"""The SPEC's formulas in plain torch, to hold bie's results against."""

import torch
import torch.nn.functional as F


def sign(v):
    """SPEC §1: +1 for v >= 0, else -1 (float32)."""
    return torch.where(v >= 0, torch.ones_like(v, dtype=torch.float32),
                       -torch.ones_like(v, dtype=torch.float32))


def q4(v, s):
    """SPEC §1: clamp(rint(v / s), -8, 7), round half to even, in float32."""
    return torch.clamp(torch.round(v / s), -8, 7)


def scale_product(scale_a, scale_w):
    """scale_a * scale_w rounded to float32, as bie multiplies it."""
    return (torch.tensor(float(scale_a), dtype=torch.float32)
            * torch.tensor(float(scale_w), dtype=torch.float32))


def quantize_i8(t):
    """SPEC §1 int8 tensor quantization (narrow range, per tensor)."""
    amax = t.abs().max()
    if amax == 0:
        return torch.zeros_like(t, dtype=torch.int8)
    return torch.clamp(torch.round(t * 127 / amax), -127, 127).to(torch.int8)


def _integer_product(a, b):
    """a @ b.T of small integers, exact (float64 accumulation), as float32."""
    return (a.double() @ b.double().t()).float()


def binary_linear(x, w, scale_a, scale_w, bias=None):
    """Forward and a backward closure of SPEC §2 (x: [m, k] before the bias shift)."""
    xs = x + bias if bias is not None else x
    out = _integer_product(sign(xs), sign(w.float())) * scale_product(scale_a, scale_w)

    def backward(g):
        inr = ((xs / scale_a >= -1) & (xs / scale_a <= 1)).float()
        gx = (g @ (sign(w.float()) * scale_w)) * inr
        gw = g.t() @ (sign(xs) * scale_a)
        gs = (gx * sign(xs)).sum() / xs.numel() ** 0.5
        return gx, gw, gs, gx.sum(0)
    return out, backward


def q4_linear(x, w, scale_a, scale_w, bias=None):
    """Forward and a backward closure of SPEC §4 with a matrix product."""
    xs = x + bias if bias is not None else x
    out = _integer_product(q4(xs, scale_a), q4(w, scale_w)) * scale_product(scale_a, scale_w)

    def backward(g):
        v = xs / scale_a
        inr = ((v >= -8) & (v <= 7)).float()
        gx = (g @ (q4(w, scale_w) * scale_w)) * inr
        gw = g.t() @ (q4(xs, scale_a) * scale_a)
        gs = (inr * (torch.round(v) - v) * gx).sum() / (xs.numel() * 7) ** 0.5
        return gx, gw, gs, gx.sum(0)
    return out, backward


def _conv(xq, wq, stride, padding, dilation):
    """Convolution of small integers, exact (float64), as float32."""
    return F.conv2d(xq.double(), wq.double(), stride=stride, padding=padding,
                    dilation=dilation).float()


def _conv_grads(xq_scaled, wq_scaled, g, inr, stride, padding, dilation):
    gx = torch.nn.grad.conv2d_input(xq_scaled.shape, wq_scaled, g, stride=stride,
                                    padding=padding, dilation=dilation) * inr
    gw = torch.nn.grad.conv2d_weight(xq_scaled, wq_scaled.shape, g, stride=stride,
                                     padding=padding, dilation=dilation)
    return gx, gw


def binary_conv2d(x, w, scale_a, scale_w, stride, padding, dilation, bias=None):
    """Forward and a backward closure of SPEC §3 (NCHW, zero padding)."""
    xs = x + bias.view(1, -1, 1, 1) if bias is not None else x
    out = _conv(sign(xs), sign(w.float()), stride, padding, dilation) \
        * scale_product(scale_a, scale_w)

    def backward(g):
        inr = ((xs / scale_a >= -1) & (xs / scale_a <= 1)).float()
        gx, gw = _conv_grads(sign(xs) * scale_a, sign(w.float()) * scale_w, g, inr, stride,
                             padding, dilation)
        gs = (gx * sign(xs)).sum() / xs.numel() ** 0.5
        return gx, gw, gs, gx.sum((0, 2, 3))
    return out, backward


def q4_conv2d(x, w, scale_a, scale_w, stride, padding, dilation, bias=None):
    """Forward and a backward closure of SPEC §4 (NCHW, zero padding)."""
    xs = x + bias.view(1, -1, 1, 1) if bias is not None else x
    out = _conv(q4(xs, scale_a), q4(w, scale_w), stride, padding, dilation) \
        * scale_product(scale_a, scale_w)

    def backward(g):
        v = xs / scale_a
        inr = ((v >= -8) & (v <= 7)).float()
        gx, gw = _conv_grads(q4(xs, scale_a) * scale_a, q4(w, scale_w) * scale_w, g, inr,
                             stride, padding, dilation)
        gs = (inr * (torch.round(v) - v) * gx).sum() / (xs.numel() * 7) ** 0.5
        return gx, gw, gs, gx.sum((0, 2, 3))
    return out, backward


def pack_signs(x, word_bits):
    """SPEC §1 bit packing of sign(x) rows into words (uint8 / int32 / int64 tensors)."""
    rows, cols = x.reshape(-1, x.shape[-1]).shape
    words = (cols + word_bits - 1) // word_bits
    bits = torch.zeros(rows, words * word_bits, dtype=torch.int64)
    bits[:, :cols] = (x.reshape(rows, cols) >= 0).long()
    bits = bits.view(rows, words, word_bits)
    weights = torch.tensor([1 << i for i in range(word_bits - 1)] + [-(1 << (word_bits - 1))
                           if word_bits == 64 else 1 << (word_bits - 1)], dtype=torch.int64)
    packed = (bits * weights).sum(-1)
    dtype = {8: torch.uint8, 32: torch.int32, 64: torch.int64}[word_bits]
    if word_bits == 32:
        packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed)
    return packed.to(dtype).view(*x.shape[:-1], words)
