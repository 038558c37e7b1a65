"""``torch.autograd.Function``s whose forward and backward run in bie.

The first arguments of each Function are the seed's (``BinaryLinearForward.forward(ctx, input,
weight, scale_a, scale_w, gemm_kernel_id, is_train)`` and so on); two optional arguments
follow:

- ``bias_a``: the layer's activation bias. bie's forward computes ``x + bias_a`` itself (SPEC
  §2), and the backward returns its gradient. Without it the input is taken as the already
  shifted ``x'``, as in the seed, and bias is zero.
- ``layer``: the module's C layer (:class:`bie._layer.Layer`). The modules pass it, with
  weight, scale_a, scale_w and bias_a being tensors over that layer's own memory, so nothing
  is copied. Without it (standalone use, as with the seed's Functions) a C layer is made for
  the call and the weight, scales and bias are copied into it.

Gradients: input, weight (float weights through autograd; an int8 weight cannot carry an
autograd gradient, so its int8-quantized gradient is stored in ``weight.grad``, overwriting
it, for :class:`bie.optim.SignFlip`), scale_a and bias_a. scale_w is not learnable. Inside a
``DistributedDataParallel`` forward the int8 gradient is that of the float gradient averaged
over the ranks, and a scale_a of 0 is set to the ranks' average measurement (see
:mod:`bie.distributed`).

The C layer keeps, from a training forward, only what its backward needs (packed signs and
clip bits). A second training forward through the same layer before the first one's
backward replaces that state; the first backward then raises :class:`bie.BieError` instead of
returning wrong gradients, unless the layer keeps its inputs (``keep_inputs=True`` on the
module), in which case the lost forward is run again from the kept input.
"""

import torch

from . import _lib, distributed
from ._layer import (BIAS_A, SCALE_A, SCALE_W, WEIGHT, WEIGHT_FLOAT_GRAD, Layer,
                     held_float_grad, set_int8_grad)
from ._lib import fail


def _scalar(t, what):
    if not torch.is_tensor(t) or t.numel() != 1:
        fail(_lib.ERR_SHAPE, f"{what} must be a tensor with one element")
    return float(t.detach().reshape(()).item())


def _copy_into(view, src, what):
    """Copy src into a parameter view of the C layer (standalone Functions only)."""
    if tuple(src.shape) != tuple(view.shape):
        fail(_lib.ERR_SHAPE, f"{what} has shape {tuple(src.shape)}, expected {tuple(view.shape)}")
    view.copy_(src.detach())


def _standalone_layer(kind, sizes, weight, scale_a, scale_w, bias_a, is_train, kernel_id=None):
    """A C layer holding copies of the given weight, scales and bias (for one call)."""
    layer = Layer(kind, sizes, weight.device)
    if weight.dtype == torch.int8 and layer.binary:
        layer.prepare_params()  # the weight becomes int8; its values are replaced below
    elif weight.dtype != torch.float32:
        allowed = "float32 or int8" if layer.binary else "float32"
        fail(_lib.ERR_DTYPE, f"{kind}: weight has dtype {weight.dtype}, expected {allowed}")
    _copy_into(layer.view(WEIGHT), weight, "weight")
    layer.view(SCALE_W).fill_(_scalar(scale_w, "scale_w"))
    layer.set_scale_a(_scalar(scale_a, "scale_a"))
    if bias_a is not None:
        _copy_into(layer.view(BIAS_A), bias_a, "bias_a")
    if kernel_id is not None and _lib.c_int(kernel_id, "gemm_kernel_id") >= 0:
        layer.set_gemm_kernel(kernel_id)
    layer.set_training(bool(is_train))
    return layer


def _forward(ctx, layer, x, weight, scale_a, bias_a, is_train):
    """The forward shared by every Function: run the C layer, remember what backward needs."""
    layer.set_training(bool(is_train))
    packed = layer.binary and not x.is_floating_point()
    # a copy only for non-contiguous input (channels-last input runs as it is where the
    # layer has NHWC kernels, and so do the output and the gradients)
    x_run = layer.input_view(x, packed)
    if not layer.conv and x_run.dim() > _lib.MAX_DIMS:  # bie tensors have rank <= 4
        x_run = x_run.reshape(-1, x_run.shape[-1])
    sync = distributed.active()  # inside a DistributedDataParallel forward
    if sync is not None and not packed:
        distributed.agree_scale_a(layer, x_run, sync)
    out = layer.output_view(layer.forward(x_run, packed), x, packed)
    training = bool(is_train) and not packed
    if layer.training:
        layer.changed()  # the previous training forward's state is gone now
    ctx.layer = layer
    ctx.channels_last = layer.channels_last
    ctx.generation = layer.generation if training else None
    ctx.x_shape, ctx.run_shape, ctx.out_run_shape = x.shape, x_run.shape, out.shape
    ctx.weight = weight
    ctx.sync = sync if sync is not None and sync.grads and training else None
    ctx.scale_a_shape = scale_a.shape if torch.is_tensor(scale_a) else None
    ctx.has_bias = bias_a is not None
    ctx.kept = training and layer.keep_inputs
    if ctx.kept:  # also lets autograd detect in-place changes of these before the backward
        ctx.save_for_backward(x_run, *(t for t in (weight, scale_a, bias_a) if t is not None))
    if out.dim() != x.dim() and not layer.conv:
        out = out.reshape(tuple(x.shape[:-1]) + (out.shape[-1],))
    return out


def _restore_state(ctx):
    """Make the C layer hold the state of ctx's forward again, or raise."""
    layer = ctx.layer
    if ctx.generation is None:
        fail(_lib.ERR_STATE, f"{layer.kind}: this output was computed in inference mode "
             "(eval() or is_train=False), which keeps nothing for a backward")
    if layer.retired:
        fail(_lib.ERR_STATE, f"{layer.kind}: the module's C layer was replaced (moved, "
             "converted, or its weight replaced) after the forward this backward belongs "
             "to; run backward before such calls")
    if ctx.generation == layer.generation:
        return
    if not ctx.kept:
        fail(_lib.ERR_STATE, f"{layer.kind}: the layer ran another forward (or changed its "
             "parameters or mode) after the forward this backward belongs to, so the state "
             "that backward needs is gone. Run backward before the next forward through the "
             "same layer, or create the module with keep_inputs=True (keeps a reference to "
             "each input so the lost forward can be run again)")
    x_run = ctx.saved_tensors[0]  # raises if a saved tensor was modified in place since
    layer.set_training(True)
    layer.input_view(x_run)  # the layout of that forward
    layer.forward(x_run, False)
    layer.changed()
    ctx.generation = layer.generation


def _shaped(t, shape):
    return t if t.shape == shape else t.reshape(shape)


def _int8_weight_grad(layer, weight, held, target):
    """The int8 gradient of an int8 weight after the layer's backward: the C backward's (in
    ``target``), or, where an earlier float gradient is ``held``, the int8 quantization (SPEC
    §1) of the sum, which the layer then reports as its gradients too."""
    if held is None:
        return target
    total = layer.view(WEIGHT_FLOAT_GRAD, grad=True)
    total.add_(held.view(total.shape))
    q = distributed.quantize_int8(total)
    layer.view(WEIGHT, grad=True).copy_(q)
    return _shaped(q, weight.shape)


def _backward(ctx, grad_out, weight_index, scale_a_index, bias_index):
    """Gradients for a Function's arguments; positions of weight, scale_a and bias_a given."""
    layer = ctx.layer
    weight = ctx.weight
    int8 = weight is not None and weight.dtype == torch.int8
    reduced = int8 and ctx.sync is not None
    # taken before the layer's backward replaces its gradients: the float gradient an unreset
    # weight.grad quantizes, to add to (gradient accumulation, a layer used twice)
    held = held_float_grad(weight, layer) if int8 else None
    if reduced:
        distributed.before_backward(layer)
    _restore_state(ctx)
    # The weight's gradient straight into the tensor handed on as weight.grad (no copy of
    # the layer's), where it is handed on as the C backward leaves it.
    target = None
    if int8 and not reduced and held is None:
        target = layer.weight_grad_into(weight, torch.int8)
    elif not int8 and weight is not None and ctx.needs_input_grad[weight_index]:
        target = layer.weight_grad_into(weight, torch.float32)
    if ctx.channels_last:  # the gradient in the forward's layout (a copy only if not so)
        g = grad_out.contiguous(memory_format=torch.channels_last)
    else:
        g = _shaped(grad_out.contiguous(), ctx.out_run_shape)  # a copy only for expanded grads
    grad_x = layer.backward(g, ctx.run_shape, ctx.needs_input_grad[0], ctx.channels_last)
    grads = [None] * 11  # the longest argument list (conv Functions)
    if grad_x is not None:
        grads[0] = _shaped(grad_x, ctx.x_shape)
    if reduced:
        # Data parallel: weight.grad is set at the end of the backward from the float
        # gradient averaged over the ranks (DDP skips int8 parameters).
        distributed.reduce_weight_grad(layer, weight, ctx.sync, held)
    elif int8:
        set_int8_grad(weight, _int8_weight_grad(layer, weight, held, target), layer)
    elif target is not None:
        grads[weight_index] = target
    if ctx.scale_a_shape is not None and ctx.needs_input_grad[scale_a_index]:
        grads[scale_a_index] = _shaped(layer.grad_copy(SCALE_A), ctx.scale_a_shape)
    if ctx.has_bias and ctx.needs_input_grad[bias_index]:
        grads[bias_index] = layer.grad_copy(BIAS_A)
    return tuple(grads)


class BinaryLinearForward(torch.autograd.Function):
    """Binary linear forward/backward in bie (SPEC §2): ``out = scale_a * scale_w *
    sign(x') . sign(w)`` with straight-through gradients.

    ``apply(input, weight, scale_a, scale_w, gemm_kernel_id, is_train, bias_a=None,
    layer=None)``: input ``[..., in]`` float32 (or pre-packed words in inference), weight
    ``[out, in]`` float32 or int8, scale_a and scale_w one-element tensors. gemm_kernel_id
    (a bie kernel id, or -1/None for the default) is used by standalone calls; modules select
    kernels on their layer.
    """

    @staticmethod
    def forward(ctx, input, weight, scale_a, scale_w, gemm_kernel_id, is_train, bias_a=None,
                layer=None):
        if layer is None:
            if weight.dim() != 2:
                fail(_lib.ERR_SHAPE, f"binary_linear: weight must be [out, in], got "
                     f"{tuple(weight.shape)}")
            layer = _standalone_layer("binary_linear", (weight.shape[1], weight.shape[0]),
                                      weight, scale_a, scale_w, bias_a, is_train,
                                      gemm_kernel_id)
        return _forward(ctx, layer, input, weight, scale_a, bias_a, is_train)

    @staticmethod
    def backward(ctx, output_gradient):
        return _backward(ctx, output_gradient, 1, 2, 6)


class Q4LinearForward(torch.autograd.Function):
    """4-bit linear forward/backward in bie (SPEC §4 with a matrix product):
    ``out = scale_a * scale_w * q4(x', scale_a) . q4(w, scale_w)``.

    ``apply(input, weight, scale_a, scale_w, is_train, bias_a=None, layer=None)``; weight
    ``[out, in]`` float32 (straight-through), input ``[..., in]`` float32.
    """

    @staticmethod
    def forward(ctx, input, weight, scale_a, scale_w, is_train, bias_a=None, layer=None):
        if layer is None:
            if weight.dim() != 2:
                fail(_lib.ERR_SHAPE, f"q4_linear: weight must be [out, in], got "
                     f"{tuple(weight.shape)}")
            layer = _standalone_layer("q4_linear", (weight.shape[1], weight.shape[0]),
                                      weight, scale_a, scale_w, bias_a, is_train)
        return _forward(ctx, layer, input, weight, scale_a, bias_a, is_train)

    @staticmethod
    def backward(ctx, output_gradient):
        return _backward(ctx, output_gradient, 1, 2, 5)


def _conv_sizes(kind, weight, kernel_size, stride, padding, dilation):
    if weight.dim() != 4 or weight.shape[2] != kernel_size or weight.shape[3] != kernel_size:
        fail(_lib.ERR_SHAPE, f"{kind}: weight must be [out_c, in_c, {kernel_size}, "
             f"{kernel_size}], got {tuple(weight.shape)}")
    return (weight.shape[1], weight.shape[0], kernel_size, stride, padding, dilation)


class BinaryConv2dForward(torch.autograd.Function):
    """Binary conv2d forward/backward in bie (SPEC §3), NCHW, zero padding, groups = 1.

    ``apply(x, weight, scale_a, scale_w, is_train, kernel_size, stride, padding, dilation,
    bias_a=None, layer=None)``; weight ``[out_c, in_c, k, k]`` float32 or int8.
    """

    @staticmethod
    def forward(ctx, x, weight, scale_a, scale_w, is_train, kernel_size, stride, padding,
                dilation, bias_a=None, layer=None):
        if layer is None:
            sizes = _conv_sizes("binary_conv2d", weight, kernel_size, stride, padding, dilation)
            layer = _standalone_layer("binary_conv2d", sizes, weight, scale_a, scale_w,
                                      bias_a, is_train)
        return _forward(ctx, layer, x, weight, scale_a, bias_a, is_train)

    @staticmethod
    def backward(ctx, output_gradient):
        return _backward(ctx, output_gradient, 1, 2, 9)


class Q4Conv2dCutlassForward(torch.autograd.Function):
    """4-bit conv2d forward/backward in bie (SPEC §4), NCHW, zero padding, any channel count.

    ``apply(x, weight, scale_a, scale_w, is_train, kernel_size, stride, padding, dilation,
    bias_a=None, layer=None)``; weight ``[out_c, in_c, k, k]`` float32.
    """

    @staticmethod
    def forward(ctx, x, weight, scale_a, scale_w, is_train, kernel_size, stride, padding,
                dilation, bias_a=None, layer=None):
        if layer is None:
            sizes = _conv_sizes("q4_conv2d", weight, kernel_size, stride, padding, dilation)
            layer = _standalone_layer("q4_conv2d", sizes, weight, scale_a, scale_w, bias_a,
                                      is_train)
        return _forward(ctx, layer, x, weight, scale_a, bias_a, is_train)

    @staticmethod
    def backward(ctx, output_gradient):
        return _backward(ctx, output_gradient, 1, 2, 9)


__all__ = ["BinaryLinearForward", "Q4LinearForward", "BinaryConv2dForward",
           "Q4Conv2dCutlassForward"]
