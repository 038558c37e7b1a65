"""The C model graph (bie_train.h: bie_model_*) against the same graph of PyTorch modules in
float64, on the CPU through ctypes: a residual, multi-branch network of float layers with
random parameters; its training forward and backward (every parameter gradient, gradients
summed where a tensor feeds several nodes), batch-norm running statistics and the evaluation
forward. A second graph starts with a binary conv2d that reads the model's input, held
against reference.binary_conv2d (SPEC §3) with the C layer's own int8 weight and scales."""

import ctypes

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from bie import _lib  # noqa: E402
import reference as ref  # noqa: E402

try:  # a handle of our own: the package's prototypes stay as they are
    C = ctypes.CDLL(_lib.library_path())
except (ImportError, OSError) as e:
    pytest.skip(f"libbie cannot be loaded: {e}", allow_module_level=True)
if not hasattr(C, "bie_model_add_node"):
    pytest.skip("this libbie has no model graph (bie_model_add_node)", allow_module_level=True)

# bie_layer_type (bie_train.h)
LINEAR, BN2D, PRELU, BINARY_CONV2D, CONV2D, AVGPOOL2D, GAP, ADD, CONCAT, RPRELU = \
    0, 2, 4, 8, 11, 12, 13, 14, 15, 16
PARAM_FLOAT, PARAM_BINARY = 0, 1  # bie_param_kind
INPUT = -1  # BIE_MODEL_INPUT


_P, _I, _I64, _F, _B, _S = (ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float,
                            ctypes.c_bool, ctypes.c_char_p)


class LayerInfo(ctypes.Structure):  # bie_layer_info (C enums are ints)
    _fields_ = [("type", _I), ("in_", _I64), ("out", _I64), ("kernel_size", _I), ("stride", _I),
                ("padding", _I), ("dilation", _I), ("bias", _B), ("symmetric", _B),
                ("bits_binary_word", _I), ("eps", _F), ("momentum", _F)]


class ModelParam(ctypes.Structure):  # bie_model_param
    _fields_ = [("name", _S), ("layer", _I), ("kind", _I), ("value", _lib.Tensor),
                ("grad", _lib.Tensor)]


_T, _MP = ctypes.POINTER(_lib.Tensor), ctypes.POINTER(ModelParam)
for name, args in {
        "bie_model_create": [ctypes.POINTER(_P)], "bie_model_free": [_P],
        "bie_model_add_node": [_P, ctypes.POINTER(LayerInfo), _I, ctypes.POINTER(_I)],
        "bie_model_reset_parameters": [_P, ctypes.c_uint64], "bie_model_prepare_params": [_P],
        "bie_model_param_count": [_P], "bie_model_param_get": [_P, _I, _MP],
        "bie_model_param_find": [_P, _S, _MP], "bie_model_set_param": [_P, _S, _T],
        "bie_model_forward": [_P, _T, _T], "bie_model_backward": [_P, _T, _T],
        "bie_model_set_training": [_P, _B], "bie_model_layer": [_P, _I, ctypes.POINTER(_P)],
        "bie_layer_grad": [_P, _I, _T], "bie_last_error": []}.items():
    getattr(C, name).argtypes = args
    getattr(C, name).restype = {"bie_model_free": None, "bie_last_error": _S}.get(name, _I)


def _check(status):
    assert status == 0, C.bie_last_error().decode()


# One row per node: (type, inputs, hyper-parameters); a node's index is its name.
GRAPH = [
    (CONV2D, [INPUT], dict(in_=3, out=6, kernel_size=3, padding=1, bias=True)),  # 0
    (BN2D, [0], dict(in_=6)),                                                     # 1
    (RPRELU, [1], dict(in_=6)),                                                   # 2
    (CONV2D, [2], dict(in_=6, out=6, kernel_size=3, padding=1)),                  # 3
    (BN2D, [3], dict(in_=6)),                                                     # 4
    (ADD, [4, 2], {}),                                                            # 5
    (AVGPOOL2D, [5], dict(kernel_size=2, stride=2)),                              # 6
    (CONV2D, [6], dict(in_=6, out=8, kernel_size=1, bias=True)),                  # 7
    (CONV2D, [5], dict(in_=6, out=8, kernel_size=3, stride=2, padding=1)),        # 8
    (ADD, [7, 8], {}),                                                            # 9
    (CONCAT, [9, 7], {}),                                                         # 10
    (PRELU, [10], dict(in_=16)),                                                  # 11
    (GAP, [11], {}),                                                              # 12
    (LINEAR, [12], dict(in_=16, out=5, bias=True)),                               # 13
]
BINARY_GRAPH = [  # a binary conv on the input, then float layers
    (BINARY_CONV2D, [INPUT], dict(in_=3, out=6, kernel_size=3, padding=1)),
    (BN2D, [0], dict(in_=6)), (RPRELU, [1], dict(in_=6)), (GAP, [2], {}),
    (LINEAR, [3], dict(in_=6, out=5, bias=True)),
]


class CModel:
    """A bie_model built from a table like GRAPH, its float parameters random."""

    def __init__(self, graph, seed=7):
        self.h = _P()
        _check(C.bie_model_create(ctypes.byref(self.h)))
        for kind, inputs, hp in graph:
            info = LayerInfo(type=kind, **{**dict(stride=1, dilation=1, symmetric=True,
                                                  bits_binary_word=8, eps=1e-5, momentum=0.1),
                                             **hp})
            _check(C.bie_model_add_node(self.h, info, len(inputs), (_I * len(inputs))(*inputs)))
        _check(C.bie_model_reset_parameters(self.h, seed))
        _check(C.bie_model_prepare_params(self.h))
        slopes = {i for i, (kind, _, _) in enumerate(graph) if kind in (PRELU, RPRELU)}
        for name, kind, value in self.params():
            layer, field = name.split(".")
            if kind == PARAM_BINARY or field in ("scale_w", "scale_a"):
                continue  # the C layer's own int8 weight and scales
            if field == "weight" and int(layer) in slopes:
                new = torch.empty(value.shape).uniform_(0.1, 0.9)
            elif field == "running_var" or (field == "weight" and graph[int(layer)][0] == BN2D):
                new = torch.empty(value.shape).uniform_(0.5, 1.5)
            else:  # conv / linear weights, biases, shifts, bias_a, running means
                new = 0.4 * torch.randn(value.shape)
            self.set(name, new)

    def params(self):
        """(name, kind, value) of every parameter and buffer, values copied."""
        out, p = [], ModelParam()
        for i in range(C.bie_model_param_count(self.h)):
            _check(C.bie_model_param_get(self.h, i, p))
            out.append((p.name.decode(), p.kind, _lib.wrap(p.value, self).clone()))
        return out

    def grads(self):
        """{name: gradient of the last backward} of the float parameters (the .grad views)."""
        grads, p = {}, ModelParam()
        for i in range(C.bie_model_param_count(self.h)):
            _check(C.bie_model_param_get(self.h, i, p))
            if p.kind == PARAM_FLOAT:
                grads[p.name.decode()] = _lib.wrap(p.grad, self).clone()
        return grads

    def set(self, name, value):
        value = value.float().contiguous()  # alive through the call
        _check(C.bie_model_set_param(self.h, name.encode(), _lib.describe(value)))

    def forward(self, x):
        out = _lib.Tensor()
        _check(C.bie_model_forward(self.h, _lib.describe(x), out))
        return _lib.wrap(out, self).clone()

    def backward(self, grad_out):
        grad_out, grad_x = grad_out.float().contiguous(), torch.empty(self.input_shape)
        _check(C.bie_model_backward(self.h, _lib.describe(grad_out), _lib.describe(grad_x)))
        return grad_x

    def free(self):
        C.bie_model_free(self.h)


class RPReLU(nn.Module):
    """t = x + shift_in; y = prelu(t) + shift_out, per channel (C's parameter names)."""

    def __init__(self, channels):
        super().__init__()
        self.shift_in = nn.Parameter(torch.zeros(channels))
        self.weight = nn.Parameter(torch.full((channels,), 0.25))
        self.shift_out = nn.Parameter(torch.zeros(channels))

    def forward(self, x):
        view = (1, -1, 1, 1)
        t = x + self.shift_in.view(view)
        return torch.where(t >= 0, t, self.weight.view(view) * t) + self.shift_out.view(view)


class BinaryConvRef(nn.Module):
    """SPEC §3 in float32 (reference.binary_conv2d) on the C layer's int8 weight and scales;
    the float weight gradient is kept in grad_w_float."""

    def __init__(self, channels, padding):
        super().__init__()
        self.padding = padding
        self.bias_a = nn.Parameter(torch.zeros(channels))
        self.scale_a = nn.Parameter(torch.zeros(1))
        self.register_buffer("weight", torch.zeros(0, dtype=torch.int8))
        self.register_buffer("scale_w", torch.zeros(1))

    def forward(self, x):
        module = self

        class Function(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, bias_a, scale_a):
                out, ctx.closure = ref.binary_conv2d(x.float(), module.weight, float(scale_a),
                                                     float(module.scale_w), 1, module.padding, 1,
                                                     bias_a.float())
                return out.double()

            @staticmethod
            def backward(ctx, g):
                gx, module.grad_w_float, gs, gb = ctx.closure(g.float())
                return gx.double(), gb.double(), gs.reshape(1).double()
        return Function.apply(x, self.bias_a, self.scale_a)


TORCH_LAYERS = {  # the torch module of a node; add, concat and global pool are in run_twin
    CONV2D: lambda hp: nn.Conv2d(hp["in_"], hp["out"], hp["kernel_size"], hp.get("stride", 1),
                                 hp.get("padding", 0), bias=hp.get("bias", False)),
    LINEAR: lambda hp: nn.Linear(hp["in_"], hp["out"], bias=hp["bias"]),
    BN2D: lambda hp: nn.BatchNorm2d(hp["in_"]),  # eps 1e-5, momentum 0.1, as C's
    RPRELU: lambda hp: RPReLU(hp["in_"]),
    PRELU: lambda hp: nn.PReLU(hp["in_"]),
    AVGPOOL2D: lambda hp: nn.AvgPool2d(hp["kernel_size"], hp["stride"]),
    BINARY_CONV2D: lambda hp: BinaryConvRef(hp["in_"], hp["padding"]),
}


def torch_twin(graph, cmodel):
    """nn.ModuleList of one module per node in float64 holding the C model's values: the
    names of its named_parameters() are the C names."""
    modules = nn.ModuleList([TORCH_LAYERS.get(kind, lambda hp: nn.Identity())(hp)
                             for kind, _, hp in graph]).double()
    for name, _, value in cmodel.params():
        layer, field = name.split(".")
        old = getattr(modules[int(layer)], field)
        old.data = value.to(old.dtype)
    assert {n for n, _ in modules.named_parameters()} == \
        {n for n, kind, _ in cmodel.params() if kind == PARAM_FLOAT}
    return modules


def run_twin(graph, modules, x, cut=()):
    """The torch graph's output; an edge (reader, source) in `cut` reads a detached source."""
    outs = []
    for i, (kind, inputs, _) in enumerate(graph):
        xs = [x if j == INPUT else outs[j].detach() if (i, j) in cut else outs[j] for j in inputs]
        if kind == ADD:
            outs.append(sum(xs))
        elif kind == CONCAT:
            outs.append(torch.cat(xs, dim=1))
        elif kind == GAP:
            outs.append(xs[0].mean((2, 3)))
        else:
            outs.append(modules[i](xs[0]))
    return outs[-1]


def _rel(actual, expected):
    """max |actual - expected| relative to max |expected|."""
    return float((actual.double() - expected).abs().max() / expected.abs().max())


def _run_both(graph, scale_a=None):
    """The C model, its torch twin, an input in float32 and float64 (with a gradient);
    scale_a (times mean|x|) is written into a binary node 0 before the twin copies it."""
    cmodel = CModel(graph)
    x = torch.randn(4, 3, 8, 8)
    cmodel.input_shape = x.shape
    if scale_a:
        cmodel.set("0.scale_a", torch.tensor([scale_a * float(x.abs().mean())]))
    return cmodel, torch_twin(graph, cmodel), x, x.double().requires_grad_()


@pytest.fixture
def graph_pair():
    cmodel, twin, x, xd = _run_both(GRAPH)
    yield cmodel, twin, x, xd
    cmodel.free()


def test_training_forward_backward(graph_pair):
    cmodel, twin, x, xd = graph_pair
    out = cmodel.forward(x)
    expect = run_twin(GRAPH, twin, xd)
    assert out.shape == expect.shape == (4, 5)
    assert _rel(out, expect) < 1e-4

    g = torch.randn(4, 5, dtype=torch.double)
    expect.backward(g)
    assert _rel(cmodel.backward(g), xd.grad) < 1e-4
    grads = cmodel.grads()
    largest = max(float(p.grad.abs().max()) for p in twin.parameters())
    for name, p in twin.named_parameters():
        if name == "0.bias":  # batch norm follows: exactly 0 in float64, rounding in C
            assert float(grads[name].abs().max()) < 1e-5 * largest
        else:
            assert _rel(grads[name], p.grad) < 1e-4, name
    # A second backward overwrites the parameter gradients (it does not add to them).
    cmodel.backward(g)
    assert all(torch.equal(v, cmodel.grads()[k]) for k, v in grads.items())


def test_gradients_summed_over_readers(graph_pair):
    """Tensors 2, 5 and 7 have two readers each: the gradient of every parameter that reaches
    the output only through such a tensor is the sum over its readers (C = torch's full
    gradient), and each reader's share alone is far from it."""
    cmodel, twin, x, xd = graph_pair
    cmodel.forward(x)
    g = torch.randn(4, 5, dtype=torch.double)
    cmodel.backward(g)
    grads = cmodel.grads()
    for source, readers, params in [(2, (3, 5), ["0.weight", "1.weight", "2.shift_in"]),
                                    (5, (6, 8), ["0.weight", "2.shift_out", "3.weight", "4.bias"]),
                                    (7, (9, 10), ["7.weight", "7.bias"])]:
        shares = []
        for keep in readers:
            twin.zero_grad()
            cut = {(r, source) for r in readers if r != keep}
            run_twin(GRAPH, twin, x.double(), cut).backward(g)
            shares.append({n: p.grad.clone() for n, p in twin.named_parameters()})
        for name in params:
            total = sum(share[name] for share in shares)
            assert _rel(grads[name], total) < 1e-4, name
            for share in shares:
                assert _rel(grads[name], share[name]) > 1e-2, (name, "one reader only")


def test_running_statistics_and_eval(graph_pair):
    cmodel, twin, x, xd = graph_pair
    cmodel.forward(x)
    run_twin(GRAPH, twin, xd)  # momentum 0.1, unbiased batch variance
    state = {name: value for name, _, value in cmodel.params()}
    for i in (1, 4):
        for field in ("running_mean", "running_var"):
            assert _rel(state[f"{i}.{field}"], getattr(twin[i], field)) < 1e-5, (i, field)

    _check(C.bie_model_set_training(cmodel.h, False))
    twin.eval()
    x2 = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        assert _rel(cmodel.forward(x2), run_twin(GRAPH, twin, x2.double())) < 1e-4


def test_binary_conv_graph():
    # a scale_a below 2 mean|x|, so that inputs on both sides of the clip occur
    cmodel, twin, x, xd = _run_both(BINARY_GRAPH, scale_a=1.4)
    try:
        out = cmodel.forward(x)
        expect = run_twin(BINARY_GRAPH, twin, xd)
        # Node 0 reads the input, so both sides see the same float32 x + bias_a and the same
        # signs: one sign apart would move the output by ~1e-2 relative, not 1e-4.
        assert _rel(out, expect) < 1e-4

        g = torch.randn(4, 5, dtype=torch.double)
        expect.backward(g)
        assert _rel(cmodel.backward(g), xd.grad) < 1e-4
        grads = cmodel.grads()
        for name, p in twin.named_parameters():
            assert _rel(grads[name], p.grad) < 1e-4, name
        layer, view, p = _P(), _lib.Tensor(), ModelParam()
        _check(C.bie_model_layer(cmodel.h, 0, ctypes.byref(layer)))
        _check(C.bie_layer_grad(layer, 5, view))  # BIE_PARAM_WEIGHT_FLOAT_GRAD
        assert _rel(_lib.wrap(view, cmodel).clone(), twin[0].grad_w_float.double()) < 1e-4
        _check(C.bie_model_param_find(cmodel.h, b"0.weight", p))
        i8 = _lib.wrap(p.grad, cmodel).int()  # SPEC §2: the int8 quantized gradient
        assert (i8 - ref.quantize_i8(twin[0].grad_w_float).int()).abs().max() <= 1
    finally:
        cmodel.free()
