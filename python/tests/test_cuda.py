"""The CUDA side of the package: torch's stream handed to bie, device memory of bie shown to
torch without copies, and CUDA layers either working or refused with a clear message.
Skipped without a CUDA device (or without libbie's CUDA backend)."""

import copy
import ctypes
import io

import pytest
import torch

import bie
from bie import _lib
from bie._layer import WEIGHT

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


@pytest.mark.parametrize("prepare", [False, True])
def test_weight_gradient_is_written_where_autograd_keeps_it(prepare):
    """On CUDA the backward writes the weight's gradient straight into the tensor autograd
    makes weight.grad (no copy): the same values as a backward into the layer's own buffer,
    weight_float_grad() reads it while it lives and fails clearly once it is gone."""
    m = bie.BinaryLinearCutlass(64, 48, device="cuda")
    if prepare:
        m.prepare_params()  # int8 weight: weight.grad is the int8 gradient
    x = torch.randn(16, 64, device="cuda")
    g = torch.randn(16, 48, device="cuda")
    m(x).backward(g)
    first = m.weight.grad.clone()
    float_first = m.weight_float_grad()
    m.weight.grad = None
    m(x).backward(g)
    assert torch.equal(m.weight.grad, first)
    ptr = m.weight.grad.data_ptr()
    layer = m._layer
    view = layer.view(WEIGHT, grad=True)
    assert view.data_ptr() == ptr  # the layer's gradient is weight.grad's memory
    torch.testing.assert_close(m.weight_float_grad(), float_first)
    m.weight.grad = None  # the gradient's only holder lets it go
    with pytest.raises(bie.BieError, match="no longer"):
        layer.view(WEIGHT, grad=True)
    if not prepare:  # a float weight's float gradient is that tensor too
        with pytest.raises(bie.BieError, match="no longer"):
            m.weight_float_grad()
    else:  # an int8 weight's float gradient stays in the layer's own buffer
        torch.testing.assert_close(m.weight_float_grad(), float_first)
    m(x).backward(g)  # and the next backward starts over
    assert torch.equal(m.weight.grad, first)


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


def test_fp8_backward_against_the_exact_one():
    """The opt-in FP8 backward of a binary linear layer: grad_x, grad_w and grad_bias_a within
    the rounding of grad_out to e4m3 (about 2^-4 relative per element) of the exact backward;
    kept across .to(); a layer moved to the CPU falls back to the exact backward."""
    torch.manual_seed(3)
    exact = bie.BinaryLinearCutlass(256, 128, device="cuda", dtype=torch.bfloat16)
    exact.prepare_params()
    fast = copy.deepcopy(exact)
    try:
        fast.backward_mode = "fp8"
    except bie.BieError:
        pytest.skip("this CUDA device has no FP8 tensor cores")
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    grads = []
    for layer in (exact, fast):
        xi = x.clone().requires_grad_()
        layer(xi).backward(g)
        grads.append((xi.grad.float(), layer.weight.grad.float(), layer.bias_a.grad.float()))
    for i, (a, b) in enumerate(zip(*grads)):  # grad_x, the int8 grad_w, grad_bias_a
        err = (a - b).abs().max().item()
        slack = 1 if i == 1 else 0  # one int8 step
        assert 0 < err <= 0.08 * b.abs().max().item() + slack  # rounded, and not more
    assert fast.to(torch.float16).backward_mode == "fp8"
    with pytest.warns(UserWarning, match="exact backward"):
        moved = fast.to("cpu", torch.float32)  # no float16 layer on the CPU
    assert moved.backward_mode == "exact"


# ------------------------------------------------------------------ moving and converting

MOVE_CASES = [
    (bie.BinaryLinearCutlass, (70, 24), (6, 70)),
    (bie.BinaryConv2dCutlass, (3, 8, 3, 1, 1), (2, 3, 9, 9)),
    (bie.Q4LinearCutlass, (70, 24), (6, 70)),
    (bie.Q4Conv2dCutlass, (3, 8, 3, 1, 1), (2, 3, 9, 9)),
]


def _runs_on_cuda(cls, args):
    _need_backend()
    try:
        cls(*args, device="cuda")
    except bie.BieError:
        pytest.skip(f"{cls.__name__} does not run on CUDA in this build yet")


def _cpu_state(m):
    return {k: v.cpu() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("cls,args,shape", MOVE_CASES)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_cuda_and_cpu_round_trip_keeps_state_and_parameters(cls, args, shape, mode):
    _runs_on_cuda(cls, args)
    m = cls(*args)
    m.prepare_params()
    if isinstance(m, bie.BinaryLinearBase):
        m.set_bits_binary_word(32)
    x = torch.randn(*shape)
    m(x)
    if mode == "eval":
        m.eval()
    expect = m(x).detach()
    state, describe = _cpu_state(m), m.describe()
    params = dict(m.named_parameters())
    opt = bie.SignFlip(m.parameters(), float_lr=1e-3)
    model = torch.nn.Sequential(m)
    assert model.cuda() is model
    assert m.device == torch.device("cuda", torch.cuda.current_device())
    assert dict(m.named_parameters()) == params  # the same objects, now device memory
    assert all(p.is_cuda for p in params.values())
    d = m.describe()
    assert d["device"].type == "cuda" and d["training"] == describe["training"]
    assert d["bits_binary_word"] == describe["bits_binary_word"]
    for k, v in _cpu_state(m).items():
        assert torch.equal(v, state[k]), k
    assert torch.equal(m(x.cuda()).detach().cpu(), expect)
    m.train()
    opt.zero_grad()
    m(x.cuda()).sum().backward()
    opt.step()  # the optimizer made before the move follows the parameters
    trained = _cpu_state(m)
    model.to("cpu")
    assert m.device == torch.device("cpu") and dict(m.named_parameters()) == params
    for k, v in m.state_dict().items():
        assert torch.equal(v, trained[k]), k


@pytest.mark.parametrize("cls,args,shape", MOVE_CASES)
def test_cuda_half_and_bfloat16_layers(cls, args, shape):
    _runs_on_cuda(cls, args)
    m = cls(*args).cuda()
    m.prepare_params()
    x = torch.randn(*shape, device="cuda")
    m(x)
    for dtype, convert in ((torch.float16, m.half), (torch.bfloat16, m.bfloat16),
                           (torch.float16, lambda: m.to(torch.float16))):
        assert convert() is m
        assert m.dtype == dtype and m.describe()["dtype"] == dtype
        assert m.bias_a.dtype == torch.float32  # parameters stay float32 / int8
        y = m(x.to(dtype))
        assert y.dtype == dtype and y.shape[0] == shape[0]
        y.float().sum().backward()
        m.zero_grad()
    before = m.dtype  # float16, the loop's last conversion
    with pytest.raises(bie.BieError, match="float32 on the CPU"):
        m.cpu()  # no float16 / bfloat16 layer on the CPU: the module stays on CUDA as it was
    assert m.device.type == "cuda" and m.dtype == before == torch.float16
    m.to("cpu", torch.float32)
    assert m.device.type == "cpu" and m.dtype == torch.float32
    m(x.cpu())


@pytest.mark.parametrize("cls,args,shape", MOVE_CASES)
def test_cuda_autocast_returns_what_torch_returns(cls, args, shape):
    _runs_on_cuda(cls, args)
    m = cls(*args, device="cuda")
    m.prepare_params()
    x = torch.randn(*shape, device="cuda", requires_grad=True)
    expect = m(x).detach()
    with torch.autocast("cuda"):
        ref = (torch.nn.functional.linear(x, torch.randn(4, shape[-1], device="cuda"))
               if len(shape) == 2 else
               torch.nn.functional.conv2d(x, torch.randn(4, shape[1], 3, 3, device="cuda")))
        y = m(x)
        y16 = m(x.half())
    assert y.dtype == ref.dtype == torch.float16 and y16.dtype == torch.float16
    torch.testing.assert_close(y.float(), expect, rtol=1e-2, atol=1e-2)
    y16.float().sum().backward()
    assert x.grad is not None


def test_cuda_model_saved_and_loaded_to_cpu():
    _runs_on_cuda(bie.BinaryLinearCutlass, (40, 8))
    model = torch.nn.Sequential(bie.BinaryLinearCutlass(40, 16), torch.nn.ReLU(),
                                bie.Q4LinearCutlass(16, 4)).cuda()
    bie.prepare_bie_layers(model)
    x = torch.randn(3, 40)
    model(x.cuda())
    model.eval()
    expect = model(x.cuda()).cpu()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, map_location="cpu", weights_only=False)
    assert loaded[0].device == torch.device("cpu")
    torch.testing.assert_close(loaded(x), expect, rtol=1e-5, atol=1e-5)
    twin = copy.deepcopy(model)
    assert torch.equal(twin(x.cuda()).cpu(), expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_forward_backward_captured_in_a_cuda_graph(dtype):
    """A training forward + backward through bie's layers captured in one CUDA graph (so
    nothing in it synchronises with the host or copies from pageable memory) and replayed on
    new data gives bit for bit what eager execution gives: output, loss and every gradient
    (the int8 weights' too)."""
    _need_backend()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        bie.BinaryConv2dCutlass(4, 16, 3, 1, 1, device="cuda", dtype=dtype), torch.nn.Tanh(),
        bie.BinaryConv2dCutlass(16, 16, 3, 2, 1, device="cuda", dtype=dtype), torch.nn.Flatten(),
        bie.BinaryLinearCutlass(16 * 4 * 4, 10, device="cuda", dtype=dtype))
    bie.prepare_bie_layers(model)
    static_x = torch.randn(6, 4, 8, 8, device="cuda", dtype=dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: scale_a measured, workspaces and kernels chosen
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            model(static_x).float().square().sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    twin = copy.deepcopy(model)  # eager reference with the same parameters and scale_a
    graph = torch.cuda.CUDAGraph()
    model.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_out = model(static_x)
        static_loss = static_out.float().square().sum()
        static_loss.backward()
    for _ in range(3):
        x = torch.randn_like(static_x)
        static_x.copy_(x)
        graph.replay()
        twin.zero_grad(set_to_none=True)
        out = twin(x)
        loss = out.float().square().sum()
        loss.backward()
        torch.cuda.synchronize()
        assert torch.equal(static_out, out) and torch.equal(static_loss, loss)
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                assert torch.equal(p.grad, q.grad), name
        assert model[0].weight.grad.dtype == torch.int8


def test_fp8_backward_captured_in_a_cuda_graph():
    """The FP8 backward makes no host synchronisation either (its scale stays on the device):
    a forward and backward with it, captured in a CUDA graph, replay as eager steps do, bit
    for bit (same data, same cuBLASLt algorithm)."""
    _need_backend()
    torch.manual_seed(4)
    layer = bie.BinaryLinearCutlass(256, 64, device="cuda", dtype=torch.bfloat16)
    layer.prepare_params()
    try:
        layer.backward_mode = "fp8"
    except bie.BieError:
        pytest.skip("this CUDA device has no FP8 tensor cores")
    static_x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    static_g = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)

    def step():
        static_x.grad = None
        layer.bias_a.grad = None
        layer(static_x).backward(static_g)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: scale_a, workspaces, cuBLASLt's algorithm
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph_gx, graph_gb = static_x.grad, layer.bias_a.grad  # what each replay writes
    for _ in range(3):
        with torch.no_grad():
            static_x.copy_(torch.randn_like(static_x))
            static_g.copy_(torch.randn_like(static_g))
        graph.replay()
        torch.cuda.synchronize()
        got = (graph_gx.clone(), graph_gb.clone())
        step()
        torch.cuda.synchronize()
        assert torch.equal(got[0], static_x.grad) and torch.equal(got[1], layer.bias_a.grad)


def test_whole_training_step_captured_in_a_cuda_graph():
    """Forward, backward and a capturable SignFlip step (sign flips and Adam) captured in one
    CUDA graph: each replay on new data trains the model as an eager step does, bit for bit."""
    _need_backend()
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        bie.BinaryConv2dCutlass(4, 16, 3, 1, 1, device="cuda"), torch.nn.Tanh(),
        torch.nn.Flatten(), bie.BinaryLinearCutlass(16 * 8 * 8, 10, device="cuda"),
        torch.nn.Linear(10, 10, device="cuda"))
    bie.prepare_bie_layers(model)
    opt = bie.SignFlip(model.parameters(), lr=1e-2, betas=(0.9, 0.99), float_lr=1e-2, seed=5,
                       capturable=True)
    static_x = torch.randn(6, 4, 8, 8, device="cuda")
    static_y = torch.randint(0, 10, (6,), device="cuda")

    def step(m, o, x, y):
        o.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        o.step()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: scale_a, workspaces, the sign-flip state
        for _ in range(3):
            step(model, opt, static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    twin = copy.deepcopy(model)
    twin_opt = bie.SignFlip(twin.parameters(), lr=1e-2, betas=(0.9, 0.99), float_lr=1e-2,
                            seed=5, capturable=True)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = torch.nn.functional.cross_entropy(model(static_x), static_y)
        static_loss.backward()
        opt.step()
    flipped = 0
    for _ in range(4):
        x, y = torch.randn_like(static_x), torch.randint(0, 10, (6,), device="cuda")
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        loss = step(twin, twin_opt, x, y)
        torch.cuda.synchronize()
        assert torch.equal(static_loss, loss)
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p, q), name
        flipped += twin_opt.flipped
    assert flipped > 0
