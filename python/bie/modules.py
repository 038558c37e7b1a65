"""``torch.nn.Module``s with the seed classes' names and methods, backed by bie's C layers.

Where the parameters live: in the C layer. ``weight``, ``qweight``, ``bias_a``, ``scale_a`` and
``scale_w`` are ordinary ``nn.Parameter``s whose storage *is* the layer's memory (made with
``torch.frombuffer`` over the pointers ``bie_layer_param`` returns). An optimizer updating them in
place updates the layer; the forward reads them where they are, so no parameter is copied on
any call.

Calls that make bie replace a buffer (``prepare_params``, ``generate_quantized_weight``,
``reset_parameters``, ``set_weight_data``, ``set_quantized_weight_data``,
``set_bits_binary_word``) and moves or conversions (``.to()``, ``.cuda()``, ``.half()`` ...) run
on a new C layer holding the module's state, which then takes the old one's place (see
``_BieLayerModule._install``): Parameter objects whose dtype and shape stay the same keep their
identity (``.data`` swapped, as torch's ``Module._apply`` does), the others are new objects;
the old layer is retired, not freed, so every tensor over its memory stays valid. State dicts
are copies. Parameters replaced by other tensors (``module.weight = ...``) are detected at the
next forward.
"""

from collections import OrderedDict

import torch
from torch import nn

from . import _compile, _lib, distributed
from ._layer import BIAS_A, QWEIGHT, SCALE_A, SCALE_W, WEIGHT, WEIGHT_FLOAT_GRAD, Layer
from ._lib import WORD_DTYPE, BieError, fail
from .functional import (BinaryConv2dForward, BinaryLinearForward, Q4Conv2dCutlassForward,
                         Q4LinearForward)

_PARAMS = (("weight", WEIGHT), ("qweight", QWEIGHT), ("bias_a", BIAS_A),
           ("scale_a", SCALE_A), ("scale_w", SCALE_W))
_LEARNABLE = ("weight", "bias_a", "scale_a")  # float weights only: int8 ones use weight.grad


def _autocast_dtype(x):
    """The autocast dtype in effect for tensors on x's device type, or None."""
    kind = x.device.type
    try:  # torch >= 2.4
        if torch.is_autocast_enabled(kind):
            return torch.get_autocast_dtype(kind)
        return None
    except TypeError:
        pass
    if kind == "cuda" and torch.is_autocast_enabled():
        return torch.get_autocast_gpu_dtype()
    if kind == "cpu" and torch.is_autocast_cpu_enabled():
        return torch.get_autocast_cpu_dtype()
    return None


def _seed_from_torch():
    """A seed for bie's generator drawn from torch's, so torch.manual_seed decides it."""
    return int(torch.randint(0, 2 ** 62, (1,)).item())


def _parameter(name, view):
    """The module's Parameter ``name`` over the layer's buffer ``view``; scale_a is marked
    (``_bie_scale_a``) for SignFlip's ``scale_a_floor``."""
    learnable = name in _LEARNABLE and view.is_floating_point()
    p = nn.Parameter(view, requires_grad=learnable)
    if name == "scale_a":
        p._bie_scale_a = True
    return p


class _BieLayerModule(nn.Module):
    """What every bie module shares: the C layer, its parameters as torch views, life cycle."""

    _kind = None

    def _setup(self, sizes, device, dtype, symmetric, keep_inputs):
        self._layer = Layer(self._kind, sizes, device, symmetric, dtype)
        self._layer.keep_inputs = bool(keep_inputs)
        self._layer_args = (tuple(sizes), self._layer.device, symmetric, dtype)
        self.device = self._layer.device
        self.dtype = dtype
        self._qweight_installed = False  # qweight set by the user, not derived from weight
        self._expected = ()  # (name, Parameter, data pointer) of the layer's views
        for name, _ in _PARAMS:
            self.register_parameter(name, None)
        self._sync()
        _compile.register(self)

    # ---------------------------------------------------------------- parameters

    def _sync(self, force=False):
        """Make the module's Parameters the views of the layer's current buffers."""
        for name, which in _PARAMS:
            view = self._layer.view(which)
            current = self._parameters.get(name)
            if view is None:
                self._parameters[name] = None
                continue
            if (not force and current is not None and current.data_ptr() == view.data_ptr()
                    and current.dtype == view.dtype and current.shape == view.shape):
                continue
            self._parameters[name] = _parameter(name, view)
        self._remember()

    def _remember(self):
        self._expected = tuple((name, p, p.data_ptr()) for name, p in self._parameters.items()
                               if p is not None)

    def _params_intact(self):
        params = self._parameters
        for name, p, ptr in self._expected:
            if params.get(name) is not p or p.data_ptr() != ptr:
                return False
        return True

    def _check_params(self):
        if not self._params_intact():
            fail(_lib.ERR_STATE, f"{type(self).__name__}: a parameter no longer lives in the "
                 "bie layer's memory (it was replaced); load values with set_weight_data() "
                 "or load_state_dict(), and move or convert the module with .to() / .cuda() "
                 "/ .half() ...")

    def _install(self, new):
        """Make ``new`` (a C layer holding this module's state) the module's layer.

        The old layer is retired, not freed: tensors over its memory (parameters or views of
        them held elsewhere) keep it alive and stay valid, detached from the module. Each
        Parameter object whose dtype and shape are unchanged stays the same object, its
        ``.data`` now the new layer's memory (as torch's own ``Module._apply`` does), so an
        optimizer holding it keeps working; its gradient moves along. A parameter whose dtype
        or shape changes (the weight becoming int8 in prepare_params, qweight under a new word
        size) gets a new Parameter object."""
        old, self._layer = self._layer, new
        old.retire()
        for name, which in _PARAMS:
            view = new.view(which)
            current = self._parameters.get(name)
            if view is None:
                self._parameters[name] = None
            elif (current is not None and current.dtype == view.dtype
                  and current.shape == view.shape):
                grad, current.grad = current.grad, None
                current.data = view
                if grad is not None:
                    current.grad = grad.to(view.device)
            else:
                self._parameters[name] = _parameter(name, view)
        self._remember()
        self.device, self.dtype = new.device, new.dtype
        self._layer_args = (new.sizes, new.device, new.symmetric, new.dtype)

    def _lifecycle(self, call, *args):
        """Run ``call`` (the name of a method of the C layer that may replace buffers) on a
        copy of the layer, then make the copy the module's layer. A failing call leaves the
        module as it was; views of the old buffers stay valid (see _install)."""
        new = self._layer.rebuilt()
        getattr(new, call)(*args)
        new.changed()
        self._install(new)

    # ---------------------------------------------------------------- moving and converting

    def _target_of(self, fn):
        """The (device, float dtype) ``fn`` (what ``Module._apply`` applies to every tensor)
        converts this layer's float tensors to, found by applying it to a one-element tensor
        of the layer's device and dtype."""
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        out = fn(probe)
        if not torch.is_tensor(out):
            return self.device, self.dtype
        return out.device, out.dtype

    def _move(self, device, dtype):
        """Rebuild the C layer on ``device`` with compute dtype ``dtype``; BieError (the module
        unchanged) where the library has no such layer."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        supported = ("bie layers run in float32 on the CPU and in float32, bfloat16 or "
                     "float16 on CUDA")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16) or (
                device.type == "cpu" and dtype != torch.float32):
            fail(_lib.ERR_DTYPE, f"{type(self).__name__} on {self.device} cannot be converted "
                 f"to {dtype} on {device}: {supported}; the module is unchanged")
        if device.type not in ("cpu", "cuda"):
            fail(_lib.ERR_DEVICE, f"{type(self).__name__} cannot be moved to {device}: bie has "
                 "CPU and CUDA layers; the module is unchanged")
        self._install(self._layer.rebuilt(device, dtype))

    def _apply(self, fn, *args, **kwargs):
        """``.to()``, ``.cuda()``, ``.cpu()``, ``.half()``, ``.bfloat16()``, ``.float()`` ...
        rebuild the C layer on the target device with the target compute dtype, with the same
        parameter values and settings (see _install for what happens to the Parameter
        objects). Parameters stay float32 (int8 / packed words where they are): the dtype is
        the one of inputs and outputs, as bie's layers keep float32 master values on every
        device."""
        device, dtype = self._target_of(fn)
        if (device, dtype) != (self.device, self.dtype):
            self._move(device, dtype)
        for module in self.children():
            module._apply(fn, *args, **kwargs)
        for key, buf in self._buffers.items():
            if buf is not None:
                self._buffers[key] = fn(buf)
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        weight = state_dict.get(prefix + "weight")
        qweight = state_dict.get(prefix + "qweight")
        mine = self._parameters.get("weight")
        if (weight is not None and mine is not None and weight.dtype == torch.int8
                and mine.dtype != torch.int8):
            self.prepare_params()  # a trained (int8) weight goes into an int8 layer
        elif (weight is not None and mine is not None and weight.is_floating_point()
              and mine.dtype == torch.int8):
            self.reset_parameters()  # an unprepared (float) weight needs a float layer
        if qweight is not None and self._parameters.get("qweight") is None:
            self.set_quantized_weight_data(qweight)
        if weight is None and qweight is not None and mine is not None:
            self.generate_quantized_weight(qweight_only=True)  # an inference-only model
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._layer.scale_a_agreed = False  # a loaded scale_a may be 0 (measure it again)
        if qweight is not None:  # saved beside its weight, qweight was derived from it
            self._qweight_installed = weight is None

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """State dicts are snapshots: each value is a copy of the parameter (the Parameter
        itself with keep_vars), so later training, ``train()`` / ``eval()`` or calls that
        replace the layer's buffers never change a state dict already taken."""
        for name, p in self._parameters.items():
            if p is not None:
                destination[prefix + name] = p if keep_vars else p.detach().clone()

    # ---------------------------------------------------------------- copy and pickle

    def __getstate__(self):
        """The module without its C layer: parameter values as plain tensors and what is
        needed to rebuild the layer (used by copy.deepcopy, pickle and torch.save)."""
        state = self.__dict__.copy()
        layer = state.pop("_layer")
        state.pop("_expected")
        state["_parameters"] = OrderedDict(
            (name, None if p is None else p.detach().clone())
            for name, p in self._parameters.items())
        desc = layer.describe()
        state["_bie_layer"] = {"training": layer.training, "keep_inputs": layer.keep_inputs,
                               "bits": desc.bits_binary_word if layer.binary else 8,
                               "kernel": desc.kernel_id}
        return state

    def __setstate__(self, state):
        """Rebuild the C layer from __getstate__'s values. The device is the one the saved
        values were loaded to (``torch.load(..., map_location=...)`` moves a model); a layer
        loaded to the CPU runs in float32."""
        info = state.pop("_bie_layer")
        values = state.pop("_parameters")
        super().__setstate__(state)
        sizes, device, symmetric, dtype = self._layer_args
        loaded = [v for v in values.values() if v is not None]
        if loaded:
            device = loaded[0].device
        if torch.device(device).type == "cpu":
            dtype = torch.float32
        self._layer = Layer(self._kind, sizes, device, symmetric, dtype)
        self._layer.keep_inputs = info["keep_inputs"]
        self._parameters = OrderedDict((name, None) for name in values)
        self._expected = ()
        self._sync()
        self._layer_args = (tuple(sizes), self._layer.device, symmetric, dtype)
        self.device, self.dtype = self._layer.device, dtype
        if self._layer.binary and info["bits"] != 8:
            self.set_bits_binary_word(info["bits"])
        self.load_state_dict({k: v for k, v in values.items() if v is not None}, strict=False)
        if info["kernel"] != -1:
            try:
                self.gemm_kernel_id = info["kernel"]
            except BieError:
                pass  # a kernel of another device: the default one
        self._layer.set_training(info["training"])
        _compile.register(self)

    # ---------------------------------------------------------------- the seed's methods

    def reset_parameters(self, seed=None):
        """Kaiming-uniform weight from a generator seeded with ``seed`` (default: drawn from
        torch's generator); the weight becomes float again."""
        seed = _seed_from_torch() if seed is None else _lib.c_uint64(seed, "seed")
        self._lifecycle("reset_parameters", seed)
        self._qweight_installed = False

    def prepare_params(self):
        """SPEC §2/§4 prepare_params (binary: the weight becomes int8). Call before training
        and before creating the optimizer."""
        self._lifecycle("prepare_params")

    def set_weight_data(self, x):
        """Copy x (the layer's shape and dtype) into the weight, then prepare_params."""
        x = x.detach().contiguous()
        self._lifecycle("set_weight_data", x)
        self._qweight_installed = False

    def generate_quantized_weight(self, qweight_only=False):
        """Pack the weight into ``qweight``; with qweight_only, free the weight
        (inference-only layer)."""
        self._lifecycle("generate_quantized_weight", bool(qweight_only))
        self._qweight_installed = False

    def set_quantized_weight_data(self, x):
        """Install packed weights (binary: words of bits_binary_word bits as uint8 / int32 /
        int64; 4-bit: uint8 nibbles); used by inference from then on."""
        x = x.detach().contiguous()
        self._lifecycle("set_quantized_weight_data", x)
        self._qweight_installed = True

    @property
    def opt_weight(self):
        """The weight in training mode; in inference mode the packed weight (made if absent)."""
        if self.training:
            return self.weight
        if self.qweight is None:
            self.generate_quantized_weight(False)
        return self.qweight

    def _check_forward(self, x):
        """Raise BieError if x cannot be this layer's input."""
        x = x.contiguous()
        packed = self._layer.binary and not x.is_floating_point()
        self._layer.check_forward(x, packed)

    def set_activation(self, x):
        """Initialise scale_a from x if it is 0 and return ``x + bias_a`` (computed by bie;
        not part of the autograd graph: forward applies bias_a itself)."""
        x = self._layer.input_view(x.detach())
        out = torch.empty_like(x)  # in x's layout
        self._layer.set_activation(x, out)
        return out

    def select_gemm_kernel(self, x):
        """Time every bie kernel of this layer's op and device that can run this input's
        product and keep the fastest; returns its id. Changes no parameter."""
        x = x.detach().contiguous()
        self._layer.select_gemm_kernel(x)
        return self.gemm_kernel_id

    @property
    def gemm_kernel_id(self):
        """The selected bie kernel id (-1: the default for each shape); see bie.kernels()."""
        return self._layer.kernel_id

    @gemm_kernel_id.setter
    def gemm_kernel_id(self, kernel_id):
        self._layer.set_gemm_kernel(_lib.c_int(kernel_id, "gemm_kernel_id"))

    @property
    def backward_mode(self):
        """The precision of the backward products: "exact" (the default, SPEC) or "fp8" (opt-in
        for binary linear layers on CUDA devices with FP8 tensor cores: grad_out rounded to
        e4m3 at a per-tensor scale, the ±1 operands exact; the FP8 tensor cores sum at a lower
        precision than float32). Faster at large shapes only (a 4096 x 4096 bf16 layer's
        step: 427 against 539 µs exact on an H200); batch, in and out features that are not
        multiples of 16 run the exact products. Binary conv layers take it for grad_x only (16-bit,
        channels-last, compute capability 9.0; grad_w stays exact). Kept across ``.to()``; a
        device without FP8 falls back to "exact" with a warning."""
        return self._layer.backward_mode

    @backward_mode.setter
    def backward_mode(self, mode):
        self._layer.set_backward_mode(mode)

    def describe(self):
        """What the C layer reports about itself (``bie_layer_describe``), as a dict: kind
        ("binary_linear", "binary_conv2d", "q4_linear", "q4_conv2d"), in and out (features or
        channels), fan_in, kernel_size / stride / padding / dilation (conv kinds, else 0),
        device, dtype, symmetric, training (the C layer's mode), kernel_id and
        bits_binary_word (binary kinds, else 0)."""
        d = self._layer.describe()
        if d.device.type == _lib.DEVICE_CUDA:
            device = torch.device("cuda", d.device.index)
        else:
            device = torch.device("cpu")
        return {"kind": d.name.decode(), "in": d.in_, "out": d.out, "fan_in": d.fan_in,
                "kernel_size": d.kernel_size, "stride": d.stride, "padding": d.padding,
                "dilation": d.dilation, "device": device, "dtype": _lib.torch_dtype(d.dtype),
                "symmetric": bool(d.symmetric), "training": bool(d.training),
                "kernel_id": d.kernel_id, "bits_binary_word": d.bits_binary_word}

    def weight_float_grad(self):
        """The float gradient of the weight from the last backward (binary layers also give
        the int8-quantized one in ``weight.grad``); None before any backward. On CUDA a float
        weight's gradient is written straight into ``weight.grad``, so it is read from there:
        BieError once ``weight.grad`` has been reset or replaced since."""
        return self._layer.grad_copy(WEIGHT_FLOAT_GRAD)

    def train(self, mode=True):
        """Training or inference mode. Entering inference packs qweight from the current
        weight (unless qweight was installed by set_quantized_weight_data), so inference
        always uses the trained weight."""
        if (not mode and self._layer.training and self._parameters.get("weight") is not None
                and not self._qweight_installed):
            self.generate_quantized_weight(False)
        self._layer.set_training(mode)
        return super().train(mode)

    @property
    def keep_inputs(self):
        """Keep a reference to each training input so a backward whose forward state was
        replaced by a later forward can run it again (more memory; off by default)."""
        return self._layer.keep_inputs

    @keep_inputs.setter
    def keep_inputs(self, value):
        self._layer.keep_inputs = bool(value)

    def forward(self, x):
        compiled = _compile.compiling() and x.is_floating_point()
        if not compiled:
            self._check_params()
        cast = _autocast_dtype(x)
        # Under autocast: the input in the layer's dtype, the output in the autocast dtype
        # (what torch's linear and conv2d return there).
        if cast is not None and x.is_floating_point() and x.dtype != self.dtype:
            x = x.to(self.dtype)
        out = _compile.forward(self, x) if compiled else self._forward(x)
        return out if cast is None or out.dtype == cast else out.to(cast)

    def _layer_forward(self, x):
        """The forward after autocast's conversion, run by the compiled call's operator."""
        self._check_params()
        return self._forward(x)

    def _compile_params(self):
        """The parameters a compiled call passes to its operator, in a fixed order."""
        return [p for p in self._parameters.values() if p is not None]

    def _forward(self, x):
        if not self.training and not (x.requires_grad and torch.is_grad_enabled()):
            # Inference keeps nothing for a backward: no autograd node, the C call only.
            out = self._inference(x)
            if self._parameters.get("qweight") is None:
                self._sync()  # bie packed qweight on first use
            return out
        params = self._parameters
        weight = params["weight"] if params["weight"] is not None else params["qweight"]
        return self._apply_function(x, weight)

    def _inference(self, x):
        layer = self._layer
        layer.set_training(False)
        packed = layer.binary and not x.is_floating_point()
        x_in, x = x, layer.input_view(x, packed)  # a copy only for non-contiguous input
        sync = distributed.active()  # inside a DistributedDataParallel forward
        if sync is not None and not packed:
            distributed.agree_scale_a(layer, x if layer.conv or x.dim() <= _lib.MAX_DIMS
                                      else x.reshape(-1, x.shape[-1]), sync)
        if not layer.conv and x.dim() > _lib.MAX_DIMS:  # bie tensors have rank <= 4
            return layer.forward(x.reshape(-1, x.shape[-1]), packed).reshape(
                tuple(x.shape[:-1]) + (layer.out_features,))
        return layer.output_view(layer.forward(x, packed), x_in, packed)


class _BinaryMixin:
    """Binary layers: the word size of packed weights and inputs."""

    def set_bits_binary_word(self, num_bit):
        """Words of 8, 32 or 64 bits for packed weights and inputs."""
        self._lifecycle("set_bits_binary_word",
                        _lib.c_int(num_bit, "bits_binary_word"))

    @property
    def bits_binary_word(self):
        return self._layer.bits_binary_word

    @property
    def word_dtype(self):
        """torch dtype of packed words (uint8, int32 or int64 for 8, 32, 64 bits)."""
        return WORD_DTYPE[self.bits_binary_word]


class BinaryLinearBase(_BinaryMixin, _BieLayerModule):
    """Binary linear layer (seed ``BinaryLinearBase``; SPEC §2) on bie's binary linear layer.

    ``BinaryLinearBase(input_features, out_features, device=None, dtype=torch.float32,
    symmetric=True, keep_inputs=False)``. Input ``[..., input_features]`` float32 (or packed
    words in inference), output ``[..., out_features]``.
    """

    _kind = "binary_linear"

    def __init__(self, input_features, out_features, device=None, dtype=torch.float32,
                 symmetric=True, keep_inputs=False):
        super().__init__()
        self.input_features = _lib.c_int64(input_features, "input_features")
        self.output_features = _lib.c_int64(out_features, "out_features")
        self.symmetric = bool(symmetric)
        self._setup((input_features, out_features), device, dtype, symmetric, keep_inputs)

    in_features = property(lambda self: self.input_features)
    out_features = property(lambda self: self.output_features)

    def _apply_function(self, x, weight):
        p = self._parameters
        return BinaryLinearForward.apply(x, weight, p["scale_a"], p["scale_w"], -1,
                                         self.training, p["bias_a"], self._layer)

    def extra_repr(self):
        return (f"input_features={self.input_features}, out_features={self.output_features}, "
                f"symmetric={self.symmetric}, bits_binary_word={self.bits_binary_word}")


class BinaryLinearCutlass(BinaryLinearBase):
    """Seed ``BinaryLinearCutlass``: the same layer (bie picks CPU or GPU kernels itself)."""


class BinaryConv2dBase(_BinaryMixin, _BieLayerModule):
    """Binary conv2d layer (SPEC §3) on bie's binary conv2d layer: NCHW, square kernel,
    zero padding, groups = 1.

    ``BinaryConv2dBase(in_channels, out_channels, kernel_size, stride=1, padding=0,
    dilation=1, device=None, dtype=torch.float32, symmetric=True, keep_inputs=False)``.
    """

    _kind = "binary_conv2d"

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 device=None, dtype=torch.float32, symmetric=True, keep_inputs=False):
        super().__init__()
        self.in_channels = _lib.c_int64(in_channels, "in_channels")
        self.out_channels = _lib.c_int64(out_channels, "out_channels")
        self.kernel_size = _lib.c_int(kernel_size, "kernel_size")
        self.stride = _lib.c_int(stride, "stride")
        self.padding = _lib.c_int(padding, "padding")
        self.dilation = _lib.c_int(dilation, "dilation")
        self.symmetric = bool(symmetric)
        self._setup((in_channels, out_channels, kernel_size, stride, padding, dilation), device,
                    dtype, symmetric, keep_inputs)

    def _apply_function(self, x, weight):
        p = self._parameters
        return BinaryConv2dForward.apply(x, weight, p["scale_a"], p["scale_w"], self.training,
                                         self.kernel_size, self.stride, self.padding,
                                         self.dilation, p["bias_a"], self._layer)

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, dilation={self.dilation}")


class BinaryConv2dCutlass(BinaryConv2dBase):
    """Seed ``BinaryConv2dCutlass``: the same layer as BinaryConv2dBase."""


class Q4LinearCutlass(_BieLayerModule):
    """4-bit linear layer (SPEC §4 with a matrix product) on bie's 4-bit linear layer.

    ``Q4LinearCutlass(input_features, out_features, device=None, dtype=torch.float32,
    keep_inputs=False)``; the weight stays float32 (straight-through training).
    """

    _kind = "q4_linear"

    def __init__(self, input_features, out_features, device=None, dtype=torch.float32,
                 keep_inputs=False):
        super().__init__()
        self.input_features = _lib.c_int64(input_features, "input_features")
        self.output_features = _lib.c_int64(out_features, "out_features")
        self._setup((input_features, out_features), device, dtype, True, keep_inputs)

    in_features = property(lambda self: self.input_features)
    out_features = property(lambda self: self.output_features)

    def _apply_function(self, x, weight):
        p = self._parameters
        return Q4LinearForward.apply(x, weight, p["scale_a"], p["scale_w"], self.training,
                                     p["bias_a"], self._layer)

    def extra_repr(self):
        return f"input_features={self.input_features}, out_features={self.output_features}"


class Q4Conv2dCutlass(_BieLayerModule):
    """4-bit conv2d layer (seed ``Q4Conv2dCutlass``; SPEC §4) on bie's 4-bit conv2d layer:
    NCHW, zero padding, any channel count.

    ``Q4Conv2dCutlass(in_channels, out_channels, kernel_size, stride=1, padding=0,
    dilation=1, device=None, dtype=torch.float32, keep_inputs=False)``.
    """

    _kind = "q4_conv2d"

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 device=None, dtype=torch.float32, keep_inputs=False):
        super().__init__()
        self.in_channels = _lib.c_int64(in_channels, "in_channels")
        self.out_channels = _lib.c_int64(out_channels, "out_channels")
        self.kernel_size = _lib.c_int(kernel_size, "kernel_size")
        self.stride = _lib.c_int(stride, "stride")
        self.padding = _lib.c_int(padding, "padding")
        self.dilation = _lib.c_int(dilation, "dilation")
        self._setup((in_channels, out_channels, kernel_size, stride, padding, dilation), device,
                    dtype, True, keep_inputs)

    def _apply_function(self, x, weight):
        p = self._parameters
        return Q4Conv2dCutlassForward.apply(x, weight, p["scale_a"], p["scale_w"],
                                            self.training, self.kernel_size, self.stride,
                                            self.padding, self.dilation, p["bias_a"],
                                            self._layer)

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, dilation={self.dilation}")


class RPReLU(nn.Module):
    """ReActNet's RPReLU over dim 1 (``[N, C]`` or ``[N, C, H, W]``) in plain torch (no C
    layer): the ``rprelu`` node of bie's models (bie_train.h) that ``bie.export`` writes.
    ``t = x + shift_in; y = prelu(t, weight) + shift_out``, one value per channel of each
    parameter: ``shift_in`` (zeros), ``weight`` (slopes, 0.25), ``shift_out`` (zeros)."""

    def __init__(self, channels, device=None, dtype=torch.float32):
        super().__init__()
        self.channels = _lib.c_int64(channels, "channels")
        if self.channels < 1:
            raise ValueError(f"RPReLU: channels must be >= 1, got {channels}")
        kw = {"device": device, "dtype": dtype}
        self.shift_in = nn.Parameter(torch.zeros(self.channels, **kw))
        self.weight = nn.Parameter(torch.full((self.channels,), 0.25, **kw))
        self.shift_out = nn.Parameter(torch.zeros(self.channels, **kw))

    def forward(self, x):
        shape = (1, -1) + (1,) * (x.dim() - 2)
        t = x + self.shift_in.view(shape)
        return nn.functional.prelu(t, self.weight) + self.shift_out.view(shape)

    def extra_repr(self):
        return f"{self.channels}"


BIE_MODULES = (BinaryLinearBase, BinaryConv2dBase, Q4LinearCutlass, Q4Conv2dCutlass)


def prepare_bie_layers(model):
    """Call ``prepare_params`` on every bie layer of ``model`` (the seed's helper of that
    name). Call it before creating the optimizer. Returns the number of layers prepared."""
    count = 0
    for module in model.modules():
        if isinstance(module, _BieLayerModule):
            module.prepare_params()
            count += 1
    return count


def float_parameters(model):
    """The floating-point parameters of ``model`` (a module, or an iterable of parameters), as
    a list: what torch's gradient utilities take. ``torch.nn.utils.clip_grad_norm_`` and
    ``clip_grad_value_`` reject int8 gradients, which the prepared binary weights have (the
    int8 quantization of their float gradient, SPEC §2, of which SignFlip uses the sign
    history): clip ``bie.float_parameters(model)``."""
    params = model.parameters() if isinstance(model, nn.Module) else model
    return [p for p in params if p.is_floating_point()]


__all__ = ["BinaryLinearBase", "BinaryLinearCutlass", "BinaryConv2dBase", "BinaryConv2dCutlass",
           "Q4LinearCutlass", "Q4Conv2dCutlass", "RPReLU", "prepare_bie_layers",
           "float_parameters", "BIE_MODULES"]
