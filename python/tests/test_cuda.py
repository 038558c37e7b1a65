"""The CUDA side of the package: torch's stream handed to bie, device memory of bie shown to
torch without copies, and CUDA layers either working or refused with a clear message.
Skipped without a CUDA device (or without libbie's CUDA backend)."""

import ctypes

import pytest
import torch

import bie
from bie import _lib

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _need_backend():
    if not bie.cuda_built() or _lib.lib().bie_cuda_device_count() < 1:
        pytest.skip("libbie has no CUDA backend or sees no device")


def test_torch_stream_is_accepted():
    _need_backend()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        _lib.enter_stream(torch.device("cuda"))
    _lib.enter_stream(torch.device("cuda"))  # back to the default stream


def test_bie_device_memory_as_torch_tensor():
    _need_backend()
    d = _lib.Tensor()
    shape = (ctypes.c_int64 * 2)(3, 5)
    _lib.check(_lib.lib().bie_cuda_tensor_alloc(ctypes.byref(d), _lib.F32, 2, shape, 0))
    try:
        owner = object()
        t = _lib.wrap(d, owner)
        assert t.is_cuda and t.shape == (3, 5) and t.data_ptr() == d.data
        values = torch.randn(3, 5, device="cuda")
        t.copy_(values)
        assert torch.equal(_lib.wrap(d, owner), values)
    finally:
        _lib.lib().bie_tensor_free(ctypes.byref(d))


@pytest.mark.parametrize("cls,args,shape", [
    (bie.BinaryLinearCutlass, (40, 24), (5, 40)),
    (bie.BinaryConv2dCutlass, (3, 8, 3, 1, 1), (2, 3, 9, 9)),
    (bie.Q4LinearCutlass, (40, 24), (5, 40)),
    (bie.Q4Conv2dCutlass, (3, 8, 3, 1, 1), (2, 3, 9, 9)),
])
def test_cuda_layers_match_cpu_or_are_refused(cls, args, shape):
    try:
        gpu = cls(*args, device="cuda")
    except bie.BieError as e:
        assert "not supported yet by this build" in str(e)
        return
    cpu = cls(*args)
    gpu.set_weight_data(cpu.weight.detach().cuda())
    cpu.set_weight_data(cpu.weight.detach().clone())
    x = torch.randn(*shape)
    assert torch.equal(gpu(x.cuda()).cpu(), cpu(x))


@pytest.mark.parametrize("cls,args,shape", [
    (bie.BinaryLinearCutlass, (70, 24), (6, 70)),
    (bie.BinaryConv2dCutlass, (3, 8, 3, 1, 1), (2, 3, 9, 9)),
    (bie.Q4LinearCutlass, (70, 24), (6, 70)),
    (bie.Q4Conv2dCutlass, (3, 8, 3, 1, 1), (2, 3, 9, 9)),
])
def test_cuda_training_step_matches_cpu(cls, args, shape):
    try:
        gpu = cls(*args, device="cuda")
    except bie.BieError:
        pytest.skip(f"{cls.__name__} does not run on CUDA in this build yet")
    cpu = cls(*args)
    w = cpu.weight.detach().clone()
    for m in (cpu, gpu):
        m.set_weight_data(w.to(m.device))
    x = torch.randn(*shape)
    xs = [x.clone().requires_grad_(), x.cuda().requires_grad_()]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the weights were set on the default one
    with torch.cuda.stream(stream):  # bie follows torch's current stream
        out_gpu = gpu(xs[1])
        g = torch.randn(out_gpu.shape, device="cuda")
        out_gpu.backward(g)
    stream.synchronize()
    out_cpu = cpu(xs[0])
    out_cpu.backward(g.cpu())
    assert torch.equal(out_gpu.detach().cpu(), out_cpu.detach())
    torch.testing.assert_close(xs[1].grad.cpu(), xs[0].grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gpu.bias_a.grad.cpu(), cpu.bias_a.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gpu.scale_a.grad.cpu(), cpu.scale_a.grad, rtol=1e-3, atol=1e-4)
    if gpu.weight.dtype == torch.int8:
        assert (gpu.weight.grad.cpu().int() - cpu.weight.grad.int()).abs().max() <= 1
    else:
        torch.testing.assert_close(gpu.weight.grad.cpu(), cpu.weight.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cls,args,shape", [
    (bie.BinaryLinearCutlass, (70, 24), (6, 70)),
    (bie.BinaryConv2dCutlass, (3, 8, 3, 1, 1), (2, 3, 9, 9)),
    (bie.Q4LinearCutlass, (70, 24), (6, 70)),
    (bie.Q4Conv2dCutlass, (3, 8, 3, 1, 1), (2, 3, 9, 9)),
])
def test_cuda_describe_and_kernel_selection(cls, args, shape):
    try:
        gpu = cls(*args, device="cuda")
    except bie.BieError:
        pytest.skip(f"{cls.__name__} does not run on CUDA in this build yet")
    d = gpu.describe()
    assert d["device"] == torch.device("cuda", torch.cuda.current_device())
    assert d["dtype"] == torch.float32 and d["training"] and d["kernel_id"] == -1
    gpu.prepare_params()
    x = torch.randn(*shape, device="cuda")
    expect = gpu(x).detach()
    op = "binary_gemm" if isinstance(gpu, (bie.BinaryLinearBase, bie.BinaryConv2dBase)) \
        else "q4_gemm"
    ids = {k["id"] for k in bie.kernels() if k["op"] == op and k["device"] == "cuda"}
    kernel = gpu.select_gemm_kernel(x)
    assert kernel in ids and gpu.gemm_kernel_id == kernel == gpu.describe()["kernel_id"]
    assert torch.equal(gpu(x).detach(), expect)
    gpu.eval()
    assert not gpu.describe()["training"]
    assert torch.equal(gpu(x), expect)
