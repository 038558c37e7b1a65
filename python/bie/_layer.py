"""One C layer handle (``bie_binary_linear *`` and friends) and the calls made on it.

A :class:`Layer` owns the handle, turns every failing status into :class:`BieError`, makes
torch tensors over the layer's parameters and gradients, and counts the training forwards
it runs (``generation``) so that a backward can tell whether the state the C layer kept for
it is still there.
"""

import ctypes

import torch

from . import _lib
from ._lib import BieError, Tensor, describe, fail

# bie_param (bie.h)
WEIGHT, QWEIGHT, BIAS_A, SCALE_A, SCALE_W, WEIGHT_FLOAT_GRAD = range(6)

# Kinds and what they can do.
BINARY_KINDS = ("binary_linear", "binary_conv2d")
CONV_KINDS = ("binary_conv2d", "q4_conv2d")

_probed_devices = {}


def _probe_device(kind, device):
    """Raise a clear BieError when this libbie cannot run ``kind`` layers on ``device``.

    The library answers by itself: creating a 1x1 layer there either works or fails with
    its reason. The answer is cached per (kind, device).
    """
    key = (kind, device.type, device.index)
    reason = _probed_devices.get(key)
    if reason is None:
        bdev = _lib.bie_device(device)
        handle = ctypes.c_void_p()
        create = _lib.function(f"bie_{kind}_create")
        if kind in CONV_KINDS:
            args = (1, 1, 1, 1, 0, 1, bdev, _lib.F32)
        else:
            args = (1, 1, bdev, _lib.F32)
        if kind in BINARY_KINDS:
            args += (True,)
        status = create(ctypes.byref(handle), *args)
        if status == 0:
            _lib.function(f"bie_{kind}_free")(handle)
            reason = ""
        else:
            reason = (f"{kind} layers on {device} are not supported yet by this build of "
                      f"libbie ({_lib.library_path()}): "
                      f"{_lib.lib().bie_last_error().decode(errors='replace')}")
        _probed_devices[key] = reason
    if reason:
        fail(_lib.ERR_UNSUPPORTED, reason)


class Layer:
    """A C layer of one kind (``"binary_linear"``, ``"binary_conv2d"``, ``"q4_linear"``,
    ``"q4_conv2d"``) on one device."""

    def __init__(self, kind, sizes, device=None, symmetric=True, dtype=torch.float32):
        """sizes: (in, out) for linear kinds; (in_c, out_c, kernel_size, stride, padding,
        dilation) for conv kinds. dtype: the layer's float dtype (float32 on the CPU)."""
        self.handle = None
        self.kind = kind
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda:
            _probe_device(kind, self.device)
        self.binary = kind in BINARY_KINDS
        self.conv = kind in CONV_KINDS
        self.generation = 0  # training forwards and state changes so far
        # Input and output features (linear) or channels (conv).
        self.in_features, self.out_features = int(sizes[0]), int(sizes[1])
        self._fns = {}
        self.training = True  # the C layer's flag (layers start in training mode)
        self.keep_inputs = False  # see functional: recompute a lost forward state
        bie_dtype = _lib.float_dtype(dtype)
        args = tuple(int(s) for s in sizes) + (_lib.bie_device(self.device), bie_dtype)
        if self.binary:
            args += (bool(symmetric),)
        handle = ctypes.c_void_p()
        if self.is_cuda:
            _lib.enter_stream(self.device)
        _lib.check(_lib.function(f"bie_{kind}_create")(ctypes.byref(handle), *args))
        self.handle = handle
        self._free = _lib.function(f"bie_{kind}_free")
        self._forward = self.fn("forward")
        self._grad = self.fn("grad")
        self._grad_desc = Tensor()  # reused by grad_copy

    def __del__(self):
        handle, self.handle = getattr(self, "handle", None), None
        if handle is not None and getattr(self, "_free", None) is not None:
            self._free(handle)

    def fn(self, op):
        """The C function ``bie_<kind>_<op>``."""
        f = self._fns.get(op)
        if f is None:
            f = self._fns[op] = _lib.function(f"bie_{self.kind}_{op}")
        return f

    def __call__(self, op, *args):
        """Call ``bie_<kind>_<op>(handle, *args)``; BieError on failure."""
        if self.is_cuda:
            _lib.enter_stream(self.device)
        _lib.check(self.fn(op)(self.handle, *args))

    def query(self, op):
        """Value of a getter without status (``training``, ``gemm_kernel``, ...)."""
        return self.fn(op)(self.handle)

    def set_training(self, mode):
        """Training (True) or inference mode of the C layer; leaving training drops the state
        the last forward kept."""
        if bool(mode) != self.training:
            self("set_training", bool(mode))
            self.training = bool(mode)
            self.changed()

    def changed(self):
        """Record that the state kept by the last training forward may be gone."""
        self.generation += 1

    # -------------------------------------------------------------- parameters

    def view(self, which, grad=False):
        """A torch tensor over a parameter (or, with grad, a gradient of the last backward)
        in the layer's memory; None when the layer has none (e.g. no qweight yet)."""
        d = Tensor()
        status = self.fn("grad" if grad else "param")(self.handle, which, ctypes.byref(d))
        if status == _lib.ERR_STATE:
            return None
        _lib.check(status)
        return _lib.wrap(d, self)

    def grad_copy(self, which):
        """A torch-owned copy of a gradient of the last backward (the layer overwrites its
        gradients on each backward); None before any backward."""
        d = self._grad_desc
        status = self._grad(self.handle, which, d)
        if status == _lib.ERR_STATE:
            return None
        _lib.check(status)
        if d.device.type == _lib.DEVICE_CUDA:
            return _lib.wrap(d, self).clone()
        out = torch.empty(d.shape[:d.ndim], dtype=_lib.torch_dtype(d.dtype))
        ctypes.memmove(out.data_ptr(), d.data, out.numel() * out.element_size())
        return out

    def set_scale_a(self, value):
        self("set_scale_a", ctypes.c_float(float(value)))

    # -------------------------------------------------------------- forward / backward

    def output_shape(self, x):
        """Shape of the forward's output for input x (checked by the library for convs)."""
        if self.conv:
            xd = describe(x, what="input")
            self("check_forward", ctypes.byref(xd))
            oh, ow = ctypes.c_int64(), ctypes.c_int64()
            self("output_size", x.shape[2], x.shape[3], ctypes.byref(oh), ctypes.byref(ow))
            return (x.shape[0], self.out_features, oh.value, ow.value)
        return tuple(x.shape[:-1]) + (self.out_features,)

    def forward(self, x, packed=False):
        """Run the C forward on contiguous x; returns the output tensor."""
        out_dtype = x.dtype if x.is_floating_point() else torch.float32
        out = torch.empty(self.output_shape(x), dtype=out_dtype, device=x.device)
        xd = describe(x, packed=packed, what="input")
        od = describe(out, what="output")
        if self.is_cuda:
            _lib.enter_stream(self.device)
        _lib.check(self._forward(self.handle, xd, od))
        return out

    def backward(self, grad_out, x_shape, want_grad_x):
        """Run the C backward; returns grad_x (or None when not wanted)."""
        gd = describe(grad_out, what="grad_output")
        grad_x = None
        gx_ptr = None
        if want_grad_x:
            grad_x = torch.empty(x_shape, dtype=grad_out.dtype, device=grad_out.device)
            gx_ptr = ctypes.byref(describe(grad_x, what="grad_input"))
        self("backward", ctypes.byref(gd), gx_ptr)
        return grad_x


__all__ = ["Layer", "BieError", "WEIGHT", "QWEIGHT", "BIAS_A", "SCALE_A", "SCALE_W",
           "WEIGHT_FLOAT_GRAD"]
