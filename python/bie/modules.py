"""``torch.nn.Module``s with the seed classes' names and methods, backed by bie's C layers.

Where the parameters live: in the C layer. ``weight``, ``qweight``, ``bias_a``, ``scale_a`` and
``scale_w`` are ordinary ``nn.Parameter``s whose storage *is* the layer's memory (made with
``torch.frombuffer`` over the pointers ``bie_layer_param`` returns). An optimizer updating them in
place updates the layer; the forward reads them where they are, so no parameter is copied on
any call. The module keeps this true across the calls that make bie replace a buffer
(``prepare_params`` turns the float weight into an int8 one, ``generate_quantized_weight``,
``reset_parameters``, ``set_weight_data``, ``set_quantized_weight_data``,
``set_bits_binary_word``): the old Parameter objects are first given a private copy of their
values (so they stay valid, just no longer connected to the layer) and new Parameters over
the new buffers take their place. Create optimizers after ``prepare_params``, as the seed
asks. Tensors derived from a parameter (``.detach()``, slices, ``state_dict()`` values) share
its memory and are valid until such a call.

Parameters replaced by other tensors (``module.weight = ...``, ``.double()``, ``.cuda()`` of a
CPU module) are detected: conversions raise at once, replacements at the next forward. Use
``set_weight_data`` / ``load_state_dict`` to load values, and create the module on the device
it should run on.
"""

from collections import OrderedDict

import torch
from torch import nn

from . import _lib
from ._layer import BIAS_A, QWEIGHT, SCALE_A, SCALE_W, WEIGHT, WEIGHT_FLOAT_GRAD, Layer
from ._lib import WORD_DTYPE, fail
from .functional import (BinaryConv2dForward, BinaryLinearForward, Q4Conv2dCutlassForward,
                         Q4LinearForward)

_PARAMS = (("weight", WEIGHT), ("qweight", QWEIGHT), ("bias_a", BIAS_A),
           ("scale_a", SCALE_A), ("scale_w", SCALE_W))
_LEARNABLE = ("weight", "bias_a", "scale_a")  # float weights only: int8 ones use weight.grad
_MOVABLE = ("weight", "qweight")  # buffers bie may replace; the others live as long as the layer


def _seed_from_torch():
    """A seed for bie's generator drawn from torch's, so torch.manual_seed decides it."""
    return int(torch.randint(0, 2 ** 62, (1,)).item())


class _BieLayerModule(nn.Module):
    """What every bie module shares: the C layer, its parameters as torch views, life cycle."""

    _kind = None

    def _setup(self, sizes, device, dtype, symmetric, keep_inputs):
        self._layer_args = (tuple(sizes), device, symmetric, dtype)
        self._layer = Layer(self._kind, sizes, device, symmetric, dtype)
        self._layer.keep_inputs = bool(keep_inputs)
        self.device = self._layer.device
        self.dtype = dtype
        self._qweight_installed = False  # qweight set by the user, not derived from weight
        self._expected = ()  # (name, Parameter, data pointer) of the layer's views
        for name, _ in _PARAMS:
            self.register_parameter(name, None)
        self._sync()

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
            learnable = name in _LEARNABLE and view.is_floating_point()
            self._parameters[name] = nn.Parameter(view, requires_grad=learnable)
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
                 "bie layer's memory (it was replaced or converted); load values with "
                 "set_weight_data() or load_state_dict(), and create the module on the "
                 "device and dtype it should run with")

    def _lifecycle(self, call, *args):
        """Run ``call(*args)``, a method of the C layer that may replace buffers; keep the old
        Parameter objects valid."""
        backups = {name: self._parameters[name].detach().clone()
                   for name in _MOVABLE if self._parameters.get(name) is not None}
        call(*args)
        self._layer.changed()
        for name, backup in backups.items():
            old = self._parameters[name]
            view = self._layer.view(dict(_PARAMS)[name])
            if view is None or view.data_ptr() != old.data_ptr() or view.dtype != old.dtype:
                old.data = backup  # the old object now owns its values; bie freed its buffer
        self._sync()

    def _apply(self, fn, *args, **kwargs):
        result = super()._apply(fn, *args, **kwargs)
        if not self._params_intact():
            self._sync(force=True)  # back to the layer's own memory
            fail(_lib.ERR_DEVICE, f"{type(self).__name__}: its parameters live in bie's "
                 f"layer on {self.device} and cannot be converted or moved; create the module "
                 "with the device (and dtype) it should use")
        return result

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
        if qweight is not None:  # saved beside its weight, qweight was derived from it
            self._qweight_installed = weight is None

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
        info = state.pop("_bie_layer")
        values = state.pop("_parameters")
        super().__setstate__(state)
        sizes, device, symmetric, dtype = self._layer_args
        self._layer = Layer(self._kind, sizes, device, symmetric, dtype)
        self._layer.keep_inputs = info["keep_inputs"]
        self._parameters = OrderedDict((name, None) for name in values)
        self._expected = ()
        self._sync()
        if self._layer.binary and info["bits"] != 8:
            self.set_bits_binary_word(info["bits"])
        self.load_state_dict({k: v for k, v in values.items() if v is not None}, strict=False)
        if info["kernel"] != -1:
            self.gemm_kernel_id = info["kernel"]
        self._layer.set_training(info["training"])

    # ---------------------------------------------------------------- the seed's methods

    def reset_parameters(self, seed=None):
        """Kaiming-uniform weight from a generator seeded with ``seed`` (default: drawn from
        torch's generator); the weight becomes float again."""
        self._lifecycle(self._layer.reset_parameters,
                        _seed_from_torch() if seed is None else int(seed))
        self._qweight_installed = False

    def prepare_params(self):
        """SPEC §2/§4 prepare_params (binary: the weight becomes int8). Call before training
        and before creating the optimizer."""
        self._lifecycle(self._layer.prepare_params)

    def set_weight_data(self, x):
        """Copy x (the layer's shape and dtype) into the weight, then prepare_params."""
        x = x.detach().contiguous()
        self._lifecycle(self._layer.set_weight_data, x)
        self._qweight_installed = False

    def generate_quantized_weight(self, qweight_only=False):
        """Pack the weight into ``qweight``; with qweight_only, free the weight
        (inference-only layer)."""
        self._lifecycle(self._layer.generate_quantized_weight, bool(qweight_only))
        self._qweight_installed = False

    def set_quantized_weight_data(self, x):
        """Install packed weights (binary: words of bits_binary_word bits as uint8 / int32 /
        int64; 4-bit: uint8 nibbles); used by inference from then on."""
        x = x.detach().contiguous()
        self._lifecycle(self._layer.set_quantized_weight_data, x)
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
        x = x.detach().contiguous()
        out = torch.empty_like(x)
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
        self._layer.set_gemm_kernel(int(kernel_id))

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
        the int8-quantized one in ``weight.grad``); None before any backward."""
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
        self._check_params()
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
        x = x.contiguous()  # a copy only for non-contiguous input
        packed = layer.binary and not x.is_floating_point()
        if not layer.conv and x.dim() > _lib.MAX_DIMS:  # bie tensors have rank <= 4
            return layer.forward(x.reshape(-1, x.shape[-1]), packed).reshape(
                tuple(x.shape[:-1]) + (layer.out_features,))
        return layer.forward(x, packed)


class _BinaryMixin:
    """Binary layers: the word size of packed weights and inputs."""

    def set_bits_binary_word(self, num_bit):
        """Words of 8, 32 or 64 bits for packed weights and inputs."""
        self._lifecycle(self._layer.set_bits_binary_word, int(num_bit))

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
        self.input_features = int(input_features)
        self.output_features = int(out_features)
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
        self.in_channels, self.out_channels = int(in_channels), int(out_channels)
        self.kernel_size, self.stride = int(kernel_size), int(stride)
        self.padding, self.dilation = int(padding), int(dilation)
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
        self.input_features = int(input_features)
        self.output_features = int(out_features)
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
        self.in_channels, self.out_channels = int(in_channels), int(out_channels)
        self.kernel_size, self.stride = int(kernel_size), int(stride)
        self.padding, self.dilation = int(padding), int(dilation)
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


__all__ = ["BinaryLinearBase", "BinaryLinearCutlass", "BinaryConv2dBase", "BinaryConv2dCutlass",
           "Q4LinearCutlass", "Q4Conv2dCutlass", "prepare_bie_layers", "BIE_MODULES"]
