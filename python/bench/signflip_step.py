#!/usr/bin/env python3
"""Step time of bie.SignFlip: the fused step (torch._foreach_* over all parameters, no
synchronisation) against the per-parameter step it replaced (read from git, commit OLD_REV).

The model: 20 x (BinaryLinearCutlass(512, 512) + BatchNorm1d(512)) + Linear(512, 10), i.e.
20 int8 weights of 512 x 512 and 82 float parameters; gradients are fixed random tensors
(int8 for the binary weights), so only the optimizer step is timed. Old and new steps
alternate in rounds in one process; both run on identical copies of the model with the same
gradients and seed, and their parameters and states are checked to stay bit-identical. One
JSON line: median and minimum seconds per step of each, and the ratio of the medians.

    BIE_LIBRARY=build/libbie.so /usr/bin/python3 python/bench/signflip_step.py [--device cpu] [--threads N] [--old REV]
"""

import argparse
import copy
import json
import pathlib
import statistics
import subprocess
import sys
import time
import types

import torch
from torch import nn

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import bie  # noqa: E402

OLD_REV = "7857747ffe081781b9396363b0f1cb3e4dea3c84"  # the per-parameter step with .item()


def old_signflip(rev=OLD_REV):
    """The SignFlip class of revision ``rev``'s python/bie/optim.py."""
    source = subprocess.run(["git", "show", f"{rev}:python/bie/optim.py"], cwd=HERE,
                            check=True, capture_output=True, text=True).stdout
    source = source.replace("from ._lib import", "from bie._lib import")  # outside the package
    module = types.ModuleType("bie_optim_old")
    exec(compile(source, "bie_optim_old.py", "exec"), module.__dict__)
    return module.SignFlip


def make_model(device):
    layers = []
    for _ in range(20):
        layers += [bie.BinaryLinearCutlass(512, 512), nn.BatchNorm1d(512)]
    model = nn.Sequential(*layers, nn.Linear(512, 10))
    bie.prepare_bie_layers(model)
    return model.to(device)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20, help="steps per round and optimizer")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument("--old", default=OLD_REV, help=f"revision to compare (default {OLD_REV})")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    base = make_model(device)
    models = {"old": base, "new": copy.deepcopy(base)}
    trained = [p for p in base.parameters() if p.requires_grad or p.dtype == torch.int8]
    grads = [torch.randint(-127, 128, p.shape, dtype=torch.int8, device=device)
             if p.dtype == torch.int8 else torch.randn(p.shape, device=device) * 1e-2
             for p in trained]
    classes = {"old": old_signflip(args.old), "new": bie.SignFlip}
    opts = {}
    for name, model in models.items():
        params = [p for p in model.parameters() if p.requires_grad or p.dtype == torch.int8]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opts[name] = classes[name](params, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01,
                                   seed=1)
        opts[name].step()  # the first step draws the state
    times = {"old": [], "new": []}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.rounds):
        for name in ("old", "new"):
            sync()
            start = time.perf_counter()
            for _ in range(args.steps):
                opts[name].step()
            sync()
            times[name].append((time.perf_counter() - start) / args.steps)
    old_params, new_params = list(models["old"].parameters()), list(models["new"].parameters())
    for p, q in zip(old_params, new_params):
        assert torch.equal(p, q), "the new step diverged from the old one"
        for key, value in opts["old"].state[p].items():
            other = opts["new"].state[q][key]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other
    assert opts["old"].flipped == opts["new"].flipped
    result = {"device": str(device), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "binary_params": 20, "float_params": sum(
                  1 for p in trained if p.dtype != torch.int8),
              "rounds": args.rounds, "steps_per_round": args.steps, "old": args.old}
    for name in ("old", "new"):
        result[f"{name}_median_s"] = statistics.median(times[name])
        result[f"{name}_min_s"] = min(times[name])
    result["old_over_new"] = result["old_median_s"] / result["new_median_s"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
