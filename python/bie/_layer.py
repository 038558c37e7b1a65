"""One C layer handle (``bie_layer *``) and the calls made on it.

Every kind of layer is one ``bie_layer`` in C: a kind's creator makes it and the one
``bie_layer_*`` family does everything else. What differs between kinds is in :data:`KINDS`
(the creator, the sizes it takes, whether it takes ``symmetric``). A :class:`Layer` owns the
handle, turns every failing status into :class:`BieError`, makes torch tensors over the
layer's parameters and gradients, and counts the training forwards it runs (``generation``)
so that a backward can tell whether the state the C layer kept for it is still there.
"""

import ctypes
import warnings
import weakref
from typing import NamedTuple

import torch

from . import _lib
from ._lib import BieError, LayerDesc, Tensor, describe, fail

# bie_param (bie.h)
WEIGHT, QWEIGHT, BIAS_A, SCALE_A, SCALE_W, WEIGHT_FLOAT_GRAD = range(6)


class Kind(NamedTuple):
    """What one layer kind is, for the package: its ``bie_layer_kind``, its C creator and the
    arguments that creator takes."""

    code: int  # bie_layer_kind
    creator: str  # the C function that makes a layer of this kind
    sizes: tuple  # names of the creator's size arguments, in order
    binary: bool  # 1-bit (takes symmetric, has a word size) or 4-bit
    conv: bool  # NCHW conv2d or linear

    def arguments(self, sizes, device, dtype, symmetric):
        """The creator's arguments after ``bie_layer **out``."""
        sizes = tuple(sizes)
        if len(sizes) != len(self.sizes):
            fail(_lib.ERR_SHAPE, f"{self.creator} takes {len(self.sizes)} sizes "
                 f"({', '.join(self.sizes)}), got {len(sizes)}")
        # Channels and features are int64_t in C, the conv geometry int: checked here, as
        # ctypes would pass only the low bits of a larger value.
        sizes = tuple(_lib.c_int64(v, name) if i < 2 else _lib.c_int(v, name)
                      for i, (v, name) in enumerate(zip(sizes, self.sizes)))
        return sizes + (device, dtype) + ((bool(symmetric),) if self.binary else ())


_LINEAR_SIZES = ("in_features", "out_features")
_CONV_SIZES = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation")

KINDS = {
    "binary_linear": Kind(_lib.KIND_BINARY_LINEAR, "bie_binary_linear_create", _LINEAR_SIZES,
                          binary=True, conv=False),
    "binary_conv2d": Kind(_lib.KIND_BINARY_CONV2D, "bie_binary_conv2d_create", _CONV_SIZES,
                          binary=True, conv=True),
    "q4_linear": Kind(_lib.KIND_Q4_LINEAR, "bie_q4_linear_create", _LINEAR_SIZES,
                      binary=False, conv=False),
    "q4_conv2d": Kind(_lib.KIND_Q4_CONV2D, "bie_q4_conv2d_create", _CONV_SIZES,
                      binary=False, conv=True),
}

# The smallest layer of each kind (sizes), used to ask the library whether it runs a kind.
_PROBE_SIZES = {False: (1, 1), True: (1, 1, 1, 1, 0, 1)}


def _kind(name):
    spec = KINDS.get(name)
    if spec is None:
        fail(_lib.ERR_UNSUPPORTED, f"no bie layer kind {name!r} (kinds: {', '.join(KINDS)})")
    return spec


_probed_devices = {}


def _probe_device(kind, device):
    """Raise a clear BieError when this libbie cannot run ``kind`` layers on ``device``.

    The library answers by itself: creating a 1x1 layer there either works or fails with
    its reason. The answer is cached per (kind, device).
    """
    key = (kind, device.type, device.index)
    reason = _probed_devices.get(key)
    if reason is None:
        spec = _kind(kind)
        handle = ctypes.c_void_p()
        args = spec.arguments(_PROBE_SIZES[spec.conv], _lib.bie_device(device), _lib.F32, True)
        status = _lib.function(spec.creator)(ctypes.byref(handle), *args)
        if status == 0:
            _lib.function("bie_layer_free")(handle)
            reason = ""
        else:
            reason = (f"{kind} layers on {device} are not supported yet by this build of "
                      f"libbie ({_lib.library_path()}): "
                      f"{_lib.lib().bie_last_error().decode(errors='replace')}")
        _probed_devices[key] = reason
    if reason:
        fail(_lib.ERR_UNSUPPORTED, reason)


# id(int8 weight) -> (weak weight, weak .grad as bie set it, that .grad's version then,
# weak C layer whose backward made it)
_int8_grads = {}
_warned_accumulation = False


def channels_last_input(x, packed=False):
    """Whether x is a 4-D float tensor in torch.channels_last memory (and not also
    contiguous, as tensors with one channel or one pixel are)."""
    return (not packed and x.dim() == 4 and x.is_floating_point() and not x.is_contiguous()
            and x.is_contiguous(memory_format=torch.channels_last))


def held_float_grad(weight, layer):
    """Before a backward of ``layer`` into the int8 binary weight ``weight``: when
    ``weight.grad`` is still the gradient bie set last, unchanged (no ``zero_grad`` since:
    gradient accumulation, or the layer used again in the same forward), a copy of the float
    gradient it is the quantization of (the layer's, still held from that backward), to which
    the new float gradient is added, as torch adds gradients; else None."""
    global _warned_accumulation
    prev = weight.grad
    if prev is None:
        return None
    last = _int8_grads.get(id(weight))
    if (last is None or last[0]() is not weight or last[1]() is not prev
            or last[2] != prev._version):
        return None  # set or changed by someone else: replaced, as a fresh gradient
    held = None if last[3]() is not layer or layer.retired else layer.grad_copy(
        WEIGHT_FLOAT_GRAD)
    if held is None and not _warned_accumulation:
        _warned_accumulation = True
        warnings.warn("bie: an int8 binary weight's gradient (not reset since the last "
                      "backward) cannot be accumulated: the float gradient it quantizes is no "
                      "longer held (the module's C layer was replaced since, by a move or "
                      "conversion, or the gradient came from a standalone Function call, whose "
                      "temporary layer is gone); this backward's replaces it", RuntimeWarning,
                      stacklevel=2)
    return held


def set_int8_grad(weight, grad, layer):
    """``weight.grad = grad`` for an int8 binary weight, remembered (with the C layer whose
    float gradient it quantizes) for :func:`held_float_grad`."""
    weight.grad = grad
    key = id(weight)
    if key not in _int8_grads or _int8_grads[key][0]() is not weight:
        ref = weakref.ref(weight, lambda _, key=key: _int8_grads.pop(key, None))
    else:
        ref = _int8_grads[key][0]
    _int8_grads[key] = (ref, weakref.ref(grad), grad._version, weakref.ref(layer))


def _new_output(shape, dtype, device, channels_last):
    """An empty output tensor (channels-last memory where the layer runs so) and its bie
    descriptor."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.empty(shape, dtype=dtype, device=device, memory_format=fmt)
    return out, describe(out, what="output", channels_last=channels_last)


class Layer:
    """A C layer of one kind (a key of :data:`KINDS`: ``"binary_linear"``,
    ``"binary_conv2d"``, ``"q4_linear"``, ``"q4_conv2d"``) on one device."""

    def __init__(self, kind, sizes, device=None, symmetric=True, dtype=torch.float32):
        """sizes: (in, out) for linear kinds; (in_c, out_c, kernel_size, stride, padding,
        dilation) for conv kinds. dtype: the layer's float dtype (float32 on the CPU)."""
        self.handle = None
        spec = _kind(kind)
        self.kind = kind
        self.spec = spec
        self.sizes = tuple(sizes)
        self.symmetric = bool(symmetric)
        self.dtype = dtype
        self.retired = False  # replaced by another layer (see rebuilt); its memory stays valid
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda:
            _probe_device(kind, self.device)
        self.binary = spec.binary
        self.conv = spec.conv
        self.generation = 0  # training forwards and state changes so far
        self.keep_inputs = False  # see functional: recompute a lost forward state
        # Under data parallelism: scale_a was found set (or set to the ranks' average) since
        # this layer was made or loaded (see distributed.agree_scale_a).
        self.scale_a_agreed = False
        args = spec.arguments(sizes, _lib.bie_device(self.device), _lib.float_dtype(dtype),
                              symmetric)
        create = _lib.function(spec.creator)
        self._free = _lib.function("bie_layer_free")
        self._forward = _lib.function("bie_layer_forward")
        self._backward = _lib.function("bie_layer_backward")
        self._param = _lib.function("bie_layer_param")
        self._grad = _lib.function("bie_layer_grad")
        self._set_wgrad_target = _lib.function("bie_layer_set_weight_grad_target")
        # weight_grad_into: (the tensor, its weight) for the next backward (held until it
        # runs); then (a weak reference to the weight, the tensor's address, its dtype) while
        # the layer's gradient views point into it
        self._wgrad_pending = None
        self._wgrad_target = None
        handle = ctypes.c_void_p()
        if self.is_cuda:
            _lib.enter_stream(self.device)
        _lib.check(create(ctypes.byref(handle), *args))
        self.handle = handle
        self._grad_desc = Tensor()  # reused by grad_copy
        desc = self.describe()
        if desc.kind != spec.code:
            fail(_lib.ERR_STATE, f"{spec.creator} made a layer of kind {desc.kind}, "
                 f"expected {spec.code}")
        # Input and output features (linear) or channels (conv).
        self.in_features, self.out_features = int(desc.in_), int(desc.out)
        self.training = bool(desc.training)  # the C layer's flag, mirrored
        self.channels_last = False  # the C layer's activation layout, mirrored
        self._nhwc_kernels = None  # whether it has NHWC kernels (asked on first need)
        self._out_shapes = {}  # conv: input shape -> output shape (checked once per shape)
        self._grad_views = {}  # CUDA: gradient -> (its buffer, a tensor over it)

    def __del__(self):
        handle, self.handle = getattr(self, "handle", None), None
        if handle is not None and getattr(self, "_free", None) is not None:
            self._free(handle)

    def _call(self, fn, *args):
        """``fn(handle, *args)`` on this layer's device (torch's current stream on CUDA);
        BieError on failure."""
        if self.is_cuda:
            _lib.enter_stream(self.device)
        _lib.check(fn(self.handle, *args))

    # -------------------------------------------------------------- what it is

    def describe(self):
        """The layer's ``bie_layer_desc`` (kind, sizes, device, mode, kernel, word size)."""
        desc = LayerDesc()
        _lib.check(_lib.function("bie_layer_describe")(self.handle, ctypes.byref(desc)))
        return desc

    @property
    def bits_binary_word(self):
        """Bits of a packed word (8, 32 or 64) for binary kinds; 0 for 4-bit kinds."""
        return self.describe().bits_binary_word

    @property
    def kernel_id(self):
        """The selected GEMM kernel (-1: the default for each shape)."""
        return self.describe().kernel_id

    # -------------------------------------------------------------- the calls

    def reset_parameters(self, seed):
        self._call(_lib.function("bie_layer_reset_parameters"),
                   ctypes.c_uint64(_lib.c_uint64(seed, "seed")))

    def set_weight_data(self, w):
        """w: a contiguous tensor kept alive by the caller during the call."""
        self._call(_lib.function("bie_layer_set_weight_data"),
                   ctypes.byref(describe(w, what="weight")))

    def prepare_params(self):
        self._call(_lib.function("bie_layer_prepare_params"))

    def generate_quantized_weight(self, qweight_only):
        self._call(_lib.function("bie_layer_generate_quantized_weight"), bool(qweight_only))

    def set_quantized_weight_data(self, q):
        self._call(_lib.function("bie_layer_set_quantized_weight_data"),
                   ctypes.byref(describe(q, packed=True, what="qweight")))

    def set_bits_binary_word(self, bits):
        self._call(_lib.function("bie_layer_set_bits_binary_word"),
                   _lib.c_int(bits, "bits_binary_word"))

    def runs_channels_last(self, x, packed=False):
        """Whether the C layer takes x as it is in NHWC memory: a 4-D float input that is
        channels-last contiguous (and not also contiguous) for a conv layer with NHWC
        kernels. Sets the layer's layout to match; the caller passes x itself then, else
        x.contiguous()."""
        nhwc = self.conv and channels_last_input(x, packed)
        if nhwc and self._nhwc_kernels is None:
            try:
                self._set_channels_last(True)
                self._nhwc_kernels = True
            except BieError:
                self._nhwc_kernels = False
        nhwc = nhwc and self._nhwc_kernels
        if nhwc != self.channels_last:
            self._set_channels_last(nhwc)
        return nhwc

    def input_view(self, x, packed=False):
        """x as the C layer takes it (see runs_channels_last): itself, or contiguous."""
        return x if self.runs_channels_last(x, packed) else x.contiguous()

    def output_view(self, out, x, packed=False):
        """The forward's output ``out`` for the input ``x`` in x's memory format, as torch's
        conv2d returns it: channels-last also where the layer ran on an NCHW copy."""
        if self.conv and not self.channels_last and channels_last_input(x, packed):
            return out.contiguous(memory_format=torch.channels_last)
        return out

    def _set_channels_last(self, on):
        self._call(_lib.function("bie_layer_set_channels_last"), bool(on))
        self.channels_last = bool(on)

    def check_forward(self, x, packed=False):
        """x: contiguous, or channels-last contiguous (the check reads its shape only)."""
        nhwc = (not packed and x.dim() == 4 and not x.is_contiguous()
                and x.is_contiguous(memory_format=torch.channels_last))
        self._call(_lib.function("bie_layer_check_forward"),
                   ctypes.byref(describe(x, packed=packed, what="input", channels_last=nhwc)))

    def set_activation(self, x, out):
        """x and out: as input_view gave x (the layer's layout set)."""
        nhwc = self.channels_last
        self._call(_lib.function("bie_layer_set_activation"),
                   ctypes.byref(describe(x, what="input", channels_last=nhwc)),
                   ctypes.byref(describe(out, what="output", channels_last=nhwc)))

    def init_scale_a(self, x):
        """If scale_a is 0, set it from x (set_activation without an output); x as
        input_view gave it."""
        self._call(_lib.function("bie_layer_set_activation"),
                   ctypes.byref(describe(x, what="input", channels_last=self.channels_last)),
                   None)

    def select_gemm_kernel(self, x):
        self._call(_lib.function("bie_layer_select_gemm_kernel"),
                   ctypes.byref(describe(x, what="input")))

    def set_gemm_kernel(self, kernel_id):
        self._call(_lib.function("bie_layer_set_gemm_kernel"),
                   _lib.c_int(kernel_id, "gemm_kernel_id"))

    BACKWARD_MODES = ("exact", "fp8")

    @property
    def backward_mode(self):
        """"exact" (SPEC) or "fp8" (the opt-in FP8 backward products; binary linear on CUDA
        devices with FP8 tensor cores)."""
        mode = ctypes.c_int(0)
        self._call(_lib.function("bie_layer_get_backward_mode"), ctypes.byref(mode))
        return self.BACKWARD_MODES[mode.value]

    def set_backward_mode(self, mode):
        if mode not in self.BACKWARD_MODES:
            raise ValueError(f"backward mode must be one of {self.BACKWARD_MODES}, not {mode!r}")
        self._call(_lib.function("bie_layer_set_backward_mode"),
                   self.BACKWARD_MODES.index(mode))

    def set_scale_a(self, value):
        self._call(_lib.function("bie_layer_set_scale_a"), ctypes.c_float(float(value)))

    def set_training(self, mode):
        """Training (True) or inference mode of the C layer; leaving training drops the state
        the last forward kept."""
        if bool(mode) != self.training:
            self._call(_lib.function("bie_layer_set_training"), bool(mode))
            self.training = bool(mode)
            self.changed()

    def changed(self):
        """Record that the state kept by the last training forward may be gone."""
        self.generation += 1

    # -------------------------------------------------------------- rebuilding

    def rebuilt(self, device=None, dtype=None):
        """A new C layer of this kind and sizes, on ``device`` with float dtype ``dtype``
        (default: this layer's), holding this layer's parameter values and settings: weight
        (float or int8, or none for an inference-only layer), qweight, bias_a, scale_a,
        scale_w, word size, training flag and the selected kernel where the new device and
        dtype still offer it. This layer is left as it was (a failure raises BieError before
        anything of it changed); the caller retires it (see ``retire``)."""
        device = self.device if device is None else torch.device(device)
        dtype = self.dtype if dtype is None else dtype
        new = Layer(self.kind, self.sizes, device, self.symmetric, dtype)
        new.keep_inputs = self.keep_inputs
        if self.binary and self.bits_binary_word != new.bits_binary_word:
            new.set_bits_binary_word(self.bits_binary_word)
        weight, qweight = self.view(WEIGHT), self.view(QWEIGHT)
        if weight is None:  # inference-only: the packed weight is all there is
            new.generate_quantized_weight(True)
        else:
            if weight.dtype == torch.int8 and new.view(WEIGHT).dtype != torch.int8:
                new.prepare_params()
            new.view(WEIGHT).copy_(weight)
        if qweight is not None:
            new.set_quantized_weight_data(qweight.to(device).contiguous())
        for which in (BIAS_A, SCALE_A, SCALE_W):  # as they are (an optimizer writes them so)
            new.view(which).copy_(self.view(which))
        kernel = self.kernel_id
        if kernel != -1:
            try:
                new.set_gemm_kernel(kernel)
            except BieError:
                pass  # a kernel of the old device or dtype: the new layer keeps the default
        if self.backward_mode != "exact":
            try:
                new.set_backward_mode(self.backward_mode)
            except BieError as e:  # e.g. moved to the CPU: the exact backward
                warnings.warn(f"bie: {e}; the layer uses the exact backward", stacklevel=3)
        new.set_training(self.training)
        return new

    def retire(self):
        """Mark this layer as replaced: tensors over its memory stay valid (they keep it
        alive), but a backward of a forward it ran raises instead of reaching the module's
        new layer."""
        self.retired = True
        self.changed()

    # -------------------------------------------------------------- parameters

    def view(self, which, grad=False):
        """A torch tensor over a parameter (or, with grad, a gradient of the last backward)
        in the layer's memory; None when the layer has none (e.g. no qweight yet)."""
        if grad:
            self._check_grad_view(which)
        d = Tensor()
        status = (self._grad if grad else self._param)(self.handle, which, ctypes.byref(d))
        if status == _lib.ERR_STATE:
            return None
        _lib.check(status)
        return _lib.wrap(d, self)

    def grad_copy(self, which):
        """A torch-owned copy of a gradient of the last backward (the layer overwrites its
        gradients on each backward); None before any backward."""
        self._check_grad_view(which)
        d = self._grad_desc
        status = self._grad(self.handle, which, d)
        if status == _lib.ERR_STATE:
            return None
        _lib.check(status)
        if d.device.type == _lib.DEVICE_CUDA:
            # The tensor over the layer's gradient buffer is made again only when the buffer
            # changed; it holds no reference to the layer (the layer holds it).
            key = (d.data, d.dtype, tuple(d.shape[:d.ndim]))
            view = self._grad_views.get(which)
            if view is None or view[0] != key:
                view = (key, _lib.wrap(d, None))
                self._grad_views[which] = view
            return view[1].clone()
        out = torch.empty(d.shape[:d.ndim], dtype=_lib.torch_dtype(d.dtype))
        ctypes.memmove(out.data_ptr(), d.data, out.numel() * out.element_size())
        return out

    def weight_grad_into(self, weight, dtype):
        """A fresh torch tensor shaped like ``weight`` that the next backward puts the
        weight's gradient into (``bie_layer_set_weight_grad_target``: on CUDA written there,
        no copy afterwards), for the caller to hand on as ``weight.grad``. Only a weak
        reference to the weight is kept after the backward, so that autograd takes the tensor
        as the gradient without a copy (it copies a tensor referenced elsewhere); the layer's
        views of that gradient then fail once ``weight.grad`` is no longer it
        (_check_grad_view)."""
        target = torch.empty(weight.shape, dtype=dtype, device=weight.device)
        _lib.check(self._set_wgrad_target(self.handle, ctypes.byref(
            describe(target, what="weight gradient"))))
        self._wgrad_pending = (target, weight)
        return target

    def _check_grad_view(self, which):
        """On CUDA the last backward's weight gradient may live in a weight_grad_into tensor
        (WEIGHT; WEIGHT_FLOAT_GRAD too for a float weight), valid while it is the weight's
        ``.grad`` (autograd keeps it there, or adds it into an earlier gradient and lets it
        go): fail if it is not."""
        if self._wgrad_target is None or which not in (WEIGHT, WEIGHT_FLOAT_GRAD):
            return
        ref, ptr, dtype = self._wgrad_target
        if which == WEIGHT_FLOAT_GRAD and dtype != torch.float32:
            return  # an int8 weight's float gradient stays in the layer's own buffer
        weight = ref()
        grad = weight.grad if weight is not None else None
        if grad is None or grad.data_ptr() != ptr:
            fail(_lib.ERR_STATE, f"{self.kind}: the last backward wrote the weight's gradient "
                 "into the tensor it handed on as weight.grad, which weight.grad no longer is "
                 "(reset, replaced, or added into an earlier gradient) and which has been freed "
                 "since; read weight.grad instead")

    # -------------------------------------------------------------- forward / backward

    def output_shape(self, x):
        """Shape of the forward's output for input x (checked by the library for convs, once
        per input shape: the forward checks every call again)."""
        if self.conv:
            known = self._out_shapes.get(tuple(x.shape))
            if known is not None:
                return known
            self.check_forward(x)
            in_shape = (ctypes.c_int64 * _lib.MAX_DIMS)(*x.shape)
            out_ndim = ctypes.c_int()
            out_shape = (ctypes.c_int64 * _lib.MAX_DIMS)()
            self._call(_lib.function("bie_layer_output_shape"), x.dim(), in_shape,
                       ctypes.byref(out_ndim), out_shape)
            shape = tuple(out_shape[:out_ndim.value])
            self._out_shapes[tuple(x.shape)] = shape
            return shape
        return tuple(x.shape[:-1]) + (self.out_features,)

    def forward(self, x, packed=False):
        """Run the C forward on x as input_view gave it; returns the output tensor (channels
        last where the layer runs so)."""
        out_dtype = x.dtype if x.is_floating_point() else torch.float32
        nhwc = self.channels_last
        out, od = _new_output(self.output_shape(x), out_dtype, x.device, nhwc)
        xd = describe(x, packed=packed, what="input", channels_last=nhwc)
        if self.is_cuda:
            _lib.enter_stream(self.device)
        _lib.check(self._forward(self.handle, xd, od))
        return out

    def forward_again(self, shape, dtype, channels_last=False):
        """The output of the last training forward computed again from what the C layer kept
        (bie_layer_forward_again; binary kinds): a new tensor of that forward's shape (as
        forward returned it), dtype and layout."""
        out, od = _new_output(shape, dtype, self.device, channels_last)
        self._call(_lib.function("bie_layer_forward_again"), ctypes.byref(od))
        return out

    def backward(self, grad_out, x_shape, want_grad_x, channels_last=False):
        """Run the C backward; returns grad_x (or None when not wanted). channels_last: the
        layout of the forward it follows (grad_out given in it, grad_x returned in it)."""
        gd = describe(grad_out, what="grad_output", channels_last=channels_last)
        grad_x = None
        gx_ptr = None
        if want_grad_x:
            fmt = torch.channels_last if channels_last else torch.contiguous_format
            grad_x = torch.empty(x_shape, dtype=grad_out.dtype, device=grad_out.device,
                                 memory_format=fmt)
            gx_ptr = ctypes.byref(describe(grad_x, what="grad_input",
                                           channels_last=channels_last))
        pending, self._wgrad_pending = self._wgrad_pending, None
        try:
            self._call(self._backward, ctypes.byref(gd), gx_ptr)
        except BaseException:
            if pending is not None:  # not left set for a later backward: the tensor may go
                self._set_wgrad_target(self.handle, None)
            raise
        # where the layer's weight gradient views point now (CPU layers copy into the target)
        self._wgrad_target = None
        if pending is not None and self.is_cuda:
            target, weight = pending
            self._wgrad_target = (weakref.ref(weight), target.data_ptr(), target.dtype)
        return grad_x


__all__ = ["Layer", "KINDS", "BieError", "WEIGHT", "QWEIGHT", "BIAS_A", "SCALE_A", "SCALE_W",
           "WEIGHT_FLOAT_GRAD"]
