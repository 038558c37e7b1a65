"""Modules that move, convert, copy and checkpoint like torch modules; views and state dicts
that stay valid; integer arguments checked before they reach C; autocast on the CPU."""

import copy
import gc
import io

import pytest
import torch
from torch import nn

import bie

KINDS = [
    (bie.BinaryLinearCutlass, (37, 11), (5, 37)),
    (bie.BinaryConv2dCutlass, (3, 5, 3, 1, 1), (2, 3, 7, 6)),
    (bie.Q4LinearCutlass, (37, 11), (5, 37)),
    (bie.Q4Conv2dCutlass, (3, 5, 3, 1, 1), (2, 3, 7, 6)),
]


def _churn():
    """Free and reuse memory, so reading a freed buffer would show garbage (or crash)."""
    gc.collect()
    junk = [torch.full((4096,), 7.0) for _ in range(64)]
    del junk


def _state(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def _same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# ------------------------------------------------------------------ views and state dicts


@pytest.mark.parametrize("cls,args,shape", KINDS)
def test_views_outlive_prepare_and_reset(cls, args, shape):
    m = cls(*args)
    float_view = m.weight.detach()  # float weight, about to be replaced (binary kinds)
    float_values = float_view.clone()
    state = m.state_dict()
    m.prepare_params()
    int_view, int_values = m.weight.detach()[0], m.weight.detach()[0].clone()
    bias_view = m.bias_a.detach()
    m.reset_parameters(seed=5)
    m.generate_quantized_weight(qweight_only=True)
    _churn()
    assert torch.equal(float_view, float_values)
    assert torch.equal(state["weight"], float_values)
    assert torch.equal(int_view, int_values)
    assert bias_view.shape == m.bias_a.shape and torch.equal(bias_view, m.bias_a.detach())
    float_view.add_(1.0)  # writable, but no longer the module's memory
    assert m.weight is None


@pytest.mark.parametrize("cls,args,shape", KINDS)
def test_state_dict_is_a_snapshot(cls, args, shape):
    m = cls(*args)
    m.prepare_params()
    x = torch.randn(*shape)
    m(x)
    m.eval()
    m(x)
    state = m.state_dict()
    saved = {k: v.clone() for k, v in state.items()}
    m.train()
    opt = bie.SignFlip(m.parameters(), lr=1.0, float_lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        m(x).square().sum().backward()
        opt.step()
    m.eval()  # packs qweight again from the trained weight
    m.set_weight_data(torch.randn(saved["weight"].shape))
    _churn()
    _same_state(state, saved)
    fresh = cls(*args)
    fresh.load_state_dict(state)
    fresh.eval()
    assert torch.equal(fresh.qweight, saved["qweight"])


def test_parameter_objects_survive_train_eval_and_reloads():
    m = bie.BinaryLinearCutlass(37, 11)
    m.prepare_params()
    params = dict(m.named_parameters())
    opt = bie.SignFlip(m.parameters(), float_lr=1e-2)
    x = torch.randn(8, 37)
    for _ in range(3):
        m.train()
        opt.zero_grad()
        m(x).sum().backward()
        opt.step()
        m.eval()
        m(x)
    m.train()
    m.set_weight_data(torch.randn(11, 37))  # int8 before and after: the same objects
    m.load_state_dict(m.state_dict())
    for name in ("weight", "bias_a", "scale_a", "scale_w"):
        assert getattr(m, name) is params[name], name
    m.eval()
    before = m(x)
    m.train()
    with torch.no_grad():
        m.weight.neg_()  # still the layer's memory: the next packing sees it
    m.eval()
    assert torch.equal(m(x), -before)


def test_backward_after_the_layer_was_replaced_raises():
    m = bie.BinaryLinearCutlass(20, 4, keep_inputs=True)
    m.prepare_params()
    y = m(torch.randn(3, 20, requires_grad=True))
    m.set_bits_binary_word(32)
    with pytest.raises(bie.BieError, match="replaced"):
        y.sum().backward()


# ------------------------------------------------------------------ integer arguments


def test_integers_are_range_checked_before_c():
    m = bie.BinaryLinearCutlass(20, 4)
    for call in (lambda: m.set_bits_binary_word(2 ** 32 + 8),
                 lambda: m.set_bits_binary_word(8.0),
                 lambda: setattr(m, "gemm_kernel_id", 2 ** 32 - 1),
                 lambda: m.reset_parameters(seed=-1),
                 lambda: m.reset_parameters(seed=2 ** 64),
                 lambda: bie.BinaryLinearCutlass(2 ** 64 + 5, 3),
                 lambda: bie.BinaryLinearCutlass(20, 2 ** 63),
                 lambda: bie.BinaryLinearCutlass(20.0, 3),
                 lambda: bie.Q4LinearCutlass(20, "3"),
                 lambda: bie.BinaryConv2dCutlass(3, 3, 2 ** 32 + 3),
                 lambda: bie.Q4Conv2dCutlass(3, 3, 3, stride=2 ** 32 + 1),
                 lambda: bie.BinaryConv2dCutlass(3, 3, 3, padding=-2 ** 40),
                 lambda: bie.set_num_threads(2 ** 32 + 2),
                 lambda: bie.BinaryLinearForward.apply(torch.randn(2, 5), torch.randn(3, 5),
                                                       torch.ones(1), torch.ones(1), 2 ** 32,
                                                       True)):
        with pytest.raises(ValueError) as info:
            call()
        assert isinstance(info.value, bie.BieError)
        assert info.value.status_name == "BIE_ERR_INVALID_ARGUMENT"
    assert m.bits_binary_word == 8 and m.gemm_kernel_id == -1
    m.set_bits_binary_word(torch.tensor(64))  # integer tensors and numpy-like ints are fine
    assert m.bits_binary_word == 64
    m.reset_parameters(seed=2 ** 64 - 1)


# ------------------------------------------------------------------ moving and converting


@pytest.mark.parametrize("cls,args,shape", KINDS)
def test_to_cpu_and_float_keep_everything(cls, args, shape):
    m = cls(*args)
    m.prepare_params()
    x = torch.randn(*shape)
    m(x)
    opt = bie.SignFlip(m.parameters())
    params = list(m.parameters())
    handle = m._layer.handle.value
    model = nn.Sequential(m)
    for convert in (lambda: model.cpu(), lambda: model.float(), lambda: model.to("cpu"),
                    lambda: model.to(torch.float32), lambda: model.to("cpu", torch.float32),
                    lambda: model.type(torch.float32)):
        assert convert() is model
    assert m._layer.handle.value == handle  # nothing to do: the same layer
    assert list(m.parameters()) == params and opt.param_groups[0]["params"] == params


@pytest.mark.parametrize("cls,args,shape", KINDS)
@pytest.mark.parametrize("convert", ["half", "bfloat16", "double", "to_f16", "to_meta"])
def test_unsupported_conversion_leaves_module_unchanged(cls, args, shape, convert):
    m = cls(*args)
    m.prepare_params()
    x = torch.randn(*shape)
    m(x)
    m.eval()
    expect = m(x)
    state, params, handle = _state(m), list(m.parameters()), m._layer.handle.value
    call = {"half": lambda: m.half(), "bfloat16": lambda: m.bfloat16(),
            "double": lambda: m.double(), "to_f16": lambda: m.to(torch.float16),
            "to_meta": lambda: m.to("meta")}[convert]
    with pytest.raises(bie.BieError) as info:
        call()
    message = str(info.value)
    assert "unchanged" in message
    if convert != "to_meta":
        assert "float32 on the CPU" in message and "bfloat16 or float16 on CUDA" in message
    assert m._layer.handle.value == handle and list(m.parameters()) == params
    assert m.device == torch.device("cpu") and m.dtype == torch.float32
    _same_state(_state(m), state)
    assert torch.equal(m(x), expect)


@pytest.mark.parametrize("cls,args,shape", KINDS)
@pytest.mark.parametrize("setup", ["float", "int8", "eval", "qweight_only", "settings"])
def test_rebuilt_layer_holds_the_same_state(cls, args, shape, setup):
    """What .to() / .cuda() / .half() do on a GPU machine, on the CPU: a new C layer with the
    old one's parameters and settings (bie._layer.Layer.rebuilt)."""
    m = cls(*args)
    x = torch.randn(*shape)
    if setup != "float":
        m.prepare_params()
    m(x)
    if setup == "settings":
        if m._layer.binary:
            m.set_bits_binary_word(64)
        ids = [k["id"] for k in bie.kernels() if k["available"] and k["device"] == "cpu" and
               k["op"] == ("binary_gemm" if m._layer.binary else "q4_gemm")]
        m.gemm_kernel_id = ids[-1]
        with torch.no_grad():
            m.bias_a.uniform_(-0.2, 0.2)
    if setup in ("eval", "settings"):
        m.eval()
        m(x)
    if setup == "qweight_only":
        m.eval()
        m.generate_quantized_weight(qweight_only=True)
    before, describe = _state(m), m.describe()
    expect = m(x)
    params = dict(m.named_parameters())
    old = m._layer
    m._install(m._layer.rebuilt())
    assert m._layer is not old and old.retired
    assert m.describe() == describe
    _same_state(_state(m), before)
    assert torch.equal(m(x), expect)
    for name, p in m.named_parameters():
        assert p is params[name]


def test_module_conversion_inside_a_model_and_copies():
    model = nn.Sequential(bie.BinaryConv2dCutlass(1, 4, 3, padding=1), nn.BatchNorm2d(4),
                          nn.Flatten(), bie.BinaryLinearCutlass(4 * 6 * 6, 3))
    bie.prepare_bie_layers(model)
    x = torch.randn(2, 1, 6, 6)
    model(x)
    model.eval()
    expect = model(x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for twin in (copy.deepcopy(model), torch.load(buffer, map_location="cpu", weights_only=False),
                 copy.deepcopy(model).cpu().float()):
        assert torch.equal(twin(x), expect)


# ------------------------------------------------------------------ autocast


@pytest.mark.parametrize("cls,args,shape", KINDS)
def test_cpu_autocast(cls, args, shape):
    m = cls(*args)
    m.prepare_params()
    x = torch.randn(*shape)
    expect = m(x)
    m.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = (nn.functional.linear(x, torch.randn(4, x.shape[-1])) if x.dim() == 2 else
               nn.functional.conv2d(x, torch.randn(4, x.shape[1], 3, 3)))
        xs = [x.clone().requires_grad_(), x.bfloat16().requires_grad_()]
        outs = [m(v) for v in xs[:1]]
    assert outs[0].dtype == ref.dtype == torch.bfloat16
    assert torch.equal(outs[0], expect.to(torch.bfloat16))
    outs[0].float().sum().backward()
    assert xs[0].grad is not None and xs[0].grad.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(xs[1])  # bfloat16 input: converted to the CPU layer's float32
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert xs[1].grad.dtype == torch.bfloat16
    m.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert m(x).dtype == torch.bfloat16
    with pytest.raises(bie.BieError):  # outside autocast, a bfloat16 input is refused
        m(x.bfloat16())
