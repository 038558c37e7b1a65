"""Bad input raises bie.BieError carrying the library's message; nothing crashes, and a
failed call changes nothing."""

import pytest
import torch

import bie
import reference as ref


@pytest.fixture
def linear():
    m = bie.BinaryLinearCutlass(20, 6)
    m.prepare_params()
    return m


@pytest.fixture
def conv():
    m = bie.BinaryConv2dCutlass(3, 4, 3, padding=1)
    m.prepare_params()
    return m


def test_wrong_input_extent(linear):
    with pytest.raises(bie.BieError, match="last extent is 21, expected 20") as info:
        linear(torch.randn(4, 21))
    assert info.value.status_name == "BIE_ERR_SHAPE"


def test_wrong_dtypes(linear):
    with pytest.raises(bie.BieError, match="float64"):
        linear(torch.randn(4, 20, dtype=torch.float64))
    with pytest.raises(bie.BieError, match="bits_binary_word is 8"):
        linear(torch.zeros(4, 1, dtype=torch.int32))  # 32-bit words into an 8-bit layer
    with pytest.raises(bie.BieError, match="float32"):
        bie.BinaryLinearForward.apply(torch.randn(2, 5), torch.randn(3, 5).double(),
                                      torch.ones(1), torch.ones(1), -1, True)
    with pytest.raises(bie.BieError, match="dtype"):
        bie.BinaryLinearCutlass(4, 4, dtype=torch.float64)


def test_wrong_ranks(linear, conv):
    with pytest.raises(bie.BieError, match="rank 0"):
        linear(torch.tensor(1.0))
    with pytest.raises(bie.BieError, match="rank"):
        conv(torch.randn(3, 5, 5))
    with pytest.raises(bie.BieError):
        conv(torch.randn(1, 2, 5, 5))  # 2 channels into a 3-channel conv
    with pytest.raises(bie.BieError):
        conv(torch.randn(1, 3, 0, 5))  # empty image


def test_kernel_too_large_for_input():
    m = bie.Q4Conv2dCutlass(2, 2, 5)
    with pytest.raises(bie.BieError) as info:
        m(torch.randn(1, 2, 3, 3))
    assert info.value.status != 0 and str(info.value)


def test_non_contiguous_input_is_accepted(linear, conv):
    x = torch.randn(20, 7).t()  # [7, 20], not contiguous
    assert not x.is_contiguous()
    assert torch.equal(linear(x), linear(x.contiguous()))
    img = torch.randn(1, 6, 6, 3).permute(0, 3, 1, 2)
    assert torch.equal(conv(img), conv(img.contiguous()))


def test_word_sizes(linear):
    with pytest.raises(bie.BieError, match="must be 8, 32 or 64") as info:
        linear.set_bits_binary_word(16)
    assert info.value.status_name == "BIE_ERR_INVALID_ARGUMENT"
    assert linear.bits_binary_word == 8  # unchanged
    linear.set_bits_binary_word(32)
    linear.eval()
    with pytest.raises(bie.BieError):  # packed words of the wrong length
        linear(torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(bie.BieError):
        linear.set_quantized_weight_data(torch.zeros(6, 1, dtype=torch.uint8))


def test_bad_kernel_ids(linear):
    x = torch.randn(3, 20)
    expect = linear(x)
    for bad in (99999, -7):
        with pytest.raises(bie.BieError):
            linear.gemm_kernel_id = bad
    q4_ids = [k["id"] for k in bie.kernels() if k["op"] == "q4_gemm"]
    with pytest.raises(bie.BieError):
        linear.gemm_kernel_id = q4_ids[0]  # a kernel of another op
    assert linear.gemm_kernel_id == -1
    assert torch.equal(linear(x), expect)
    with pytest.raises(bie.BieError):
        bie.Q4LinearCutlass(5, 5).gemm_kernel_id = 99999


def test_backward_modes_on_the_cpu(linear):
    assert linear.backward_mode == "exact"
    with pytest.raises(bie.BieError, match="FP8"):  # CUDA only
        linear.backward_mode = "fp8"
    with pytest.raises(ValueError):
        linear.backward_mode = "fp16"
    assert linear.backward_mode == "exact"
    linear.backward_mode = "exact"
    with pytest.raises(bie.BieError):
        bie.BinaryConv2dCutlass(3, 4, 3).backward_mode = "fp8"


def test_bad_sizes_and_scales():
    with pytest.raises(bie.BieError, match="in_features"):
        bie.BinaryLinearCutlass(0, 3)
    with pytest.raises(bie.BieError):
        bie.BinaryConv2dCutlass(3, 3, 0)
    with pytest.raises(bie.BieError):
        bie.BinaryConv2dCutlass(3, 3, 3, stride=0)
    with pytest.raises(bie.BieError, match="scale_a"):
        bie.BinaryLinearForward.apply(torch.randn(2, 5), torch.randn(3, 5),
                                      torch.tensor([float("nan")]), torch.ones(1), -1, True)
    with pytest.raises(bie.BieError, match="one element"):
        bie.BinaryLinearForward.apply(torch.randn(2, 5), torch.randn(3, 5), torch.ones(2),
                                      torch.ones(1), -1, True)


def test_all_zero_input_cannot_initialise_scale(linear):
    with pytest.raises(bie.BieError, match="scale_a"):
        linear(torch.zeros(2, 20))
    assert float(linear.scale_a) == 0.0  # unchanged
    linear(torch.randn(2, 20))
    assert float(linear.scale_a) > 0


def test_failed_call_changes_nothing(linear):
    before = {n: p.detach().clone() for n, p in linear.named_parameters()}
    with pytest.raises(bie.BieError):
        linear.set_weight_data(torch.randn(6, 19))
    with pytest.raises(bie.BieError):
        linear.set_weight_data(torch.full((6, 20), float("inf")))
    for n, p in linear.named_parameters():
        assert torch.equal(p, before[n])


def test_backward_with_wrong_gradient_shape(linear):
    x = torch.randn(3, 20, requires_grad=True)
    y = linear(x)
    with pytest.raises(RuntimeError):  # torch itself rejects the mismatching gradient
        y.backward(torch.randn(3, 5))


def test_replaced_or_converted_parameters(linear):
    with pytest.raises(bie.BieError, match="cannot be converted"):
        linear.double()
    linear(torch.randn(2, 20))  # still intact after the refused conversion
    linear.bias_a = torch.nn.Parameter(torch.zeros(20))
    with pytest.raises(bie.BieError, match="no longer lives"):
        linear(torch.randn(2, 20))


def test_inference_only_layer_cannot_train(linear):
    linear.generate_quantized_weight(qweight_only=True)
    with pytest.raises(bie.BieError, match="no weight"):
        linear(torch.randn(2, 20))


def test_cuda_tensors_report_clearly():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device in this torch")
    try:
        m = bie.BinaryLinearCutlass(16, 8, device="cuda")
    except bie.BieError as e:  # the CUDA layers are not in this build yet
        assert "not supported yet" in str(e)
        return
    y = m(torch.randn(4, 16, device="cuda"))
    assert y.is_cuda and y.shape == (4, 8)


def test_cpu_layer_rejects_cuda_input(linear):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device in this torch")
    with pytest.raises(bie.BieError, match="CPU"):
        linear(torch.randn(2, 20, device="cuda"))


def test_reference_packing_agrees_with_bie():
    # the test helper itself: packed signs through bie's forward equal float signs
    x = torch.randn(3, 70)
    for bits in (8, 32, 64):
        m = bie.BinaryLinearCutlass(70, 4)
        m.set_bits_binary_word(bits)
        m.eval()
        expect = m(torch.where(x >= 0, 1.0, -1.0))  # also initialises scale_a
        assert torch.equal(m(ref.pack_signs(x, bits)), expect)
