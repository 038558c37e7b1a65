"""The nn.Modules: parameters as views of the C layer, train and eval mode, life cycle,
packed inference, state dicts, and the forward-twice-before-backward rule."""

import copy
import io

import pytest
import torch
from torch import nn

import bie
import reference as ref

LINEAR_MODULES = [bie.BinaryLinearCutlass, bie.BinaryLinearBase, bie.Q4LinearCutlass]
CONV_MODULES = [bie.BinaryConv2dCutlass, bie.BinaryConv2dBase, bie.Q4Conv2dCutlass]


def _make(cls, **kw):
    if cls in CONV_MODULES:
        return cls(3, 5, 3, stride=1, padding=1, **kw), torch.randn(2, 3, 7, 6)
    return cls(37, 11, **kw), torch.randn(5, 37)


def _reference(module, x):
    """The SPEC forward and backward closure for this module's current parameters."""
    sa, sw = float(module.scale_a), float(module.scale_w)
    w, b = module.weight.detach(), module.bias_a.detach()
    if isinstance(module, bie.BinaryLinearBase):
        return ref.binary_linear(x, w, sa, sw, b)
    if isinstance(module, bie.Q4LinearCutlass):
        return ref.q4_linear(x, w, sa, sw, b)
    if isinstance(module, bie.BinaryConv2dBase):
        return ref.binary_conv2d(x, w, sa, sw, 1, 1, 1, b)
    return ref.q4_conv2d(x, w, sa, sw, 1, 1, 1, b)


@pytest.mark.parametrize("cls", LINEAR_MODULES + CONV_MODULES)
def test_train_step_matches_reference(cls):
    m, x = _make(cls)
    m.prepare_params()
    with torch.no_grad():
        m.bias_a.copy_(0.2 * torch.randn_like(m.bias_a))  # written straight into the C layer
    x.requires_grad_()
    out = m(x)
    binary = isinstance(m, (bie.BinaryLinearBase, bie.BinaryConv2dBase))
    # scale_a initialised by the first forward from x (before the shift): SPEC §2 / §4
    factor = 2.0 if binary else 2.0 / 11.269
    torch.testing.assert_close(float(m.scale_a), factor * float(x.detach().abs().mean()),
                               rtol=1e-5, atol=0)
    expect, backward = _reference(m, x.detach())
    assert torch.equal(out.detach(), expect)
    g = torch.randn_like(out)
    out.backward(g)
    gx, gw, gs, gb = backward(g)
    torch.testing.assert_close(x.grad, gx, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(m.bias_a.grad, gb, rtol=2e-4, atol=2e-4)
    if binary:
        assert m.weight.dtype == torch.int8 and not m.weight.requires_grad
        assert (m.weight.grad.int() - ref.quantize_i8(gw).int()).abs().max() <= 1
        torch.testing.assert_close(m.weight_float_grad(), gw, rtol=2e-4, atol=2e-4)
        torch.testing.assert_close(m.scale_a.grad, gs.reshape(1), rtol=1e-3, atol=1e-4)
    else:
        torch.testing.assert_close(m.weight.grad, gw, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("cls", LINEAR_MODULES + CONV_MODULES)
def test_eval_matches_train_and_sees_updates(cls):
    m, x = _make(cls)
    m.prepare_params()
    train_out = m(x).detach()
    with torch.no_grad():  # an optimizer-like in-place update reaches the C layer
        if m.weight.dtype == torch.int8:
            m.weight[0].neg_()
        else:
            m.weight[0].mul_(-1.0)
    updated = m(x).detach()
    assert not torch.equal(updated, train_out)
    expect, _ = _reference(m, x)
    assert torch.equal(updated, expect)
    m.eval()
    assert m.qweight is not None and not m.qweight.requires_grad
    assert torch.equal(m(x), updated)
    with torch.no_grad():  # entering eval again repacks qweight from the trained weight
        m.train()
        m.weight[1].neg_()
        trained = m(x).detach()
        m.eval()
        assert torch.equal(m(x), trained)


@pytest.mark.parametrize("cls", [bie.BinaryLinearCutlass, bie.Q4LinearCutlass,
                                 bie.BinaryConv2dCutlass, bie.Q4Conv2dCutlass])
def test_qweight_only_and_state_dict_round_trip(cls):
    m, x = _make(cls)
    m.prepare_params()
    m(x)
    old_weight = m.weight
    old_values = old_weight.detach().clone()
    m.eval()
    expect = m(x)
    m.generate_quantized_weight(qweight_only=True)
    assert m.weight is None
    assert torch.equal(old_weight, old_values)  # the old Parameter keeps its values
    assert torch.equal(m(x), expect)

    buffer = io.BytesIO()
    torch.save(m.state_dict(), buffer)
    buffer.seek(0)
    fresh, _ = _make(cls)
    fresh.eval()
    fresh.load_state_dict(torch.load(buffer))
    assert fresh.weight is None and torch.equal(fresh.qweight, m.qweight)
    assert torch.equal(fresh(x), expect)
    with pytest.raises(bie.BieError, match="no weight"):
        fresh.train()
        fresh(x)


def test_state_dict_of_trained_int8_layer_loads_into_fresh_module():
    m, x = _make(bie.BinaryLinearCutlass)
    m.prepare_params()
    out = m(x)
    fresh, _ = _make(bie.BinaryLinearCutlass)
    fresh.load_state_dict(m.state_dict())
    assert fresh.weight.dtype == torch.int8
    assert torch.equal(fresh(x), out)


@pytest.mark.parametrize("bits", [8, 32, 64])
@pytest.mark.parametrize("cls", [bie.BinaryLinearCutlass, bie.BinaryConv2dCutlass])
def test_word_sizes_and_packed_input(bits, cls):
    m, x = _make(cls)
    m.prepare_params()
    m.set_bits_binary_word(bits)
    assert m.bits_binary_word == bits
    m.eval()
    assert m.qweight.dtype == m.word_dtype
    fan_in = 37 if cls is bie.BinaryLinearCutlass else 27
    assert m.qweight.shape == (m.out_features if cls is bie.BinaryLinearCutlass else 5,
                               -(-fan_in // bits))
    expect = m(x)
    if cls is bie.BinaryLinearCutlass:  # pre-packed activations give the same result
        packed = ref.pack_signs(x + m.bias_a.detach(), bits)
        assert torch.equal(m(packed), expect)


def test_select_gemm_kernel_and_kernel_ids():
    m, x = _make(bie.BinaryLinearCutlass)
    m.prepare_params()
    expect = m(x)
    kernel = m.select_gemm_kernel(x)
    ids = {k["id"] for k in bie.kernels() if k["available"] and k["op"] == "binary_gemm"}
    assert kernel in ids and m.gemm_kernel_id == kernel
    cpu_ids = {k["id"] for k in bie.kernels() if k["device"] == "cpu"} & ids
    assert len(cpu_ids) >= 2
    for kid in sorted(cpu_ids):  # every kernel gives the same, exact result
        m.gemm_kernel_id = kid
        assert torch.equal(m(x), expect)


BINARY_MODULES = (bie.BinaryLinearBase, bie.BinaryConv2dBase)
EVERY_KIND = [bie.BinaryLinearCutlass, bie.BinaryConv2dCutlass, bie.Q4LinearCutlass,
              bie.Q4Conv2dCutlass]


@pytest.mark.parametrize("cls", EVERY_KIND)
def test_select_gemm_kernel_on_every_kind(cls):
    m, x = _make(cls)
    m.prepare_params()
    expect = m(x).detach()
    op = "binary_gemm" if issubclass(cls, BINARY_MODULES) else "q4_gemm"
    ids = {k["id"] for k in bie.kernels()
           if k["available"] and k["op"] == op and k["device"] == "cpu"}
    assert m.gemm_kernel_id == -1
    kernel = m.select_gemm_kernel(x)
    assert kernel in ids and m.gemm_kernel_id == kernel
    assert torch.equal(m(x).detach(), expect)
    for kid in sorted(ids):  # every kernel gives the same, exact result
        m.gemm_kernel_id = kid
        assert m.gemm_kernel_id == kid
        assert torch.equal(m(x).detach(), expect)
    m.gemm_kernel_id = -1
    assert m.gemm_kernel_id == -1
    m.gemm_kernel_id = kernel  # a copy keeps the choice
    assert copy.deepcopy(m).gemm_kernel_id == kernel


@pytest.mark.parametrize("cls", EVERY_KIND)
def test_describe_reports_the_layer(cls):
    m, _ = _make(cls)
    binary = issubclass(cls, BINARY_MODULES)
    conv = cls in CONV_MODULES
    d = m.describe()
    assert d["kind"] == {bie.BinaryLinearCutlass: "binary_linear",
                         bie.BinaryConv2dCutlass: "binary_conv2d",
                         bie.Q4LinearCutlass: "q4_linear", bie.Q4Conv2dCutlass: "q4_conv2d"}[cls]
    assert (d["in"], d["out"], d["fan_in"]) == ((3, 5, 27) if conv else (37, 11, 37))
    geometry = (d["kernel_size"], d["stride"], d["padding"], d["dilation"])
    assert geometry == ((3, 1, 1, 1) if conv else (0, 0, 0, 0))
    assert d["device"] == torch.device("cpu") and d["dtype"] == torch.float32
    assert d["symmetric"] == binary
    assert d["training"] and d["kernel_id"] == -1
    assert d["bits_binary_word"] == (8 if binary else 0)
    m.eval()
    assert not m.describe()["training"]
    m.train()
    assert m.describe()["training"]
    if binary:
        m.set_bits_binary_word(64)
        assert m.describe()["bits_binary_word"] == 64 == m.bits_binary_word
    else:
        assert not hasattr(m, "set_bits_binary_word")
    asymmetric = cls(*((3, 5, 3) if conv else (37, 11)), symmetric=False) if binary else None
    if asymmetric is not None:
        assert not asymmetric.describe()["symmetric"]


def test_reset_parameters_is_seeded():
    a, _ = _make(bie.BinaryLinearCutlass)
    b, _ = _make(bie.BinaryLinearCutlass)
    a.reset_parameters(7)
    b.reset_parameters(7)
    assert torch.equal(a.weight, b.weight)
    bound = 1 / 37 ** 0.5
    assert a.weight.abs().max() <= bound and a.weight.std() > bound / 3
    torch.manual_seed(3)
    a.reset_parameters()
    torch.manual_seed(3)
    b.reset_parameters()
    assert torch.equal(a.weight, b.weight)


@pytest.mark.parametrize("cls", LINEAR_MODULES + CONV_MODULES)
def test_two_forwards_before_backward(cls):
    m, x1 = _make(cls)
    x2 = torch.randn_like(x1)
    m.prepare_params()
    y1 = m(x1)
    m(x2)
    with pytest.raises(bie.BieError, match="another forward"):
        y1.sum().backward()

    # keep_inputs: the lost forward is run again, the gradients are those of x1
    m.keep_inputs = True
    x1.requires_grad_()
    y1 = m(x1)
    y2 = m(x2)
    g = torch.randn_like(y1)
    y1.backward(g)
    _, backward = _reference(m, x1.detach())
    torch.testing.assert_close(x1.grad, backward(g)[0], rtol=2e-4, atol=2e-4)
    y2.sum().backward()  # and the second forward's backward still works


def test_prepare_bie_layers_and_module_features():
    model = nn.Sequential(bie.BinaryConv2dCutlass(1, 4, 3, padding=1), nn.Flatten(),
                          bie.BinaryLinearCutlass(4 * 5 * 5, 6), bie.Q4LinearCutlass(6, 3))
    assert bie.prepare_bie_layers(model) == 3
    assert model[0].weight.dtype == torch.int8 and model[2].weight.dtype == torch.int8
    assert model[3].weight.dtype == torch.float32
    y = model(torch.randn(2, 1, 5, 5))
    assert y.shape == (2, 3)
    assert "input_features=100" in repr(model)
    names = dict(model.named_parameters())
    assert "0.scale_a" in names and "2.bias_a" in names


def test_parameters_live_in_the_layer():
    m, x = _make(bie.BinaryLinearCutlass)
    m.prepare_params()
    with torch.no_grad():
        m.scale_a.fill_(0.5)
        m.scale_w.fill_(2.0)
    out = m(x)
    expect, _ = ref.binary_linear(x, m.weight.detach(), 0.5, 2.0, m.bias_a.detach())
    assert torch.equal(out.detach(), expect)
    assert set(torch.unique(out.detach().abs() % 1.0).tolist()) == {0.0}  # integers times 1


@pytest.mark.parametrize("cls", [bie.BinaryLinearCutlass, bie.Q4Conv2dCutlass])
def test_deepcopy_and_torch_save_make_independent_layers(cls):
    m, x = _make(cls)
    m.prepare_params()
    if isinstance(m, bie.BinaryLinearBase):
        m.set_bits_binary_word(64)
    m(x)
    m.eval()
    expect = m(x)
    buffer = io.BytesIO()
    torch.save(m, buffer)
    buffer.seek(0)
    for twin in (copy.deepcopy(m), torch.load(buffer, weights_only=False)):
        assert twin._layer.handle.value != m._layer.handle.value
        assert not twin.training and torch.equal(twin(x), expect)
        assert [(n, p.dtype) for n, p in twin.named_parameters()] == \
            [(n, p.dtype) for n, p in m.named_parameters()]
        twin.train()
        with torch.no_grad():  # training the twin leaves the original alone
            twin.weight.neg_()
        twin(x).sum().backward()
        twin.eval()
        assert not torch.equal(twin(x), expect)
        assert torch.equal(m(x), expect)


def test_float_checkpoint_loads_into_prepared_layer():
    m, x = _make(bie.BinaryLinearCutlass)  # unprepared: float weight
    state = {k: v.clone() for k, v in m.state_dict().items()}
    prepared, _ = _make(bie.BinaryLinearCutlass)
    prepared.prepare_params()
    prepared.load_state_dict(state)
    assert prepared.weight.dtype == torch.float32
    assert torch.equal(prepared.weight, state["weight"])
    assert torch.equal(prepared(x), m(x))
