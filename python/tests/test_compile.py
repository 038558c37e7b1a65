"""torch.compile of models with bie modules (torch >= 2.4: the custom operators of
bie._compile): whole graphs (no graph break at bie layers), and the same values as eager
execution in training (forward, every gradient, sign-flip steps on int8 weights), inference
and under autocast; the eager rules kept (a backward of an inference output raises)."""

import contextlib
import copy

import pytest
import torch
from torch import nn

import bie
from bie import _compile

pytestmark = pytest.mark.skipif(not _compile.AVAILABLE or not hasattr(torch, "compile"),
                                reason="needs torch >= 2.4 (torch.library.custom_op)")


class Net(nn.Module):
    """A residual unit of binary convs, a q4 conv, then binary and q4 linear layers."""

    def __init__(self, device=None, dtype=torch.float32, batch_norm=True):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        norm = (lambda c: nn.BatchNorm2d(c, device=device)) if batch_norm else (
            lambda c: nn.Identity())
        self.conv1 = bie.BinaryConv2dCutlass(6, 12, 3, 1, 1, **kw)
        self.bn1 = norm(12)
        self.conv2 = bie.BinaryConv2dCutlass(12, 12, 3, 1, 1, **kw)
        self.bn2 = norm(12)
        self.down = bie.Q4Conv2dCutlass(12, 10, 3, 2, 1, **kw)
        self.fc1 = bie.BinaryLinearCutlass(10 * 4 * 4, 33, **kw)
        self.fc2 = bie.Q4LinearCutlass(33, 7, **kw)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)) + y)
        y = self.down(y).flatten(1)
        return self.fc2(torch.tanh(self.fc1(y)))


def _pair(int8, device=None, dtype=torch.float32, batch_norm=True):
    torch.manual_seed(11)
    eager = Net(device, dtype, batch_norm)
    with torch.no_grad():  # 4-bit weight steps for these small weights (default scale_w: 1)
        eager.down.scale_w.fill_(0.02)
        eager.fc2.scale_w.fill_(0.03)
    if int8:
        bie.prepare_bie_layers(eager)
    return eager, copy.deepcopy(eager)


def _data(n=5, device=None):
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(n, 6, 8, 8, generator=gen), torch.randint(0, 7, (n,), generator=gen)
    return (x.to(device), y.to(device)) if device is not None else (x, y)


def _cuda_ok():
    return torch.cuda.is_available() and bie.cuda_built()


def test_one_graph_no_break():
    eager, _ = _pair(True)
    x, _ = _data()
    explained = torch._dynamo.explain(eager)(x)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.parametrize("device,dtype,int8", [
    (None, torch.float32, False), (None, torch.float32, True),
    pytest.param("cuda", torch.float32, True),
    pytest.param("cuda", torch.bfloat16, True)])
def test_training_matches_eager(device, dtype, int8):
    if device == "cuda" and not _cuda_ok():
        pytest.skip("needs a CUDA device and a libbie with the CUDA backend")
    torch._dynamo.reset()
    # On CUDA, torch's own batch norm backward under aot_eager (decomposed) rounds differently
    # from its eager (cuDNN) one, which would change every gradient upstream of it: the CUDA
    # cases compare the network without batch norm, so that only bie's operators are compared.
    eager, twin = _pair(int8, device, dtype, batch_norm=device is None)
    compiled = torch.compile(twin, backend="aot_eager")
    opts = [bie.SignFlip(m.parameters(), lr=1e-2, betas=(0.9, 0.99), float_lr=1e-2, seed=4)
            for m in (eager, twin)]
    flipped = 0
    x, y = _data(device=device)
    autocast = (torch.autocast("cuda", dtype=dtype) if dtype != torch.float32
                else contextlib.nullcontext())
    for step in range(3):
        losses = []
        for model, opt in ((eager, opts[0]), (compiled, opts[1])):
            opt.zero_grad(set_to_none=True)
            with autocast:
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), step
        for (name, p), q in zip(eager.named_parameters(), twin.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                assert p.grad.dtype == q.grad.dtype, name
                assert torch.equal(p.grad, q.grad), (step, name)
        for opt in opts:
            opt.step()
        flipped += opts[1].flipped
        for (name, p), q in zip(eager.named_parameters(), twin.parameters()):
            assert torch.equal(p, q), (step, name)
    if int8:
        assert twin.fc1.weight.dtype == torch.int8 and flipped > 0


def test_inference_and_autocast_match_eager():
    torch._dynamo.reset()
    eager, twin = _pair(True)
    compiled = torch.compile(twin, backend="aot_eager")
    x, _ = _data(3)
    eager.eval()
    twin.eval()
    with torch.no_grad():
        assert torch.equal(compiled(x), eager(x))
    eager.train()
    twin.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = eager(x), compiled(x)
    assert a.dtype == b.dtype
    assert torch.equal(a, b)


_INDUCTOR = """
import torch
from torch import nn
import test_compile as t
eager, twin = t._pair(False)
compiled = torch.compile(twin)
x, y = t._data()
for model in (eager, compiled):
    nn.functional.cross_entropy(model(x), y).backward()
for (name, p), q in zip(eager.named_parameters(), twin.parameters()):
    torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
print("ok")
"""


def test_inductor_forward_backward():
    # In a process of its own: inductor's CPU kernels switch the process to flush denormals
    # to zero (a torch behaviour), which would change later tests' float arithmetic.
    import os
    import pathlib
    import subprocess
    import sys
    here = pathlib.Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), str(here.parent)]))
    run = subprocess.run([sys.executable, "-c", _INDUCTOR], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_backward_of_inference_output_raises():
    torch._dynamo.reset()
    layer = bie.BinaryLinearCutlass(20, 9)
    layer.eval()
    compiled = torch.compile(layer, backend="aot_eager")
    x = torch.randn(4, 20, requires_grad=True)
    out = compiled(x)
    with pytest.raises(RuntimeError, match="no forward to match"):
        out.sum().backward()


@pytest.mark.parametrize("keep", [False, True])
def test_two_forwards_before_backward(keep):
    """As in eager mode: the first forward's backward raises, unless the layer keeps its
    inputs (then it runs that forward again)."""
    torch._dynamo.reset()
    torch.manual_seed(5)
    layer = bie.BinaryLinearCutlass(20, 9, keep_inputs=keep)
    twin = copy.deepcopy(layer)
    compiled = torch.compile(twin, backend="aot_eager")
    a, b = torch.randn(4, 20), torch.randn(4, 20)
    first, _ = compiled(a), compiled(b)
    if not keep:
        with pytest.raises(RuntimeError, match="another training forward"):
            first.sum().backward()
        return
    first.sum().backward()
    layer(a).sum().backward()
    assert torch.equal(twin.scale_a.grad, layer.scale_a.grad)
    assert torch.equal(twin.bias_a.grad, layer.bias_a.grad)


def test_pending_forward_released_with_its_module():
    """A compiled training forward whose backward never runs is kept (for that backward) only
    until the layer's next forward or the module's end."""
    import gc
    torch._dynamo.reset()
    layer = bie.BinaryLinearCutlass(20, 9)
    compiled = torch.compile(layer, backend="aot_eager")
    before = len(_compile._runs)
    for _ in range(3):
        compiled(torch.randn(4, 20))
    assert len(_compile._runs) == before + 1  # only the last forward of the layer
    del compiled, layer
    torch._dynamo.reset()
    gc.collect()
    assert len(_compile._runs) == before


def _run_ranks(mode, tmp, world=2):
    """Run ddp_compile_check.py in ``world`` gloo processes; what each rank saved."""
    import ddp_check
    return ddp_check.run_gloo_ranks("ddp_compile_check.py", world, [mode],
                                    [tmp / f"{mode}{rank}.pt" for rank in range(world)], 300)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
def test_compiled_under_distributed_data_parallel(tmp_path):
    """DDP(torch.compile(model)) and torch.compile(DDP(model)) train as eager DDP does: every
    parameter the same on both ranks and bit for bit the eager run's (2 gloo processes)."""
    eager = _run_ranks("eager", tmp_path)
    assert eager[0]["flipped"] > 0
    for mode in ("inner", "outer"):
        ranks = _run_ranks(mode, tmp_path)
        for rank in ranks:
            assert rank["flipped"] == eager[0]["flipped"], mode
            for name, t in eager[0]["state"].items():
                assert torch.equal(rank["state"][name], t), (mode, name)
