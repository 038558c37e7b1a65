#!/usr/bin/env python3
"""The unit after a binary convolution, ``PReLU(BatchNorm(y) + res)``, forward and backward
with every gradient: ``bie.BatchNormAct`` (one fused module) against PyTorch's
``nn.BatchNorm2d``, the add and ``nn.PReLU`` (cuDNN / PyTorch's kernels), side by side in one
process, bf16, NCHW and channels-last, at the binary ResNet-18's shapes (batch 1024, or
``--batch``):

    BIE_LIBRARY=build-gpu/libbie.so PYTHONPATH=python python3 python/bench/bn_act.py

One JSON line per (shape, layout, with or without the residual): median microseconds of
``--steps`` training steps each side, each captured in a CUDA graph (device time only), the
ratio PyTorch / bie (above 1: bie faster), and the bytes each side's step must move at least
(bie's: y read twice, res read and out written once forward; grad_out, y and res read twice,
grad_y and grad_res written once backward) as an achieved bandwidth.

``--device cpu`` times the same steps on the CPU in float32 (``time.perf_counter`` around
each step, batch 32, the threads torch and bie are given: ``--threads``)."""

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch
from torch import nn

import bie

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from conv_layers import median_us  # noqa: E402
from train_resnet import captured  # noqa: E402

SHAPES = ((1024, 64, 32), (1024, 128, 16), (1024, 256, 8), (1024, 512, 4))  # (batch, c, size)


class TorchUnit(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.bn, self.act = nn.BatchNorm2d(c), nn.PReLU(c)

    def forward(self, y, res=None):
        z = self.bn(y)
        if res is not None:
            z = z + res
        return torch.nn.functional.prelu(z, self.act.weight.to(z.dtype))


def step_of(module, y, res, g):
    y = y.detach().requires_grad_(True)
    res = None if res is None else res.detach().requires_grad_(True)

    def step():
        module(y, res).backward(g)
        for p in module.parameters():
            p.grad = None
        y.grad = None
        if res is not None:
            res.grad = None
    return step


def cpu_median_us(step, steps, warmup):
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--threads", type=int, default=2, help="CPU threads (--device cpu)")
    p.add_argument("--batch", type=int, default=None,
                   help="batch of every shape (default 1024 on CUDA, 32 on the CPU)")
    args = p.parse_args(argv)
    cpu = args.device == "cpu"
    if not cpu and not torch.cuda.is_available():
        print("bn_act: no CUDA device", file=sys.stderr)
        return 0
    if cpu:
        torch.set_num_threads(args.threads)
        bie.set_num_threads(args.threads)
        dev, dt, batch = torch.device("cpu"), torch.float32, args.batch or 32
    else:
        torch.backends.cudnn.benchmark = True
        dev, dt, batch = torch.device("cuda"), torch.bfloat16, args.batch or 1024
    shapes = [(batch, c, s) for _, c, s in SHAPES]
    for n, c, hw in shapes:
        torch.manual_seed(0)
        y = torch.randn(n, c, hw, hw, device=dev, dtype=dt) * 2 + 0.5
        r = torch.randn_like(y)
        g = torch.randn_like(y) * 0.01
        for layout in ("channels_last", "nchw"):
            fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
            yl, rl, gl = (t.contiguous(memory_format=fmt) for t in (y, r, g))
            for with_res in (True, False):
                ours = bie.BatchNormAct(c).to(dev)
                ref = TorchUnit(c).to(dev)
                res = rl if with_res else None
                steps = [step_of(m, yl, res, gl) for m in (ours, ref)]
                if cpu:
                    ours_us, torch_us = (cpu_median_us(s, args.steps, args.warmup)
                                         for s in steps)
                else:
                    steps = [captured(s, dev) for s in steps]
                    ours_us, torch_us = (median_us(s, args.steps, args.warmup) for s in steps)
                moved = y.numel() * y.element_size() * ((4 if with_res else 3) +
                                                        (8 if with_res else 5))
                print(json.dumps({
                    "bench": "bn_act", "device": args.device, "batch": n, "c": c, "size": hw,
                    "layout": layout, "residual": with_res, "bie_us": round(ours_us, 1),
                    "torch_us": round(torch_us, 1), "ratio": round(torch_us / ours_us, 3),
                    "bie_min_bytes": moved, "bie_gb_per_s": round(moved / ours_us / 1e3, 1),
                    "device_name": "cpu" if cpu else torch.cuda.get_device_name(),
                    "torch": torch.__version__}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
