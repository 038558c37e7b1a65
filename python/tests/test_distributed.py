"""Data-parallel training under torch.distributed: 2 gloo processes on the CPU train a model
with every bie kind under DistributedDataParallel (ddp_check.py), each on its own data; every
parameter, buffer and optimizer state must then be bit-identical on both ranks. The same
training with bie's data-parallel support switched off must drift apart (so the check can
fail), and the first step's reduced gradients must be the means of the ranks' own."""

import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch

import bie

import ddp_check  # noqa: E402  (python/tests is on sys.path under pytest)

WORLD = 2
HERE = pathlib.Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="this torch has no torch.distributed")


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run the 2 ranks (one process each) and return what each saved."""
    tmp = tmp_path_factory.mktemp("ddp")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env.setdefault("BIE_LIBRARY", bie.library_path())
    if "GLOO_SOCKET_IFNAME" not in env and pathlib.Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"  # the ranks talk over the loopback interface
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(HERE / "ddp_check.py"), str(rank),
                               str(WORLD), str(port), str(tmp / f"rank{rank}.pt")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for rank in range(WORLD)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=180)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} failed (exit {p.returncode}):\n{log}"
    return [torch.load(tmp / f"rank{rank}.pt") for rank in range(WORLD)]


def test_every_parameter_buffer_and_state_identical(ranks):
    fixed = [r["fixed"] for r in ranks]
    names = fixed[0].keys()
    # what the check covers: every kind's parameters, batch norm's buffers, both optimizers
    for what in ("0.weight", "0.scale_a", "0.scale_w", "0.bias_a", "0.qweight", "3.weight",
                 "3.scale_a", "6.weight", "6.scale_a", "8.weight", "8.bias_a",
                 "1.running_mean", "7.running_var", "10.weight"):
        assert "state/" + what in names, what
    assert any(n.startswith("opt/") and n.endswith("/v") for n in names)
    assert ddp_check.mismatches(fixed) == []
    assert fixed[0]["state/0.weight"].dtype == torch.int8
    assert float(fixed[0]["state/0.scale_a"].reshape(())) > 0


def test_gradients_are_the_ranks_means(ranks):
    assert ddp_check.check_gradients([r["fixed"] for r in ranks]) == []


def test_what_ddp_and_bie_each_reduce(ranks):
    assert ddp_check.check_facts(ranks[0]["facts"]) == []


def test_ranks_drift_apart_without_it(ranks):
    """The same training without bie's data-parallel support (as before it had one): the int8
    weights and scale_a differ between the ranks, so the check above can fail."""
    assert ddp_check.check_drift([r["drifted"] for r in ranks], ranks[0]["drift_facts"]) == []


def test_quantize_int8_matches_the_backward():
    """bie.distributed.quantize_int8 is bit for bit what the C backward stores in weight.grad
    (SPEC §1), so a data-parallel int8 gradient is quantized as a single process's."""
    for layer, x in ((bie.BinaryLinearCutlass(40, 24), torch.randn(32, 40)),
                     (bie.BinaryConv2dCutlass(3, 5, 3, padding=1), torch.randn(4, 3, 9, 9))):
        bie.prepare_bie_layers(layer)
        layer(x).square().sum().backward()
        assert layer.weight.grad.dtype == torch.int8
        assert torch.equal(bie.distributed.quantize_int8(layer.weight_float_grad()),
                           layer.weight.grad)
    assert torch.equal(bie.distributed.quantize_int8(torch.zeros(3)),
                       torch.zeros(3, dtype=torch.int8))
    assert bie.distributed.active() is None  # no DDP forward running
