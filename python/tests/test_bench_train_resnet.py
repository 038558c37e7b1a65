"""python/bench/train_resnet.py keeps working: the binary ResNet-18 benchmark on the CPU with
tiny sizes, in this process and in 2 gloo processes (as under torchrun), prints JSON lines with
positive images/s for bie's side and the pure-PyTorch one, and their ratio."""

import io
import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import bie  # noqa: E402
from scripts import load_script  # noqa: E402

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench" / "train_resnet.py"
TINY = ["--device", "cpu", "--batch", "4", "--steps", "2", "--warmup", "1", "--dtype", "fp32",
        "--width-div", "8", "--json"]


@pytest.fixture(scope="module")
def bench():
    return load_script(BENCH)


def _check(lines, world):
    """The records of (side, mode) and the ratio of each mode in ``lines`` (JSON text)."""
    records = [json.loads(line) for line in lines if line.strip()]
    sides = {(r["side"], r["mode"]): r for r in records if "side" in r and "scaling" not in r}
    assert set(sides) == {(s, m) for s in ("bie", "torch") for m in ("train", "infer")}
    for r in sides.values():
        assert r["batch"] == 4 and r["world_size"] == world and r["global_batch"] == 4 * world
        assert r["images_per_s"] > 0 and r["ms_per_step"] > 0
        assert len(r["images_per_s_ranks"]) == world and min(r["images_per_s_ranks"]) > 0
        assert r["images_per_s_total"] == pytest.approx(sum(r["images_per_s_ranks"]))
        assert r["peak_bytes"] is None  # measured on CUDA only
    ratios = {r["mode"]: r for r in records if "images_per_s_ratio" in r}
    assert set(ratios) == {"train", "infer"}
    for mode, r in ratios.items():
        expected = (sides[("bie", mode)]["images_per_s_total"]
                    / sides[("torch", mode)]["images_per_s_total"])
        assert r["images_per_s_ratio"] == pytest.approx(expected)
    return records


def test_one_process(bench, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = io.StringIO()
    records = bench.main(TINY, out)
    assert _check(out.getvalue().splitlines(), 1) == records


def test_channels_last_runs_both_sides_so(bench, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = io.StringIO()
    records = bench.main(TINY + ["--channels-last"], out)
    _check(out.getvalue().splitlines(), 1)
    sides = [r for r in records if "side" in r and "scaling" not in r]
    assert sides and all(r["channels_last"] for r in sides)


def test_recompute_option(bench, monkeypatch):
    """--recompute: bie's 16 units keep no conv output (BatchNormAct(recompute=True))."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = io.StringIO()
    records = bench.main(TINY + ["--recompute", "--mode", "train"], out)
    sides = [r for r in records if "side" in r and "scaling" not in r]
    assert sides and all(r["recompute"] for r in sides)
    model, _ = bench.build("bie", torch.device("cpu"), torch.float32, 16, False,
                           recompute=True)
    units = [m for m in model.modules() if isinstance(m, bench.FusedUnit)]
    assert len(units) == 16 and all(u.bn.recompute for u in units)


def test_networks_are_the_same_shape(bench):
    """Both sides: 16 binary 3 x 3 convolutions, the same float layers, 10 logits."""
    models = {side: bench.build(side, torch.device("cpu"), torch.float32, 8, False)[0]
              for side in ("bie", "torch")}
    binary = {side: [m for m in model.modules()
                     if isinstance(m, (bie.BinaryConv2dBase, bench.TorchBinaryConv2d))]
              for side, model in models.items()}
    assert len(binary["bie"]) == len(binary["torch"]) == 16
    for b, t in zip(binary["bie"], binary["torch"]):
        assert (b.in_channels, b.out_channels, b.stride) == (t.weight.shape[1],
                                                             t.weight.shape[0], t.stride)
    # the same float parameters (bie's units hold batch norm's and PReLU's together)
    floats = {side: sorted(tuple(p.shape) for name, p in model.named_parameters()
                           if ".conv." not in name) for side, model in models.items()}
    assert floats["bie"] == floats["torch"]
    assert all(p.dtype == torch.int8 for m in binary["bie"] for p in [m.weight])
    x = torch.randn(2, 3, 32, 32)
    for model in models.values():
        assert model(x).shape == (2, 10)


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not torch.distributed.is_available(),
                    reason="this torch has no torch.distributed")
def test_two_processes(tmp_path):
    """What torchrun --nproc_per_node=2 sets up (its environment variables), with gloo; the
    1-process run's output as --baseline gives the scaling lines."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2")
    env.setdefault("BIE_LIBRARY", bie.library_path())
    if "GLOO_SOCKET_IFNAME" not in env and pathlib.Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"  # the ranks talk over the loopback interface
    one = subprocess.run([sys.executable, str(BENCH)] + TINY, env=dict(env, WORLD_SIZE="1"),
                         capture_output=True, text=True, timeout=180)
    assert one.returncode == 0, one.stderr
    (tmp_path / "one.jsonl").write_text(one.stdout)
    procs = [subprocess.Popen([sys.executable, str(BENCH)] + TINY
                              + ["--baseline", str(tmp_path / "one.jsonl")],
                              env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=180))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} failed (exit {p.returncode}):\n{err}"
    assert outs[1][0] == ""  # only rank 0 prints
    records = _check(outs[0][0].splitlines(), 2)
    scaling = [r for r in records if "scaling" in r]
    assert len(scaling) == 4
    assert all(r["scaling"] > 0 and r["baseline_world_size"] == 1 for r in scaling)
