"""Data-parallel training of every bie layer kind under DistributedDataParallel: one rank's
part of the check that every parameter, buffer and optimizer state ends up bit-identical on
every rank.

Used by test_distributed.py (gloo on the CPU: ``python3 ddp_check.py RANK WORLD PORT OUT``,
one process per rank, each saving its results to OUT for the test to compare) and by
tests/gpu/ddp_nccl.py (NCCL, one GPU per rank, under torchrun). Each rank builds the model
from its own seed (DDP must broadcast rank 0's parameters, int8 weights and all, into bie's
memory), trains on its own random data (scaled differently per rank, so that each rank would
measure another scale_a), with SignFlip for the int8 binary weights (no seed: rank 0's draw is
broadcast) and Adam for the float parameters. The first step's gradients are checked against
the mean of each rank's own, recomputed on a deepcopy of the model outside DDP; that copy, and
eval() (which rebuilds each C layer to pack qweight), must keep scale_a as it is, which is
checked first (a layer that measured scale_a again would make the means differ for every
layer, torch's included).
"""

import contextlib
import copy
import pathlib
import sys

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # python/: the package

import bie  # noqa: E402
import bie.distributed  # noqa: E402

BATCH, STEPS = 16, 12
BIE_KINDS = (bie.BinaryConv2dBase, bie.BinaryLinearBase, bie.Q4Conv2dCutlass,
             bie.Q4LinearCutlass)
TRAINED = ("weight", "bias_a", "scale_a", "scale_w")  # a bie layer's trained parameters


def make_model():
    """Every bie kind (binary conv2d, 4-bit conv2d, binary linear, 4-bit linear) among torch
    layers, batch norm included (a module with buffers)."""
    return nn.Sequential(
        bie.BinaryConv2dCutlass(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        bie.Q4Conv2dCutlass(8, 8, 3, padding=1), nn.MaxPool2d(2), nn.Flatten(),
        bie.BinaryLinearCutlass(8 * 4 * 4, 32), nn.BatchNorm1d(32),
        bie.Q4LinearCutlass(32, 16), nn.ReLU(), nn.Linear(16, 10))


def run_gloo_ranks(script, world, args, outs, timeout):
    """Run ``script`` (a file beside this one) in ``world`` processes talking gloo over the
    loopback interface, rank r with the arguments ``r world port *args outs[r]``, and return
    what each saved in ``outs[r]`` (torch.load); a rank that fails fails the caller's test
    with its output."""
    import os
    import socket
    import subprocess
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env.setdefault("BIE_LIBRARY", bie.library_path())
    if "GLOO_SOCKET_IFNAME" not in env and pathlib.Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"  # the ranks talk over the loopback interface
    here = pathlib.Path(__file__).resolve().parent
    procs = [subprocess.Popen([sys.executable, str(here / script), str(rank), str(world),
                               str(port), *map(str, args), str(out)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for rank, out in enumerate(outs)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"{script} rank {rank} failed (exit {p.returncode}):\n{log}"
    return [torch.load(out) for out in outs]


def make_shared_model():
    """A binary layer applied twice in each forward (shared weights; keep_inputs lets the
    backward of its first use run that forward again): its second backward replaces the
    gradient buffers its first one left."""
    shared = bie.BinaryLinearCutlass(24, 24, keep_inputs=True)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 24), shared, nn.Tanh(), shared,
                         nn.Tanh(), bie.BinaryLinearCutlass(24, 10))


class _CountAllReduce:
    """Counts torch.distributed.all_reduce calls (bie's; DDP's reducer calls C++ directly)."""

    def __init__(self):
        self.calls = 0
        self._original = torch.distributed.all_reduce

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._original(*args, **kwargs)


def _cpu(t):
    """A CPU copy of t (on the CPU, .cpu() would return t itself, which zero_grad zeroes)."""
    return t.detach().to("cpu", copy=True)


def train(rank, device, fix=True, steps=STEPS, make=make_model, accumulate=False):
    """Train under DDP on this rank; returns a dict of CPU tensors (what must agree across
    ranks) and a few facts. With fix=False, bie's data-parallel support is switched off (what
    the package did before it had one): the ranks must then drift apart."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    active = bie.distributed.active
    if not fix:
        bie.distributed.active = lambda: None
    counter = _CountAllReduce()
    torch.distributed.all_reduce = counter
    bucket_bytes = bie.distributed.BUCKET_BYTES
    try:
        torch.manual_seed(100 + rank)  # each rank builds other weights: DDP broadcasts rank 0's
        model = make().to(device)
        bie.prepare_bie_layers(model)  # int8 binary weights, before DDP and the optimizer
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        # no seed: each rank's torch generator differs (seeded per rank above), and SignFlip
        # takes rank 0's draw on every rank, so the initial state is the same everywhere
        opt = bie.SignFlip(ddp.parameters(), lr=1e-2, betas=(0.9, 0.99), float_lr=1e-2)
        data = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
        out = {}
        flipped = 0
        calls = []
        for step in range(steps):
            x = torch.randn(BATCH, 3, 8, 8, generator=data) * (1 + rank)
            y = torch.randint(0, 10, (BATCH,), generator=data)
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            before = counter.calls
            # odd steps: every gradient in a bucket of its own (the same values either way)
            bie.distributed.BUCKET_BYTES = 1 if step % 2 else bucket_bytes
            # accumulate: a backward under no_sync() on half the batch, then a synchronised
            # one on the other half (gradient accumulation)
            parts = [(x[:BATCH // 2], y[:BATCH // 2]), (x[BATCH // 2:], y[BATCH // 2:])] \
                if accumulate else [(x, y)]
            for k, (xp, yp) in enumerate(parts):
                with ddp.no_sync() if k + 1 < len(parts) else contextlib.nullcontext():
                    nn.functional.cross_entropy(ddp(xp), yp).backward()
            calls.append(counter.calls - before)
            if step == 0:
                _record_gradients(model, parts, out)
            opt.step()
            flipped += opt.flipped
        # The trained values of bie's parameters, before eval() rebuilds each C layer to pack
        # qweight: what the drift check compares, and what eval() must keep.
        for name, m in model.named_modules():
            if isinstance(m, BIE_KINDS):
                for pname in TRAINED:
                    out[f"trained/{name}.{pname}"] = _cpu(getattr(m, pname))
        # An eval forward with the same input on every rank: DDP broadcasts rank 0's buffers
        # (batch norm's running statistics, which each rank's last training forward updated
        # from its own batch) before it; eval() packs qweight from the trained weights.
        ddp.eval()
        with torch.no_grad():
            probe = torch.randn(BATCH, 3, 8, 8, generator=torch.Generator().manual_seed(7))
            out["eval_output"] = _cpu(ddp(probe.to(device)))
        for name, t in model.state_dict().items():
            out["state/" + name] = _cpu(t)
        for i, state in opt.state_dict()["state"].items():
            for key, value in state.items():
                if torch.is_tensor(value):
                    out[f"opt/{i}/{key}"] = _cpu(value)
        facts = {"flipped": flipped, "all_reduce_calls": calls,
                 "int8_weights": [n for n, p in model.named_parameters()
                                  if p.dtype == torch.int8],
                 "ddp_float_params": [n for n, p in model.named_parameters()
                                      if p.requires_grad]}
        return out, facts
    finally:
        bie.distributed.active = active
        torch.distributed.all_reduce = counter._original
        bie.distributed.BUCKET_BYTES = bucket_bytes


def _record_gradients(model, parts, out):
    """The first step's gradients after DDP's backward (float ones averaged by DDP, int8 ones
    by bie), and this rank's local ones: the same step (the backwards of each (x, y) of
    ``parts``, accumulated) on a copy of the model outside DDP."""
    for name, p in model.named_parameters():
        if p.grad is not None:
            out["grad/" + name] = _cpu(p.grad)
    local = copy.deepcopy(model)  # same parameters (scale_a as agreed), no DDP
    copied = {name: _cpu(lm.scale_a) for name, lm in local.named_modules()
              if isinstance(lm, BIE_KINDS)}
    for x, y in parts:
        nn.functional.cross_entropy(local(x), y).backward()
    for (name, m), (_, lm) in zip(model.named_modules(), local.named_modules()):
        if isinstance(m, BIE_KINDS):
            # scale_a of the model, of its copy, and of the copy after its forward: all equal
            # unless the copy measured scale_a again on this rank's batch (then its gradients
            # are not the ones DDP's forward made, and the checks of the means must fail)
            out[f"local_scale_a/{name}"] = torch.cat(
                [_cpu(m.scale_a).reshape(1), copied[name].reshape(1),
                 _cpu(lm.scale_a).reshape(1)])
            if m.weight.dtype == torch.int8:
                out[f"float_grad/{name}"] = _cpu(m.weight_float_grad())
                out[f"local_float_grad/{name}"] = _cpu(lm.weight_float_grad())
    for name, p in local.named_parameters():
        if p.grad is not None and p.is_floating_point():
            out["local_grad/" + name] = _cpu(p.grad)


def _bits(t):
    """The bytes of t (so that -0.0 != 0.0 and a NaN equals itself)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def mismatches(results):
    """Names of the tensors that are not bit-identical on every rank (results: one dict per
    rank)."""
    bad = []
    first = results[0]
    for name, t in first.items():
        if name.startswith("local_"):
            continue  # each rank's own gradients: they differ by design
        for other in results[1:]:
            u = other.get(name)
            if (u is None or u.dtype != t.dtype or u.shape != t.shape
                    or not torch.equal(_bits(t), _bits(u))):
                bad.append(name)
                break
    return bad


def _gap(got, want):
    """How far got is from want: the largest difference and the largest value."""
    return (f"max |diff| {float((got - want).abs().max()):.3g}, "
            f"max |value| {float(want.abs().max()):.3g}")


def check_gradients(results):
    """The first step's reduced gradients against the ranks' local ones: float ones averaged
    (by DDP), int8 ones the SPEC §1 quantization of the averaged float gradient (by bie).
    Returns a list of problems."""
    problems = []
    world = len(results)
    r0 = results[0]
    for name in r0:
        if name.startswith("local_grad/"):
            mean = sum(r[name] for r in results) / world
            got = r0["grad/" + name[len("local_grad/"):]]
            if not torch.allclose(got, mean, rtol=1e-5, atol=1e-6):
                problems.append(f"{name[len('local_grad/'):]}: DDP's gradient is not the mean "
                                f"({_gap(got, mean)})")
        if name.startswith("local_float_grad/"):
            layer = name[len("local_float_grad/"):]
            mean = sum(r[name] for r in results) / world
            got = r0["float_grad/" + layer]
            if not torch.allclose(got, mean, rtol=1e-5, atol=1e-6):
                problems.append(f"{layer}: weight_float_grad() is not the mean of the ranks' "
                                f"({_gap(got, mean)})")
            if not torch.equal(r0[f"grad/{layer}.weight"], bie.distributed.quantize_int8(got)):
                problems.append(f"{layer}: weight.grad is not the int8 quantization of the "
                                "mean float gradient")
            if torch.equal(results[0][name], results[1][name]):
                problems.append(f"{layer}: the ranks' local gradients are equal (same data?)")
    return problems


def check_facts(facts):
    """What DDP and bie each reduce (one rank's facts). Returns a list of problems."""
    problems = []
    # DDP reduces the float parameters (they require a gradient); bie the int8 weights, which
    # DDP skips: disjoint sets, so nothing is reduced twice.
    if facts["int8_weights"] != ["0.weight", "6.weight"]:
        problems.append(f"int8 weights: {facts['int8_weights']}")
    ddp = set(facts["ddp_float_params"])
    expected = {"0.bias_a", "0.scale_a", "3.weight", "3.bias_a", "3.scale_a", "6.bias_a",
                "6.scale_a", "8.weight", "8.bias_a", "8.scale_a"}
    if not expected <= ddp:
        problems.append(f"DDP does not reduce {sorted(expected - ddp)}")
    if ddp & set(facts["int8_weights"]):
        problems.append("DDP reduces an int8 weight")
    # bie's all-reduces: the 4 layers' first scale_a, then one per bucket of int8 weights'
    # gradients: both in one bucket on even steps, a bucket each on odd steps
    calls = facts["all_reduce_calls"]
    if calls[0] != 4 + 1 or calls[1::2] != [2] * len(calls[1::2]) or set(calls[2::2]) != {1}:
        problems.append(f"bie's all-reduces per step: {calls}, expected [5, 2, 1, 2, ...]")
    if facts["flipped"] <= 0:
        problems.append("no binary weight flipped: the sign flips were not exercised")
    return problems


def check_drift(drifted, drift_facts):
    """Without bie's data-parallel support (one dict per rank): the trained int8 weights and
    scale_a must differ between the ranks, or the bit-for-bit check could not fail. (The
    trained values, before eval(): eval()'s forward runs on the same probe on every rank.)"""
    bad = mismatches(drifted)
    problems = []
    if not ("trained/0.scale_a" in bad and "trained/8.scale_a" in bad):
        values = [[float(r[f"trained/{i}.scale_a"].reshape(())) for r in drifted]
                  for i in (0, 8)]
        problems.append(f"without bie's support, scale_a still agrees across ranks (layers 0 "
                        f"and 8, per rank: {values})")
    if not ("trained/0.weight" in bad or "trained/6.weight" in bad):
        problems.append("without bie's support, the int8 weights still agree across ranks")
    if drift_facts["all_reduce_calls"] != [0] * len(drift_facts["all_reduce_calls"]):
        problems.append("bie reduced something with its support switched off")
    return problems


def check_scale_a_kept(results, run=""):
    """scale_a, once set, is kept by what rebuilds a bie layer from its values (results: one
    dict per rank; run: which training, for the messages): a deepcopy (the local
    recomputation of the gradient checks) and eval() (which packs qweight into a new C layer)
    must not measure it again at their next forward; eval() keeps every trained parameter.
    Returns a list of problems, one per tensor (with the ranks where it happened)."""
    found = {}  # tensor -> [the first rank's message, a template of {where}; the ranks]
    for rank, r in enumerate(results):
        for name, t in r.items():
            message = None
            if name.startswith("local_scale_a/"):
                layer = name[len("local_scale_a/"):]
                model, copied, after = (float(v) for v in t)
                if copied != model:
                    message = (f"{layer}: deepcopy changed scale_a{run} ({model!r} -> "
                               f"{copied!r} {{where}})")
                elif after != copied:
                    message = (f"{layer}: the deepcopy's forward measured scale_a again{run} "
                               f"({copied!r} -> {after!r} {{where}}): a layer rebuilt from its "
                               "values forgot that scale_a is set, so the local gradients are "
                               "not the model's")
            if name.startswith("trained/"):
                now = r.get("state/" + name[len("trained/"):])
                if now is None or not torch.equal(_bits(now), _bits(t)):
                    gap = "" if now is None or now.dtype != t.dtype else (
                        f"{_gap(now.float(), t.float())}, ")
                    message = f"eval() changed {name[len('trained/'):]}{run} ({gap}{{where}})"
            if message is not None:
                found.setdefault(name, [message, []])[1].append(rank)
    return [message.format(where=f"on rank {ranks[0]}" + (
        f", also on rank{'s' if len(ranks) > 2 else ''} {', '.join(map(str, ranks[1:]))}"
        if len(ranks) > 1 else "")) for message, ranks in found.values()]


def check(ranks):
    """Every check on the ranks' results (one dict per rank, as ``run`` returns); a list of
    problems, empty when data-parallel training works."""
    fixed = [r["fixed"] for r in ranks]
    problems = [f"{name} differs between ranks" for name in mismatches(fixed)]
    # first what would make the gradient checks fail for a reason other than averaging
    problems += check_scale_a_kept(fixed)
    problems += check_scale_a_kept([r["drifted"] for r in ranks], " without bie's support")
    problems += check_gradients(fixed)
    for phase in ("shared", "accumulated"):
        results = [r[phase] for r in ranks]
        problems += [f"{name} differs between ranks ({phase})" for name in mismatches(results)]
        problems += [f"{p} ({phase})" for p in check_gradients(results)]
    problems += check_facts(ranks[0]["facts"])
    problems += check_drift([r["drifted"] for r in ranks], ranks[0]["drift_facts"])
    return problems


def run(rank, device):
    """This rank's part: training with bie's data-parallel support, then without it."""
    fixed, facts = train(rank, device)
    drifted, drift_facts = train(rank, device, fix=False, steps=4)
    shared, _ = train(rank, device, steps=4, make=make_shared_model)
    accumulated, _ = train(rank, device, steps=3, accumulate=True)
    return {"fixed": fixed, "facts": facts, "drifted": drifted, "drift_facts": drift_facts,
            "shared": shared, "accumulated": accumulated}


def main():
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    from datetime import timedelta
    torch.set_num_threads(1)
    bie.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=world,
                                         timeout=timedelta(seconds=60))
    try:
        torch.save(run(rank, torch.device("cpu")), out)
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
