"""Batch norm, residual add and PReLU in one bie call each way: :func:`batch_norm_act` and
:class:`BatchNormAct`.

``out = prelu(batch_norm(y) + res, slope)``, the unit that follows a binary convolution in
residual binary networks (``PReLU(BN(conv(x)) + shortcut(x))``), as PyTorch's
``F.prelu(bn(y) + res, slope)`` with ``bn`` an ``nn.BatchNorm2d`` (affine, tracking running
statistics), computed by ``bie_bn_act_forward`` / ``bie_bn_act_backward`` (bie.h, section 7):
one pass over the activations each way plus one reduction pass, float32 arithmetic, each
output rounded once.

Tensors: ``y`` and ``res`` of rank 2 and more, dim 1 the channels (``[N, C]``,
``[N, C, L]``, ``[N, C, H, W]``; higher ranks run as ``[N, C, rest]``), contiguous or
``torch.channels_last`` (passed to bie without a copy as the ``[N*H*W, C, 1]`` view of their
memory); any other layout runs on a contiguous copy. bie computes float32 on the CPU and
float32 / bfloat16 / float16 on CUDA; other input dtypes (float64, CPU half types) run in
float32 and the output is cast back. The output has ``y``'s dtype and memory format; ``res``
is converted to them. Per-channel tensors (weight, bias, slope, running statistics) run as
float32 (a parameter of another dtype is converted for the call, and its gradient back).

Training with ``momentum=None`` is a cumulative average (the factor ``1 /
num_batches_tracked``, as ``nn.BatchNorm2d`` has it) computed on the device, so no call
synchronises with the host: the step can be captured in a CUDA graph. Under
``torch.compile`` (torch >= 2.4) the C calls are the custom operators ``torch.ops.bie.bn_act``
and ``torch.ops.bie.bn_act_backward`` (fake implementations for shapes, a registered
backward), so the module does not break the graph.
"""

import ctypes
from typing import List, Optional, Tuple

import torch
from torch import nn

from . import _compile, _lib
from ._lib import BnActParams, describe, fail

_CUDA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_F32 = torch.float32


# ------------------------------------------------------------------ the C calls


def _nhwc(t):
    """Whether the 4-D tensor t is in channels-last memory (and not also contiguous, as
    tensors with one channel or one pixel are: those run as they are in either reading)."""
    return (t.dim() == 4 and not t.is_contiguous()
            and t.is_contiguous(memory_format=torch.channels_last))


def _act_desc(t, nhwc, what):
    """The descriptor of an activation tensor: itself (contiguous), or for channels-last
    memory the [N*H*W, C, 1] reading of it that bie takes (no copy)."""
    if nhwc:
        n, c, h, w = t.shape
        return describe(t, what=what, channels_last=True, shape=(n * h * w, c, 1))
    return describe(t, what=what)


def _ref(desc):
    return None if desc is None else ctypes.byref(desc)


def _params(weight, bias, slope, running_mean, running_var, training, momentum, eps):
    """bie_bn_act_params over the given per-channel tensors, and the descriptors it points at
    (kept alive by the caller while the params are in use)."""
    p = BnActParams()
    keep = []
    for field, t in (("gamma", weight), ("beta", bias), ("slope", slope),
                     ("running_mean", running_mean), ("running_var", running_var)):
        if t is not None:
            d = describe(t, what=field)
            keep.append(d)
            setattr(p, field, ctypes.pointer(d))
    p.eps = eps
    p.momentum = momentum
    p.training = bool(training)
    return p, keep


def _enter(t):
    if t.is_cuda:
        _lib.enter_stream(t.device)


def _run_forward(y, res, weight, bias, slope, running_mean, running_var, training, momentum,
                 eps):
    """bie_bn_act_forward: (out, save_mean, save_rstd); the running statistics updated in place
    (training). y contiguous or channels-last, res in y's layout and dtype, the per-channel
    tensors float32 and contiguous."""
    nhwc = _nhwc(y)
    out = torch.empty_like(y)  # y's layout
    save_mean = torch.empty(y.shape[1], dtype=_F32, device=y.device)
    save_rstd = torch.empty_like(save_mean)
    p, keep = _params(weight, bias, slope, running_mean, running_var, training, momentum, eps)
    yd = _act_desc(y, nhwc, "y")
    rd = None if res is None else _act_desc(res, nhwc, "res")
    od = _act_desc(out, nhwc, "out")
    md, sd = describe(save_mean, what="save_mean"), describe(save_rstd, what="save_rstd")
    fn = _lib.function("bie_bn_act_forward")
    _enter(y)
    _lib.check(fn(ctypes.byref(p), ctypes.byref(yd), _ref(rd), ctypes.byref(md),
                  ctypes.byref(sd), ctypes.byref(od)))
    del keep
    return out, save_mean, save_rstd


def _run_backward(grad_out, y, res, weight, bias, slope, running_mean, running_var, save_mean,
                  save_rstd, training, momentum, eps, wanted):
    """bie_bn_act_backward: [grad_y, grad_res, grad_weight, grad_bias, grad_slope], None for
    those not wanted (``wanted``: res, weight, bias, slope) or absent."""
    nhwc = _nhwc(y)
    if grad_out.dtype != y.dtype:
        grad_out = grad_out.to(y.dtype)
    grad_out = grad_out.contiguous(
        memory_format=torch.channels_last if nhwc else torch.contiguous_format)
    grad_y = torch.empty_like(y)
    grads = [grad_y]
    for t, want in zip((res, weight, bias, slope), wanted):
        grads.append(torch.empty_like(t) if t is not None and want else None)
    p, keep = _params(weight, bias, slope, running_mean, running_var, training, momentum, eps)
    gd = _act_desc(grad_out, nhwc, "grad_out")
    yd = _act_desc(y, nhwc, "y")
    rd = None if res is None else _act_desc(res, nhwc, "res")
    gyd = _act_desc(grad_y, nhwc, "grad_y")
    grd = None if grads[1] is None else _act_desc(grads[1], nhwc, "grad_res")
    pds = [None if g is None else describe(g, what=what)
           for g, what in zip(grads[2:], ("grad_weight", "grad_bias", "grad_slope"))]
    md, sd = describe(save_mean, what="save_mean"), describe(save_rstd, what="save_rstd")
    fn = _lib.function("bie_bn_act_backward")
    _enter(y)
    _lib.check(fn(ctypes.byref(p), ctypes.byref(gd), ctypes.byref(yd), _ref(rd),
                  ctypes.byref(md), ctypes.byref(sd), ctypes.byref(gyd), _ref(grd),
                  *(_ref(d) for d in pds)))
    del keep
    return grads


class _BatchNormActFunction(torch.autograd.Function):
    """The autograd node of the eager path: forward and backward in bie. Arguments as
    :func:`_run_forward` takes them (the wrapper :func:`batch_norm_act` prepares them), and
    ``producer``: None, or the autograd node of the bie binary layer whose output y is (see
    :func:`_producer`). Saves res, the per-channel parameters, the batch statistics and y, or
    instead of y the producer, whose layer computes y again in the backward (not the
    output)."""

    @staticmethod
    def forward(ctx, y, res, weight, bias, slope, running_mean, running_var, training,
                momentum, eps, producer):
        out, save_mean, save_rstd = _run_forward(y, res, weight, bias, slope, running_mean,
                                                 running_var, training, momentum, eps)
        ctx.producer = producer
        if producer is not None:  # what y's recomputation must match
            ctx.y_layout = (y.shape, y.stride(), y.dtype)
        ctx.save_for_backward(None if producer is not None else y, res, weight, bias, slope,
                              save_mean, save_rstd)
        # Inference reads the running statistics; training only the saved batch statistics.
        ctx.running = (None, None) if training else (running_mean, running_var)
        ctx.settings = (bool(training), momentum, eps)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        y, res, weight, bias, slope, save_mean, save_rstd = ctx.saved_tensors
        if ctx.producer is not None:
            y = _again(ctx.producer, *ctx.y_layout)
        need = ctx.needs_input_grad
        grads = _run_backward(grad_out, y, res, weight, bias, slope, *ctx.running, save_mean,
                              save_rstd, *ctx.settings, need[1:5])
        return tuple(grads) + (None,) * 6


def _producer(y):
    """The autograd node of the bie binary layer's (conv2d or linear) training forward whose
    output y is, as that forward returned it, or None: a y its layer can compute again from
    what it kept for its own backward (bie_layer_forward_again)."""
    node = y.grad_fn
    layer = getattr(node, "layer", None)
    if (getattr(layer, "kind", None) not in ("binary_conv2d", "binary_linear")
            or getattr(node, "generation", None) is None
            or tuple(getattr(node, "out_run_shape", ())) != tuple(y.shape)
            or getattr(layer, "dtype", None) != y.dtype):
        return None
    return node


def _again(node, shape, stride, dtype):
    """y again: the producing layer's output computed from its kept state (after making it
    hold the state of that forward again where a later forward replaced it, or raising as
    its own backward would), in y's layout."""
    from . import functional  # (imports modules, which import this one)

    functional._restore_state(node)
    y = node.layer.forward_again(node.out_run_shape, dtype, node.channels_last)
    if y.stride() != tuple(stride):
        y = torch.empty_strided(shape, stride, dtype=dtype, device=y.device).copy_(y)
    return y


# ------------------------------------------------------------------ torch.compile

_OPS = False


def _register_ops():
    """The custom operators a compiled call runs (torch >= 2.4): functional (the updated
    running statistics are returned, and copied into the buffers by the traced code)."""

    @torch.library.custom_op("bie::bn_act", mutates_args=())
    def _bn_act(y: torch.Tensor, res: Optional[torch.Tensor], weight: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], slope: Optional[torch.Tensor],
                running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
                training: bool, momentum: float, eps: float
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        rm = None if running_mean is None else running_mean.clone()
        rv = None if running_var is None else running_var.clone()
        out, save_mean, save_rstd = _run_forward(y, res, weight, bias, slope, rm, rv, training,
                                                 momentum, eps)
        return (out, save_mean, save_rstd,
                rm if rm is not None else y.new_empty((0,), dtype=_F32),
                rv if rv is not None else y.new_empty((0,), dtype=_F32))

    @_bn_act.register_fake
    def _(y, res, weight, bias, slope, running_mean, running_var, training, momentum, eps):
        save = y.new_empty((y.shape[1],), dtype=_F32)
        return (torch.empty_like(y), save, torch.empty_like(save),
                torch.empty_like(running_mean) if running_mean is not None
                else y.new_empty((0,), dtype=_F32),
                torch.empty_like(running_var) if running_var is not None
                else y.new_empty((0,), dtype=_F32))

    @torch.library.custom_op("bie::bn_act_backward", mutates_args=())
    def _bn_act_backward(grad_out: torch.Tensor, y: torch.Tensor, res: Optional[torch.Tensor],
                         weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                         slope: Optional[torch.Tensor], running_mean: Optional[torch.Tensor],
                         running_var: Optional[torch.Tensor], save_mean: torch.Tensor,
                         save_rstd: torch.Tensor, training: bool, momentum: float, eps: float,
                         wanted: List[bool]) -> List[torch.Tensor]:
        grads = _run_backward(grad_out, y, res, weight, bias, slope, running_mean, running_var,
                              save_mean, save_rstd, training, momentum, eps, wanted)
        return [g if g is not None else _placeholder(y, i) for i, g in enumerate(grads)]

    @_bn_act_backward.register_fake
    def _(grad_out, y, res, weight, bias, slope, running_mean, running_var, save_mean,
          save_rstd, training, momentum, eps, wanted):
        grads = [torch.empty_like(y)]
        for i, (t, want) in enumerate(zip((res, weight, bias, slope), wanted)):
            grads.append(torch.empty_like(t) if t is not None and want
                         else _placeholder(y, i + 1))
        return grads

    def _setup_context(ctx, inputs, output):
        y, res, weight, bias, slope, running_mean, running_var, training, momentum, eps = inputs
        _, save_mean, save_rstd, _, _ = output
        if training:  # the saved batch statistics only (the buffers change after the call)
            running_mean = running_var = None
        ctx.save_for_backward(y, res, weight, bias, slope, running_mean, running_var,
                              save_mean, save_rstd)
        ctx.settings = (bool(training), float(momentum), float(eps))

    def _backward(ctx, grad_out, *_):
        y, res, weight, bias, slope, running_mean, running_var, save_mean, save_rstd = \
            ctx.saved_tensors
        need = ctx.needs_input_grad
        wanted = [bool(need[i + 1]) and t is not None
                  for i, t in enumerate((res, weight, bias, slope))]
        grads = torch.ops.bie.bn_act_backward(grad_out, y, res, weight, bias, slope,
                                              running_mean, running_var, save_mean, save_rstd,
                                              *ctx.settings, wanted)
        return ((grads[0],) + tuple(g if w else None for g, w in zip(grads[1:], wanted))
                + (None,) * 5)

    _bn_act.register_autograd(_backward, setup_context=_setup_context)


def _placeholder(y, i):
    """What the backward operator returns for a gradient not computed (i: 1 res, 2.. the
    per-channel ones): an empty tensor of that gradient's dtype."""
    return y.new_empty((0,)) if i == 1 else y.new_empty((0,), dtype=_F32)


if _compile.AVAILABLE:
    try:
        _register_ops()
        _OPS = True
    except Exception:  # an API this torch lacks: compiled calls split the graph instead
        _OPS = False


# ------------------------------------------------------------------ the function


def _call(y, res, weight, bias, slope, running_mean, running_var, training, momentum, eps,
          recompute=False):
    """The output, through the operator (compiling), the autograd Function (a gradient
    wanted; ``recompute``: y not kept where its producer can compute it again) or the C
    forward alone (inference); the running statistics updated in place."""
    if _OPS and _compile.compiling():
        out, _, _, new_mean, new_var = torch.ops.bie.bn_act(
            y, res, weight, bias, slope, running_mean, running_var, training, momentum, eps)
        if training:
            with torch.no_grad():
                if running_mean is not None:
                    running_mean.copy_(new_mean)
                if running_var is not None:
                    running_var.copy_(new_var)
        return out
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (y, res, weight, bias, slope)):
        producer = _producer(y) if recompute else None
        return _BatchNormActFunction.apply(y, res, weight, bias, slope, running_mean,
                                           running_var, training, momentum, eps, producer)
    return _run_forward(y, res, weight, bias, slope, running_mean, running_var, training,
                        momentum, eps)[0]


def _channel(t, what):
    """A per-channel tensor as bie takes it: float32, contiguous (a differentiable
    conversion where it is not)."""
    if t is None:
        return None
    if not torch.is_tensor(t):
        fail(_lib.ERR_INVALID_ARGUMENT, f"batch_norm_act: {what} must be a tensor or None")
    if t.dtype != _F32:
        t = t.to(_F32)
    return t.contiguous()


def _statistic(t, what):
    """(the tensor bie updates, the buffer to copy it back into or None): the running
    statistic itself when it is float32 and contiguous, else a float32 copy."""
    if t is None:
        return None, None
    if not torch.is_tensor(t):
        fail(_lib.ERR_INVALID_ARGUMENT, f"batch_norm_act: {what} must be a tensor or None")
    if t.dtype == _F32 and t.is_contiguous():
        return t, None
    return t.detach().to(_F32).contiguous(), t


def batch_norm_act(y, res=None, weight=None, bias=None, slope=None, running_mean=None,
                   running_var=None, training=False, momentum=0.1, eps=1e-5,
                   num_batches_tracked=None, recompute=False):
    """``prelu(batch_norm(y, running_mean, running_var, weight, bias, training, momentum, eps)
    + res, slope)`` in bie (``F.batch_norm``'s arguments and semantics, then the residual add
    and PReLU, fused).

    y: ``[N, C, ...]`` float; res: None or y's shape (converted to y's dtype and memory
    format); weight, bias: ``[C]`` or None (1 and 0); slope: ``[C]``, ``[1]`` (one slope for
    every channel) or None (no activation); running_mean / running_var: ``[C]`` buffers,
    updated in place in training (mean and unbiased variance), used in inference (then
    required); without them training uses the batch statistics only. ``momentum=None``: the
    cumulative average, with ``num_batches_tracked`` the count of batches including this one
    (a tensor, as ``nn.BatchNorm2d``'s buffer after its increment, or an int). Gradients: y,
    res, weight, bias and slope. Failures (shapes, devices, dtypes, too few values per
    channel in training, eps or momentum out of range) raise :class:`bie.BieError` and leave
    the running statistics unchanged.

    ``recompute=True``: where y is the output of a bie binary layer's training forward (conv2d
    or linear), as that module returned it (its dtype, shape and layout, so no conversion
    here), y is not kept for the backward: the layer's C layer computes it again there from
    what it keeps for its own backward (the packed input; ``bie_layer_forward_again``), bit
    for bit. That saves one activation-sized tensor per unit for a binary product in the
    backward. Elsewhere (other producers, torch.compile) y is kept as usual.
    """
    if not torch.is_tensor(y) or not y.is_floating_point():
        fail(_lib.ERR_DTYPE, "batch_norm_act: y must be a floating-point tensor, got "
             f"{y.dtype if torch.is_tensor(y) else type(y).__name__}")
    if y.dim() < 2:
        fail(_lib.ERR_SHAPE, f"batch_norm_act: y has rank {y.dim()}; it takes [N, C, ...] "
             "(rank 2 and more, dim 1 the channels)")
    dtype, shape = y.dtype, y.shape
    compute = dtype if dtype == _F32 or (y.is_cuda and dtype in _CUDA_DTYPES) else _F32
    nhwc = _nhwc(y)
    x = y if nhwc else y.contiguous()
    if x.dim() > 4:  # bie tensors have rank <= 4: [N, C, rest] (a view)
        x = x.reshape(shape[0], shape[1], -1)
    if x.dtype != compute:
        x = x.to(compute)  # keeps channels-last memory
    r = None
    if res is not None:
        if not torch.is_tensor(res):
            fail(_lib.ERR_INVALID_ARGUMENT, "batch_norm_act: res must be a tensor or None")
        if tuple(res.shape) != tuple(shape):
            fail(_lib.ERR_SHAPE, f"batch_norm_act: res has shape {tuple(res.shape)}, y "
                 f"{tuple(shape)}: they must be the same")
        r = res if res.dtype == compute else res.to(compute)
        r = r.contiguous(memory_format=torch.channels_last) if nhwc else r.contiguous()
        if r.dim() > 4:
            r = r.reshape(x.shape)
    w, b, s = _channel(weight, "weight"), _channel(bias, "bias"), _channel(slope, "slope")
    rm, rm_back = _statistic(running_mean, "running_mean")
    rv, rv_back = _statistic(running_var, "running_var")
    cumulative = momentum is None and bool(training) and (rm is not None or rv is not None)
    if momentum is None:
        if cumulative and num_batches_tracked is None:
            fail(_lib.ERR_INVALID_ARGUMENT, "batch_norm_act: momentum=None (a cumulative "
                 "average) needs num_batches_tracked")
        # cumulative: bie stores the batch statistics (momentum 1), averaged in below
        m = 1.0 if cumulative else 0.0
    else:
        m = float(momentum)
    old = None
    if cumulative:
        old = (None if rm is None else rm.detach().clone(),
               None if rv is None else rv.detach().clone())
    out = _call(x, r, w, b, s, rm, rv, bool(training), m, float(eps),
                recompute=bool(recompute) and x is y)
    if cumulative or rm_back is not None or rv_back is not None:
        with torch.no_grad():
            if cumulative:
                if torch.is_tensor(num_batches_tracked):
                    factor = num_batches_tracked.to(device=y.device, dtype=_F32).reciprocal()
                else:
                    factor = 1.0 / float(num_batches_tracked)
                for stat, before in zip((rm, rv), old):
                    if stat is not None:  # running = before + (batch - before) / count
                        stat.copy_(torch.lerp(before, stat, factor))
            for stat, back in ((rm, rm_back), (rv, rv_back)):
                if back is not None and bool(training):
                    back.copy_(stat)
    if out.dim() != len(shape):
        out = out.reshape(shape)
    return out if out.dtype == dtype else out.to(dtype)


# ------------------------------------------------------------------ the module


class BatchNormAct(nn.Module):
    """``prelu(bn(y) + res)``: ``nn.BatchNorm2d`` (affine, tracking running statistics), the
    residual add and PReLU in one bie call each way (:func:`batch_norm_act`).

    ``BatchNormAct(num_features, eps=1e-5, momentum=0.1, prelu=True, prelu_parameters=None,
    prelu_init=0.25, recompute=False, device=None, dtype=None)``; ``forward(y, res=None)``.
    Parameters ``weight`` (ones) and ``bias`` (zeros) as batch norm's, ``slope``
    (``prelu_parameters`` values: ``num_features`` by default, or 1 shared by every channel,
    filled with ``prelu_init``; None with ``prelu=False``: no activation); buffers
    ``running_mean``,
    ``running_var`` and ``num_batches_tracked`` with ``nn.BatchNorm2d``'s names and semantics
    (``momentum=None``: cumulative average), so the batch-norm part of a state dict is
    ``nn.BatchNorm2d``'s and loads either way. ``train()`` / ``eval()``: batch statistics
    (running ones updated) or the running ones. Inputs ``[N, C]``, ``[N, C, L]``, ``[N, C, H,
    W]`` (contiguous or channels-last: the output keeps y's format and dtype); float32 on the
    CPU (other dtypes computed in float32), float32 / bfloat16 / float16 on CUDA (per-channel
    tensors float32); under autocast a bfloat16 ``y`` with float32 parameters just works.
    ``recompute=True``: a ``y`` straight from a bie binary conv2d or linear layer is not kept
    for the backward but computed again there by that layer (see :func:`batch_norm_act`):
    less memory for a binary product per backward.
    """

    _version = 2  # nn.BatchNorm2d's state-dict version (num_batches_tracked present)

    def __init__(self, num_features, eps=1e-5, momentum=0.1, prelu=True, prelu_parameters=None,
                 prelu_init=0.25, recompute=False, device=None, dtype=None):
        super().__init__()
        self.recompute = bool(recompute)
        self.num_features = _lib.c_int64(num_features, "num_features", low=1)
        self.eps = float(eps)
        self.momentum = None if momentum is None else float(momentum)
        self.affine = True
        self.track_running_stats = True
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(self.num_features, **kw))
        self.bias = nn.Parameter(torch.empty(self.num_features, **kw))
        self.prelu_init = float(prelu_init)
        if prelu:
            count = (self.num_features if prelu_parameters is None
                     else _lib.c_int64(prelu_parameters, "prelu_parameters", low=1))
            if count not in (1, self.num_features):
                raise _lib.BieValueError(f"BatchNormAct: prelu_parameters is {count}; it must "
                                         f"be 1 or num_features ({self.num_features})")
            self.slope = nn.Parameter(torch.empty(count, **kw))
        else:
            self.register_parameter("slope", None)
        self.register_buffer("running_mean", torch.zeros(self.num_features, **kw))
        self.register_buffer("running_var", torch.ones(self.num_features, **kw))
        self.register_buffer("num_batches_tracked",
                             torch.tensor(0, dtype=torch.long, device=device))
        self.reset_parameters()

    def reset_running_stats(self):
        self.running_mean.zero_()
        self.running_var.fill_(1)
        self.num_batches_tracked.zero_()

    def reset_parameters(self):
        self.reset_running_stats()
        with torch.no_grad():
            self.weight.fill_(1)
            self.bias.zero_()
            if self.slope is not None:
                self.slope.fill_(self.prelu_init)

    def forward(self, y, res=None):
        training = self.training
        count = None
        if training and self.momentum is None:
            count = self.num_batches_tracked + 1  # on the device: no synchronisation
        out = batch_norm_act(y, res, self.weight, self.bias, self.slope, self.running_mean,
                             self.running_var, training, self.momentum, self.eps,
                             num_batches_tracked=count, recompute=self.recompute)
        if training:  # after the call: a failing one leaves every buffer as it was
            self.num_batches_tracked.add_(1)
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        version = local_metadata.get("version", None)
        key = prefix + "num_batches_tracked"
        if (version is None or version < 2) and key not in state_dict:
            # as nn.BatchNorm2d: checkpoints older than num_batches_tracked
            state_dict[key] = torch.tensor(0, dtype=torch.long,
                                           device=self.num_batches_tracked.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    @classmethod
    def from_modules(cls, bn, prelu=None, recompute=False):
        """A BatchNormAct computing ``prelu(bn(y) + res)`` with copies of ``bn``'s parameters,
        running statistics, counter, eps, momentum and mode (``bn``: an ``nn.BatchNorm1d`` /
        ``2d`` / ``3d`` tracking running statistics; without affine parameters weight 1 and
        bias 0) and of ``prelu``'s weight (an ``nn.PReLU`` or None: no activation);
        ``recompute`` as the constructor's."""
        if not isinstance(bn, nn.modules.batchnorm._BatchNorm):
            raise TypeError(f"BatchNormAct.from_modules: bn must be a torch batch norm "
                            f"module, got {type(bn).__name__}")
        if not bn.track_running_stats or bn.running_mean is None:
            raise _lib.BieValueError("BatchNormAct.from_modules: bn does not track running "
                                     "statistics (track_running_stats=False)")
        slope = None
        if prelu is not None:
            slope = prelu.weight if isinstance(prelu, nn.PReLU) else None
            if slope is None:
                raise TypeError(f"BatchNormAct.from_modules: prelu must be an nn.PReLU or "
                                f"None, got {type(prelu).__name__}")
        like = bn.weight if bn.affine and bn.weight is not None else bn.running_mean
        m = cls(bn.num_features, eps=bn.eps, momentum=bn.momentum, prelu=slope is not None,
                prelu_parameters=None if slope is None else slope.numel(), recompute=recompute,
                device=like.device, dtype=like.dtype)
        with torch.no_grad():
            if bn.affine and bn.weight is not None:
                m.weight.copy_(bn.weight)
                m.bias.copy_(bn.bias)
            if slope is not None:
                m.slope.copy_(slope.reshape(-1))
            m.running_mean.copy_(bn.running_mean)
            m.running_var.copy_(bn.running_var)
            if bn.num_batches_tracked is not None:
                m.num_batches_tracked.copy_(bn.num_batches_tracked)
        return m.train(bn.training)

    def extra_repr(self):
        act = "prelu=False" if self.slope is None else f"prelu_parameters={self.slope.numel()}"
        again = ", recompute=True" if self.recompute else ""
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, {act}{again}")


__all__ = ["BatchNormAct", "batch_norm_act"]
