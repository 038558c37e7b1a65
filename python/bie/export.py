"""PyTorch models as bie model files: ``export`` writes one, ``load`` reads one back.

A bie model file (written by ``bie train``, read by ``bie eval`` / ``predict`` / ``export``; see
``tools/bie/model_io.h``) is a safetensors file holding a graph of ``bie_train.h`` layers in
topological order, each reading earlier nodes or the input (-1): tensors ``"<node>.<param>"``
and ``__metadata__`` entries ``format`` ("bie-model"), ``format_version`` ("1"),
``architecture`` (JSON: one object per node with its type, hyper-parameters and, where it does
not read the node before it, ``inputs``), ``input_shape``, ``classes`` and ``packed``.
:func:`export` traces a module with ``torch.fx`` and maps every operation to one node (a
:class:`bie.BatchNormAct` to its batch norm, add and PReLU nodes); :func:`load` builds a
``torch.fx.GraphModule`` of bie modules and torch layers from a file. Files are read and
written with the standard library (``bie._safetensors``).
"""

import functools
import json
import math
import operator
import os
import struct
import warnings

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from . import _lib
from ._lib import fail
from ._safetensors import _ERR_IO, _tensor_bytes, read_safetensors, write_safetensors
from .modules import (BinaryConv2dBase, BinaryLinearBase, Q4Conv2dCutlass, Q4LinearCutlass,
                      RPReLU, _BieLayerModule)
from .norm import BatchNormAct

FORMAT, FORMAT_VERSION = "bie-model", "1"
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal",
                         "Shirt", "Sneaker", "Bag", "Ankle boot")
MAX_INPUTS = 8  # BIE_MODEL_MAX_INPUTS: inputs of one add or concat node

_LOWBIT_CLASSES = {"binary_linear": BinaryLinearBase, "binary_conv2d": BinaryConv2dBase,
                   "q4_linear": Q4LinearCutlass, "q4_conv2d": Q4Conv2dCutlass}
_BINARY_TYPES = ("binary_linear", "binary_conv2d")
_CONV_TYPES = ("binary_conv2d", "q4_conv2d")
_WORD_ST = {torch.uint8: "U8", torch.int32: "U32", torch.int64: "U64"}  # packed words


class _GlobalAvgPool(nn.Module):
    """bie's global_avgpool: [N, C, H, W] -> [N, C] (adaptive average pool to 1 x 1, flatten)."""

    def forward(self, x):
        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)


# ---------------------------------------------------------------------- numbers, JSON


def _f32(v):
    """v rounded to float32 (what the C side stores), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", float(v)))[0]


def _shortest(v):
    """The shortest decimal that rounds to the same float32 as v (1e-05 for 1e-5 stored as
    float32), so a loaded batch norm has the eps of the module that was exported."""
    v32 = _f32(v)
    for digits in range(1, 10):
        if _f32(float(f"{v32:.{digits}g}")) == v32:
            return float(f"{v32:.{digits}g}")
    return v32


def _json(v):
    """Compact JSON as ``bie``'s writer (jansson) prints it: reals with 17 significant digits,
    "e-6" exponents."""
    if not isinstance(v, (float, dict, list, tuple)):  # bool, int, str
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, float):
        text = f"{v:.17g}"
        if "e" in text:
            mantissa, exponent = text.split("e")
            text = f"{mantissa}e{'-' if exponent[0] == '-' else ''}{exponent[1:].lstrip('0')}"
        return text if "." in text or "e" in text else text + ".0"
    if isinstance(v, dict):
        return "{" + ",".join(f"{_json(str(k))}:{_json(x)}" for k, x in v.items()) + "}"
    return "[" + ",".join(_json(x) for x in v) + "]"


# ---------------------------------------------------------------------- export


class _Tracer(torch.fx.Tracer):  # bie's modules, RPReLU and BatchNormAct are leaves
    def is_leaf_module(self, m, qualname):
        return isinstance(m, (_BieLayerModule, RPReLU, BatchNormAct, _GlobalAvgPool)) or \
            super().is_leaf_module(m, qualname)


def _module_name(mod):
    where = type(mod).__module__
    where = next((p for p in ("torch.nn", "bie") if where.startswith(p)), where)
    return f"{where}.{type(mod).__name__}"


def _flatten_args(args, kw):
    """(x, start_dim, end_dim) of torch.flatten / Tensor.flatten."""
    return (args[0], args[1] if len(args) > 1 else kw.get("start_dim", 0),
            args[2] if len(args) > 2 else kw.get("end_dim", -1))


def _pair(v, what, where):
    """An int from an int or a pair of equal ints (bie's kernels, strides... are square)."""
    if isinstance(v, (tuple, list)):
        if len(set(v)) != 1:
            fail(_lib.ERR_UNSUPPORTED, f"{where}: {what}={tuple(v)} is not square (bie's "
                 "layers take one size for both dimensions)")
        v = v[0]
    return int(v)


def _signs(qweight, shape):
    """±1 int8 weights of ``shape`` from packed sign rows (bit c of a row, in little-endian
    byte order, is weight c; 1 means +1)."""
    rows = shape[0]
    raw = torch.frombuffer(bytearray(_tensor_bytes(qweight)), dtype=torch.uint8).reshape(rows, -1)
    bits = (raw.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
    fan = math.prod(shape[1:])
    return (bits.reshape(rows, -1)[:, :fan].to(torch.int8) * 2 - 1).reshape(shape)


def _q4_weight(qweight, shape, scale_w):
    """Float weights of ``shape`` whose 4-bit codes under scale_w are the packed nibbles (two
    codes per byte, the even index in the low nibble, two's complement)."""
    rows = shape[0]
    raw = qweight.detach().cpu().contiguous().reshape(rows, -1).to(torch.int16)
    codes = torch.stack((raw & 15, raw >> 4), dim=-1).reshape(rows, -1)
    codes = torch.where(codes >= 8, codes - 16, codes)[:, :math.prod(shape[1:])]
    return (codes.to(torch.float32) * scale_w.cpu()).reshape(shape)


class _Exporter:
    """Maps the nodes of a traced module to bie nodes."""

    def __init__(self, gm):
        self.gm = gm
        self.modules = dict(gm.named_modules())
        self.arch = []  # per bie node: dict for the architecture JSON
        self.tensors = []  # (name, safetensors dtype, tensor), in parameter order
        self.value = {}  # fx node -> bie node index (-1: the input), or None (not a tensor)
        self.squeezed = set()  # bie nodes [N, C] whose torch value is [N, C, 1, 1]
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}

    # ------------------------------------------------------------------ helpers

    def where(self, node, what=None):
        return f"bie.export: node '{node.name}'" + (f" ({what})" if what else "")

    def shape(self, node):
        meta = node.meta.get("tensor_meta")
        return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None

    def tensor_input(self, node, arg, flatten=False):
        """The bie node index of ``arg``, an input of ``node`` that must be a tensor."""
        if not isinstance(arg, torch.fx.Node) or self.value.get(arg) is None:
            fail(_lib.ERR_UNSUPPORTED, f"{self.where(node)}: an input is not a tensor computed "
                 f"by the model ({arg!r}); bie nodes read tensors only")
        index = self.value[arg]
        if index in self.squeezed and not flatten:
            fail(_lib.ERR_UNSUPPORTED, f"{self.where(node)} reads the output of a global "
                 "average pool without flattening it: bie's global_avgpool gives [N, C]; "
                 "flatten it (torch.flatten(x, 1)) first")
        return index

    def check_rank(self, node, index, ranks, what):
        shape = self.shape(node.all_input_nodes[index])
        if shape is None or len(shape) not in ranks:
            fail(_lib.ERR_UNSUPPORTED, f"{self.where(node, what)}: the input has shape "
                 f"{list(shape) if shape else shape}; bie's layer takes rank "
                 f"{' or '.join(str(r) for r in ranks)}")

    def check_inplace(self, node, source):
        """An in-place operation on ``source`` is the same as its out-of-place form only when
        nothing reads ``source`` after it."""
        later = [u for u in source.users if self.order[u] > self.order[node]]
        if later:
            fail(_lib.ERR_UNSUPPORTED, f"{self.where(node)}: an in-place operation changes "
                 f"'{source.name}', which '{later[0].name}' reads afterwards; use the "
                 "out-of-place form")

    def add(self, node, entry, inputs, params=()):
        """Append a bie node (architecture entry, input indices, (param name, dtype, tensor))."""
        index = len(self.arch)
        if list(inputs) != [index - 1]:  # "inputs" right after "type", as bie writes it
            entry = dict({"type": entry.pop("type"), "inputs": list(inputs)}, **entry)
        self.arch.append(entry)
        for name, dtype, t in params:
            t = t.detach().cpu()
            if t.is_floating_point():
                t = t.to(torch.float32)
                if not torch.isfinite(t).all():
                    fail(_lib.ERR_UNSUPPORTED, f"{self.where(node)}: parameter '{name}' holds "
                         "non-finite values")
            self.tensors.append((f"{index}.{name}", dtype, t.contiguous()))
        self.value[node] = index
        return index

    # ------------------------------------------------------------------ the graph

    def run(self):
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                if -1 in self.value.values():
                    fail(_lib.ERR_UNSUPPORTED, f"{self.where(node)}: the model takes more than "
                         "one input; bie models take one tensor")
                self.value[node] = -1
            elif node.op == "output":
                return self.output(node)
            elif node.op in ("call_module", "call_function", "call_method"):
                target = self.modules[node.target] if node.op == "call_module" else node.target
                getattr(self, node.op)(node, target)
            else:
                fail(_lib.ERR_UNSUPPORTED, f"bie.export: unsupported operation '{node.op} "
                     f"{node.target}' at node '{node.name}' (the forward uses a tensor "
                     "attribute directly; put it in a supported layer)")
        fail(_lib.ERR_UNSUPPORTED, "bie.export: the traced graph has no output")

    def output(self, node):
        out = node.args[0]
        if not isinstance(out, torch.fx.Node):
            fail(_lib.ERR_UNSUPPORTED, "bie.export: the model must return one tensor")
        index = self.tensor_input(node, out)
        if index == -1 or not self.arch:
            fail(_lib.ERR_UNSUPPORTED, "bie.export: the model computes nothing from its input")
        shape = self.shape(out)
        if index != len(self.arch) - 1 or shape is None or len(shape) != 2 or shape[1] < 2:
            fail(_lib.ERR_UNSUPPORTED, f"bie.export: the output ('{out.name}', shape "
                 f"{list(shape) if shape else shape}) must be the class scores [N, classes >= 2] "
                 "computed last")
        return shape[1]

    def alias(self, node, arg):
        self.value[node] = self.tensor_input(node, arg, flatten=True)
        if self.value[node] in self.squeezed and self.shape(node) != self.shape(arg):
            self.tensor_input(node, arg)  # raises

    def simple(self, node, kind, arg, fields=None, mod=None, names=()):
        """A one-input node; its parameters are the attributes ``names`` of ``mod``."""
        params = [(n, "F32", getattr(mod, n)) for n in names if getattr(mod, n) is not None]
        return self.add(node, dict({"type": kind}, **(fields or {})),
                        [self.tensor_input(node, arg)], params)

    def binary_op(self, node, kind, args):
        """add / concat of 2..MAX_INPUTS tensors of the shapes bie's node takes."""
        ins = [self.tensor_input(node, a) for a in args]
        shapes = [self.shape(a) for a in args]
        if not 2 <= len(ins) <= MAX_INPUTS:
            fail(_lib.ERR_UNSUPPORTED, f"{self.where(node)}: {kind} of {len(ins)} tensors (bie "
                 f"takes 2..{MAX_INPUTS})")
        cat = kind == "concat"
        for s in shapes[1:]:
            same = len(s) == len(shapes[0]) and all(
                a == b or (cat and d == 1) for d, (a, b) in enumerate(zip(s, shapes[0])))
            if not same or (cat and len(s) < 2):
                fail(_lib.ERR_UNSUPPORTED, f"{self.where(node)}: {kind} of shapes "
                     f"{[list(x) for x in shapes]}: bie's {kind} takes equal shapes"
                     f"{' except in dim 1' if kind == 'concat' else ' (no broadcasting)'}")
        return self.add(node, {"type": kind}, ins)

    def flatten(self, node, arg, start=1, end=-1):
        shape = self.shape(arg)
        if shape is None or len(shape) < 2 or start != 1 or end not in (-1, len(shape) - 1):
            fail(_lib.ERR_UNSUPPORTED, f"{self.where(node)}: flatten(start_dim={start}, "
                 f"end_dim={end}) of shape {list(shape) if shape else shape}; bie flattens "
                 "[N, ...] to [N, features] only")
        return self.add(node, {"type": "flatten"}, [self.tensor_input(node, arg, flatten=True)])

    def global_pool(self, node, arg, squeezed):
        self.check_rank(node, 0, (4,), "global average pool")
        index = self.simple(node, "global_avgpool", arg)
        if squeezed:
            self.squeezed.add(index)
        return index

    # ------------------------------------------------------------------ modules

    def call_module(self, node, mod):
        what = f"{_module_name(mod)} '{node.target}'"
        if type(mod) is BatchNormAct:
            return self.batchnorm_act(node, mod, what)
        if len(node.args) != 1 or node.kwargs:
            fail(_lib.ERR_UNSUPPORTED, f"{self.where(node, what)}: called with "
                 f"{len(node.args)} arguments; bie layers take one tensor")
        x = node.args[0]
        kind = next((k for k, c in _LOWBIT_CLASSES.items() if isinstance(mod, c)), None)
        if kind and type(mod).forward is _BieLayerModule.forward:  # not a subclass's own
            return self.lowbit(node, mod, kind, x, what)
        if type(mod) is RPReLU:
            self.check_rank(node, 0, (2, 4), what)
            return self.simple(node, "rprelu", x, {"in": mod.channels}, mod,
                               ("shift_in", "weight", "shift_out"))
        if type(mod) is _GlobalAvgPool:
            return self.global_pool(node, x, squeezed=False)
        if type(mod) in (nn.Identity, nn.Dropout, nn.Dropout2d, nn.AlphaDropout):
            return self.alias(node, x)  # the identity in eval mode
        if type(mod) is nn.Conv2d:
            return self.conv2d(node, mod, x, what)
        if type(mod) is nn.Linear:
            return self.simple(node, "linear", x, {"in": mod.in_features, "out": mod.out_features,
                                                   "bias": mod.bias is not None}, mod,
                               ("weight", "bias"))
        if type(mod) in (nn.BatchNorm1d, nn.BatchNorm2d):
            return self.batchnorm(node, mod, x, what)
        if type(mod) is nn.ReLU:
            if mod.inplace:
                self.check_inplace(node, x)
            return self.simple(node, "relu", x)
        if type(mod) is nn.PReLU:
            return self.simple(node, "prelu", x, {"in": mod.num_parameters}, mod, ("weight",))
        if type(mod) in (nn.MaxPool2d, nn.AvgPool2d):
            return self.pool(node, mod, x, what)
        if type(mod) is nn.AdaptiveAvgPool2d:
            size = mod.output_size
            if size not in (1, (1, 1), [1, 1]):
                fail(_lib.ERR_UNSUPPORTED, f"{self.where(node, what)}: output_size={size}; "
                     "bie has the global average pool (output_size=1) only")
            return self.global_pool(node, x, squeezed=True)
        if type(mod) is nn.Flatten:
            return self.flatten(node, x, mod.start_dim, mod.end_dim)
        fail(_lib.ERR_UNSUPPORTED, f"bie.export: unsupported layer '{_module_name(mod)}' "
             f"(module '{node.target}') at node '{node.name}'")

    def conv2d(self, node, mod, x, what):
        where = self.where(node, what)
        if mod.groups != 1 or mod.padding_mode != "zeros":
            fail(_lib.ERR_UNSUPPORTED, f"{where}: groups={mod.groups}, padding_mode="
                 f"'{mod.padding_mode}'; bie's conv2d has groups 1 and zero padding")
        k = _pair(mod.kernel_size, "kernel_size", where)
        d = _pair(mod.dilation, "dilation", where)
        padding = mod.padding
        if padding == "valid":
            padding = 0
        elif padding == "same":
            if (d * (k - 1)) % 2:
                fail(_lib.ERR_UNSUPPORTED, f"{where}: padding='same' pads unevenly here")
            padding = d * (k - 1) // 2
        self.check_rank(node, 0, (4,), what)
        fields = {"in": mod.in_channels, "out": mod.out_channels, "bias": mod.bias is not None,
                  "kernel_size": k, "stride": _pair(mod.stride, "stride", where),
                  "padding": _pair(padding, "padding", where), "dilation": d}
        return self.simple(node, "conv2d", x, fields, mod, ("weight", "bias"))

    def batchnorm(self, node, mod, x, what, two_d=None):
        """A batchnorm2d (rank 4) or batchnorm1d (rank 2) node of ``mod``'s eval mode; two_d
        None: as mod's class says (nn.BatchNorm2d or 1d), else the rank of x picks."""
        where = self.where(node, what)
        if not mod.track_running_stats or mod.running_mean is None:
            fail(_lib.ERR_UNSUPPORTED, f"{where}: track_running_stats=False normalises with the "
                 "batch's statistics in eval mode; bie's batch norm uses running statistics")
        if two_d is None:
            two_d = type(mod) is nn.BatchNorm2d
        self.check_rank(node, 0, (4,) if two_d else (2,), what)
        c = mod.num_features
        weight = mod.weight if mod.affine else torch.ones(c)
        bias = mod.bias if mod.affine else torch.zeros(c)
        momentum = 0.1 if mod.momentum is None else mod.momentum  # used by training only
        entry = {"type": "batchnorm2d" if two_d else "batchnorm1d", "in": c,
                 "eps": _f32(mod.eps), "momentum": _f32(momentum)}
        params = [("weight", "F32", weight), ("bias", "F32", bias),
                  ("running_mean", "F32", mod.running_mean),
                  ("running_var", "F32", mod.running_var)]
        return self.add(node, entry, [self.tensor_input(node, x)], params)

    def batchnorm_act(self, node, mod, what):
        """bie.BatchNormAct ``prelu(bn(y) + res, slope)`` in eval mode as the nodes its parts
        are: batchnorm2d ([N, C, H, W]) or batchnorm1d ([N, C]), then add (bn first, as the
        module adds: bie sums left to right) when res is given, then prelu (``slope``: C
        values or the one shared by every channel) when the module has one."""
        args, kw = node.args, dict(node.kwargs)
        y = args[0] if args else kw.pop("y", None)
        res = args[1] if len(args) > 1 else kw.pop("res", None)
        if len(args) > 2 or kw or y is None:
            fail(_lib.ERR_UNSUPPORTED, f"{self.where(node, what)}: called with arguments "
                 f"{list(args)} {kw or ''}; BatchNormAct takes y and res")
        self.tensor_input(node, y)
        shape = self.shape(y)
        if shape is None or len(shape) not in (2, 4):
            fail(_lib.ERR_UNSUPPORTED, f"{self.where(node, what)}: y has shape "
                 f"{list(shape) if shape else shape}; bie's batch norm takes [N, C] "
                 "(batchnorm1d) or [N, C, H, W] (batchnorm2d)")
        index = self.batchnorm(node, mod, y, what, two_d=len(shape) == 4)
        if res is not None:
            r = self.tensor_input(node, res)
            if self.shape(res) != shape:
                fail(_lib.ERR_UNSUPPORTED, f"{self.where(node, what)}: res has shape "
                     f"{list(self.shape(res) or ())}, y {list(shape)}; bie's add takes equal "
                     "shapes")
            index = self.add(node, {"type": "add"}, [index, r])
        if mod.slope is not None:
            slope = mod.slope.reshape(-1)
            index = self.add(node, {"type": "prelu", "in": slope.numel()}, [index],
                             [("weight", "F32", slope)])
        return index

    def pool(self, node, mod, x, what):
        where = self.where(node, what)
        bad = {"padding": _pair(mod.padding, "padding", where), "ceil_mode": mod.ceil_mode}
        if isinstance(mod, nn.MaxPool2d):
            bad.update(dilation=_pair(mod.dilation, "dilation", where) - 1,
                       return_indices=mod.return_indices)
        else:
            bad.update(divisor_override=mod.divisor_override)
        bad = {k: v for k, v in bad.items() if v}
        if bad:
            fail(_lib.ERR_UNSUPPORTED, f"{where}: {', '.join(bad)} not supported (bie's pools "
                 "have no padding, dilation, ceil_mode, indices or divisor override)")
        k = _pair(mod.kernel_size, "kernel_size", where)
        stride = k if mod.stride is None else _pair(mod.stride, "stride", where)
        self.check_rank(node, 0, (4,), what)
        kind = "maxpool2d" if isinstance(mod, nn.MaxPool2d) else "avgpool2d"
        return self.simple(node, kind, x, {"kernel_size": k, "stride": stride})

    def lowbit(self, node, mod, kind, x, what):
        conv, p = kind in _CONV_TYPES, mod._parameters
        self.check_rank(node, 0, (4,) if conv else (2, 3, 4), what)
        entry = {"type": kind, "in": mod.in_channels if conv else mod.input_features,
                 "out": mod.out_channels if conv else mod.output_features}
        shape = (entry["out"], entry["in"]) + ((mod.kernel_size,) * 2 if conv else ())
        w = self.eval_weight(node, mod, kind in _BINARY_TYPES, shape, what)
        if conv:
            entry.update(kernel_size=mod.kernel_size, stride=mod.stride, padding=mod.padding,
                         dilation=mod.dilation)
        if kind in _BINARY_TYPES:
            entry.update(symmetric=bool(mod.symmetric), bits_binary_word=mod.bits_binary_word)
        if not (float(p["scale_a"]) >= 0 and float(p["scale_w"]) > 0):
            fail(_lib.ERR_UNSUPPORTED, f"{self.where(node, what)}: scale_a = {float(p['scale_a'])}"
                 f", scale_w = {float(p['scale_w'])}; bie's files need scale_a >= 0, scale_w > 0")
        dtype = "I8" if kind in _BINARY_TYPES else "F32"
        params = [("weight", dtype, w.reshape(shape)), ("bias_a", "F32", p["bias_a"]),
                  ("scale_a", "F32", p["scale_a"]), ("scale_w", "F32", p["scale_w"])]
        return self.add(node, entry, [self.tensor_input(node, x)], params)

    def eval_weight(self, node, mod, binary, shape, what):
        """The weight the layer computes with in eval mode: its own where the packed weight is
        its packing (or there is none yet), else the packed one decoded (int8 signs, 4-bit
        codes times scale_w)."""
        p = mod._parameters
        weight, qweight, scale_w = p.get("weight"), p.get("qweight"), p["scale_w"].detach()
        if qweight is None:
            return weight
        packed = _signs(qweight, shape) if binary else _q4_weight(qweight, shape, scale_w)
        if weight is not None:
            w = weight.detach().cpu().reshape(shape)
            if binary and w.dtype == torch.int8 and torch.equal(
                    torch.where(w > 0, 1, -1).to(torch.int8), packed):
                return w
            if not binary and torch.equal(torch.round(w / scale_w).clamp(-8, 7) * scale_w, packed):
                return w
            why = "its weight is still float (never prepared: bie.prepare_bie_layers)" if \
                binary and w.is_floating_point() else "its packed weight is not its weight's " \
                "(installed, or the weight changed in eval mode)"
            warnings.warn(f"{self.where(node, what)}: {why}; exported what it computes with")
        return packed

    # ------------------------------------------------------------------ functions, methods

    def call_function(self, node, fn):
        args, kw, name = node.args, node.kwargs, torch.fx.node._get_qualified_name(node.target)
        if fn in (F.relu, torch.relu):
            if kw.get("inplace") or (len(args) > 1 and args[1]):
                self.check_inplace(node, args[0])
            return self.simple(node, "relu", args[0])
        if fn in (operator.add, torch.add, operator.iadd):
            if len(args) != 2 or kw:
                fail(_lib.ERR_UNSUPPORTED, f"{self.where(node)}: {name} with arguments "
                     f"{kw or args[2:]}; bie adds two tensors")
            if fn is operator.iadd:
                self.check_inplace(node, args[0])
            return self.binary_op(node, "add", args)
        if fn is torch.cat:
            tensors = args[0] if args else kw.get("tensors")
            dim = args[1] if len(args) > 1 else kw.get("dim", 0)
            rank = len(self.shape(node) or ())
            if dim not in (1, 1 - rank) or not isinstance(tensors, (list, tuple)):
                fail(_lib.ERR_UNSUPPORTED, f"{self.where(node)}: torch.cat along dim {dim}; "
                     "bie concatenates along dim 1 only")
            return self.binary_op(node, "concat", tensors)
        if fn is torch.flatten:
            return self.flatten(node, *_flatten_args(args, kw))
        if fn is F.adaptive_avg_pool2d:
            size = args[1] if len(args) > 1 else kw.get("output_size")
            if size in (1, (1, 1), [1, 1]):
                return self.global_pool(node, args[0], squeezed=True)
        if fn is torch.mean:
            return self.mean(node, args[0], args[1:], kw)
        if (fn is getattr and args[1:] == ("shape",)) or (
                fn is operator.getitem and self.value.get(args[0], 0) is None):
            self.value[node] = None  # shape arithmetic (x.shape[0]): only a view reads it
            return
        fail(_lib.ERR_UNSUPPORTED, f"bie.export: unsupported operation '{name}' at node "
             f"'{node.name}'")

    def mean(self, node, x, args, kw):
        dim = args[0] if args else kw.get("dim")
        keepdim = args[1] if len(args) > 1 else kw.get("keepdim", False)
        shape = self.shape(x) or ()
        dims = sorted(d % len(shape) for d in dim) if isinstance(dim, (list, tuple)) and \
            shape else None
        if len(shape) != 4 or dims != [2, 3] or keepdim or kw.get("dtype") is not None:
            fail(_lib.ERR_UNSUPPORTED, f"{self.where(node)}: mean over dims {dim} (keepdim="
                 f"{keepdim}) of shape {list(shape)}; bie has the global average pool, "
                 "x.mean((2, 3)) of [N, C, H, W]")
        return self.global_pool(node, x, squeezed=False)

    def call_method(self, node, name):
        args, kw = node.args, node.kwargs
        if name in ("size", "dim"):
            self.value[node] = None  # shape arithmetic (x.size(0)): only a view reads it
            return
        if name == "contiguous":
            return self.alias(node, args[0])
        if name == "relu":
            return self.simple(node, "relu", args[0])
        if name == "add" and len(args) == 2 and not kw:
            return self.binary_op(node, "add", args)
        if name == "flatten":
            return self.flatten(node, *_flatten_args(args, kw))
        if name in ("view", "reshape"):
            src, out = self.shape(args[0]), self.shape(node)
            if src and out and len(src) >= 2 and len(out) == 2 and out[0] == src[0] and \
                    out[1] == math.prod(src[1:]):
                return self.flatten(node, args[0])
            fail(_lib.ERR_UNSUPPORTED, f"{self.where(node)}: Tensor.{name} from "
                 f"{list(src) if src else src} to {list(out) if out else out}; bie reshapes "
                 "[N, ...] to [N, features] (flatten) only")
        if name == "mean":
            return self.mean(node, args[0], args[1:], kw)
        fail(_lib.ERR_UNSUPPORTED, f"bie.export: unsupported operation 'Tensor.{name}' at node "
             f"'{node.name}'")


def _traced(module):
    """The module as a GraphModule of supported operations, dead code removed."""
    tracer = _Tracer()
    try:
        graph = tracer.trace(module)
    except Exception as e:  # e.g. control flow on tensor values
        fail(_lib.ERR_UNSUPPORTED, f"bie.export: torch.fx cannot trace {type(module).__name__}: "
             f"{type(e).__name__}: {e}")
    gm = torch.fx.GraphModule(tracer.root, graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def export(module, example_input, path, classes=None):
    """Write ``module`` as a bie model file at ``path`` (what ``bie eval``, ``bie predict`` and
    ``bie export`` read); returns the architecture (a list with one dict per bie node).

    ``module`` is traced with ``torch.fx`` in eval mode (the training flags are restored
    afterwards) and run once on ``example_input``, a batch ``[N, ...]`` (its shape after N is
    the file's ``input_shape``). Mapped: bie's BinaryLinear*, BinaryConv2d*, Q4Linear*,
    Q4Conv2d*; ``nn.Conv2d`` (groups 1, square, zero padding), ``nn.Linear``,
    ``nn.BatchNorm1d`` / ``2d`` (running statistics), ``nn.ReLU`` / ``F.relu``, ``nn.PReLU``,
    :class:`RPReLU`, :class:`bie.BatchNormAct` (on ``[N, C]`` or ``[N, C, H, W]``: the nodes of
    its parts, a batchnorm1d / 2d, an add of its output and ``res`` when given, a prelu of
    ``slope``'s 1 or C values unless ``prelu=False``), ``nn.MaxPool2d`` / ``nn.AvgPool2d``
    (square, no padding, floor mode), global average pooling (``nn.AdaptiveAvgPool2d(1)`` /
    ``F.adaptive_avg_pool2d(x, 1)`` then a flatten, or ``x.mean((2, 3))``), flattening
    (``torch.flatten(x, 1)``, ``nn.Flatten()``, ``x.view(x.size(0), -1)``), ``a + b`` /
    ``torch.add`` of one shape, ``torch.cat(.., 1)``; ``nn.Identity`` and dropout vanish.
    Anything else raises :class:`BieError` naming the operation and the graph node.

    The file holds what eval mode computes: batch-norm running statistics, binary weights as
    int8 (a layer never prepared, or with an installed packed weight, as the ±1 signs it uses),
    4-bit weights as float, ``bias_a``, ``scale_a`` (one still 0 is measured on
    ``example_input``, as a first eval forward would) and ``scale_w``. The output must be class
    scores ``[N, K]``; ``classes`` defaults to the Fashion-MNIST names for K = 10, else
    "0" .. "K-1".
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"bie.export: module must be a torch.nn.Module, got {type(module)}")
    x = example_input
    if not torch.is_tensor(x) or not x.is_floating_point() or not 2 <= x.dim() <= 4:
        fail(_lib.ERR_SHAPE, "bie.export: example_input must be a float tensor [N, features] or "
             f"[N, C, H, W] (a batch of inputs), got {getattr(x, 'shape', type(x))}")
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        gm = _traced(module)
        with torch.no_grad():
            ShapeProp(gm).propagate(x)
        exporter = _Exporter(gm)
        k = exporter.run()
    finally:
        for m, mode in modes:
            if m.training != mode:
                m.train(mode) if isinstance(m, _BieLayerModule) else setattr(m, "training", mode)
    classes = [str(c) for c in (classes if classes is not None else FASHION_MNIST_CLASSES
                                if k == len(FASHION_MNIST_CLASSES) else range(k))]
    if len(classes) != k:
        fail(_lib.ERR_SHAPE, f"bie.export: {len(classes)} class names for {k} class scores")
    metadata = {"format": FORMAT, "format_version": FORMAT_VERSION,
                "architecture": _json(exporter.arch),
                "input_shape": "[" + ", ".join(str(int(d)) for d in x.shape[1:]) + "]",
                "classes": _json(classes), "packed": "false",
                "exported_by": f"bie.export (PyTorch {torch.__version__})"}
    write_safetensors(path, exporter.tensors, metadata)
    return exporter.arch


# ---------------------------------------------------------------------- load

class _Loader:
    """Builds the torch module of each node of a bie model file and fills its parameters."""

    def __init__(self, path, tensors, packed):
        self.path, self.tensors, self.packed = os.fspath(path), tensors, packed
        self.used = set()

    def take(self, index, name, dtypes, shape):
        key = f"{index}.{name}"
        if key not in self.tensors:
            fail(_ERR_IO, f"{self.path}: tensor '{key}' is missing")
        dtype, t = self.tensors[key]
        if dtype not in dtypes or tuple(t.shape) != tuple(shape):
            fail(_ERR_IO, f"{self.path}: tensor '{key}' is {dtype} {list(t.shape)}, expected "
                 f"{' or '.join(dtypes)} {list(shape)}")
        self.used.add(key)
        return dtype, t

    def fill(self, index, mod, names):
        with torch.no_grad():
            for name in names:
                p = getattr(mod, name)
                p.copy_(self.take(index, name, ("F32",), p.shape)[1])
        return mod

    def build(self, index, e):
        kind = e["type"]
        if kind in _LOWBIT_CLASSES:
            return self.lowbit(index, e, kind)
        if kind in ("linear", "conv2d"):
            bias = bool(e.get("bias", False))
            mod = nn.Linear(e["in"], e["out"], bias=bias) if kind == "linear" else nn.Conv2d(
                e["in"], e["out"], e["kernel_size"], e["stride"], e["padding"], e["dilation"],
                bias=bias)
            return self.fill(index, mod, ("weight", "bias") if bias else ("weight",))
        if kind in ("batchnorm1d", "batchnorm2d"):
            cls = nn.BatchNorm1d if kind == "batchnorm1d" else nn.BatchNorm2d
            mod = cls(e["in"], eps=_shortest(e.get("eps", 1e-5)),
                      momentum=_shortest(e.get("momentum", 0.1)))
            return self.fill(index, mod, ("weight", "bias", "running_mean", "running_var"))
        if kind == "prelu":
            return self.fill(index, nn.PReLU(e["in"]), ("weight",))
        if kind == "rprelu":
            return self.fill(index, RPReLU(e["in"]), ("shift_in", "weight", "shift_out"))
        if kind in ("maxpool2d", "avgpool2d"):
            cls = nn.MaxPool2d if kind == "maxpool2d" else nn.AvgPool2d
            return cls(e["kernel_size"], e.get("stride") or e["kernel_size"])
        simple = {"relu": nn.ReLU, "flatten": nn.Flatten, "global_avgpool": _GlobalAvgPool}
        if kind in simple:
            return simple[kind]()
        fail(_ERR_IO, f"{self.path}: architecture node {index}: unknown layer type '{kind}'")

    def lowbit(self, index, e, kind):
        conv, binary = kind in _CONV_TYPES, kind in _BINARY_TYPES
        cls = _LOWBIT_CLASSES[kind]
        extra = {"symmetric": bool(e.get("symmetric", False))} if binary else {}
        geometry = (e["kernel_size"], e["stride"], e["padding"], e["dilation"]) if conv else ()
        mod = cls(e["in"], e["out"], *geometry, **extra)
        shape = (e["out"], e["in"]) + geometry[:1] * 2
        bits = e.get("bits_binary_word", 8) if binary else 4
        if binary and bits != mod.bits_binary_word:
            mod.set_bits_binary_word(bits)
        state = {name: self.take(index, name, ("F32",), (n,))[1]
                 for name, n in (("bias_a", e["in"]), ("scale_a", 1), ("scale_w", 1))}
        if self.packed:  # [out, words]: a row holds fan_in weights of 1 or 4 bits
            words = -(-math.prod(shape[1:]) // (bits if binary else 2))
            word = _WORD_ST[mod.word_dtype] if binary else "U8"
            state["qweight"] = self.take(index, "qweight", (word,), (shape[0], words))[1]
        else:
            dtype, w = self.take(index, "weight", ("I8", "F32") if binary else ("F32",), shape)
            if dtype == "F32" and binary:  # as bie_model_set_param: prepare_params on it
                mod.set_weight_data(w)
            else:
                state["weight"] = w
        mod.load_state_dict(state, strict=False)
        return mod


def load(path):
    """A bie model file (from :func:`export`, ``bie train`` or ``bie export``) as a
    ``torch.fx.GraphModule`` in eval mode: bie modules for the binary and 4-bit layers, torch
    layers (and :class:`RPReLU`) for the rest, submodules named by node index (so its
    ``state_dict`` names are the file's: ``"3.weight"``, ...), the file's parameter values.
    Its forward gives what the exported module gave in eval mode (a :class:`bie.BatchNormAct`
    comes back as the nodes it was exported as: ``nn.BatchNorm2d`` / ``1d``, ``+`` and
    ``nn.PReLU``, the same function to float rounding, as the fused call rounds once). Attributes
    ``input_shape`` (per example), ``classes`` and ``packed`` say what the file says."""
    tensors, meta = read_safetensors(path)
    where = os.fspath(path)
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        fail(_ERR_IO, f"{where}: not a bie model file of format version {FORMAT_VERSION} "
             f"(metadata format {meta.get('format')!r}, version {meta.get('format_version')!r})")
    if meta.get("packed") not in ("true", "false"):
        fail(_ERR_IO, f"{where}: metadata 'packed' must be \"true\" or \"false\"")
    try:
        arch = json.loads(meta["architecture"])
        input_shape = tuple(json.loads(meta["input_shape"]))
        classes = json.loads(meta["classes"]) if "classes" in meta else None
    except (KeyError, ValueError, TypeError) as e:
        fail(_ERR_IO, f"{where}: bad or missing metadata: {type(e).__name__}: {e}")
    if not isinstance(arch, list) or not arch:
        fail(_ERR_IO, f"{where}: metadata 'architecture' is not a non-empty JSON array")
    loader = _Loader(path, tensors, meta["packed"] == "true")
    root, graph = nn.Module(), torch.fx.Graph()
    values = []
    x = graph.placeholder("x")
    for i, e in enumerate(arch):
        try:
            inputs = e.get("inputs", [i - 1])
            if not all(isinstance(j, int) and -1 <= j < i for j in inputs):
                fail(_ERR_IO, f"{where}: architecture node {i}: inputs {inputs} are not earlier "
                     "nodes")
            args = [x if j == -1 else values[j] for j in inputs]
            if e["type"] in ("add", "concat"):
                if len(args) < 2:
                    fail(_ERR_IO, f"{where}: architecture node {i}: {e['type']} of one input")
                if e["type"] == "add":  # left to right, as bie sums
                    value = functools.reduce(
                        lambda a, b: graph.call_function(operator.add, (a, b)), args)
                else:
                    value = graph.call_function(torch.cat, (tuple(args),), {"dim": 1})
            else:
                if len(args) != 1:
                    fail(_ERR_IO, f"{where}: architecture node {i}: {e['type']} takes one input")
                root.add_module(str(i), loader.build(i, e))
                value = graph.call_module(str(i), (args[0],))
        except (KeyError, TypeError, AttributeError) as err:
            fail(_ERR_IO, f"{where}: architecture node {i} ({e!r}): {type(err).__name__}: {err}")
        values.append(value)
    unexpected = sorted(set(tensors) - loader.used)
    if unexpected:
        fail(_ERR_IO, f"{where}: unexpected tensor '{unexpected[0]}' (not a parameter of the "
             "architecture)")
    graph.output(values[-1])
    gm = torch.fx.GraphModule(root, graph, class_name="BieModel")
    gm.eval()
    gm.input_shape, gm.classes, gm.packed = input_shape, classes, loader.packed
    return gm


__all__ = ["RPReLU", "export", "load", "read_safetensors", "write_safetensors",
           "FASHION_MNIST_CLASSES"]
