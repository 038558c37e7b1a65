#!/usr/bin/env python3
"""One binary conv layer's training step (forward, then backward with every gradient) in bie
against the same convolution in bf16 through PyTorch (cuDNN, with the algorithms PyTorch
picks), side by side in one process, NCHW and channels-last, at the binary ResNet-18's
shapes (batch 1024) and the issue's layer shapes (batch 64):

    BIE_LIBRARY=build-gpu/libbie.so PYTHONPATH=python python3 python/bench/conv_layers.py

``--q4``: bie's 4-bit conv (NCHW only) at the batch-64 shapes instead, against PyTorch in
NCHW (``ratio``) and, as a second reference, in channels-last.

One JSON line per (shape, layout): median microseconds of ``--steps`` steps each side (CUDA
events around every step, after ``--warmup`` steps), and ``ratio`` = PyTorch time / bie time
(above 1: bie faster). Both sides get the same bf16 input and output gradient; the step
includes each side's own work on them (bie: sign packing, clip mask, int8 gradient; PyTorch:
its convolution kernels and any layout copies). Eager steps include the host's time where it
exceeds the device's; ``--cuda-graph`` times each side's step captured in a CUDA graph (the
device's time only)."""

import argparse
import json
import statistics
import sys

import pathlib

import torch

import bie

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from train_resnet import captured  # noqa: E402  (the same graph capture as the ResNet bench)

SHAPES = (  # (batch, in_c, out_c, size, stride)
    (1024, 64, 64, 32, 1),
    (1024, 128, 128, 16, 1),
    (1024, 256, 256, 8, 1),
    (1024, 512, 512, 4, 1),
    (1024, 128, 256, 16, 2),
    (64, 256, 256, 14, 1),
    (64, 128, 128, 28, 1),
)


def median_us(step, steps, warmup):
    for _ in range(warmup):
        step()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(steps)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3


def layer_step(module, x, g):
    x = x.detach().requires_grad_(True)

    def step():
        module(x).backward(g)
        for p in module.parameters():
            p.grad = None
        x.grad = None
    return step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--cuda-graph", action="store_true",
                   help="time each side's step captured in a CUDA graph (no host time)")
    p.add_argument("--q4", action="store_true",
                   help="bie's 4-bit conv (Q4Conv2dCutlass, NCHW) at the batch-64 shapes instead; "
                        "PyTorch also timed in channels-last (torch_bf16_channels_last_us)")
    p.add_argument("--fp8", action="store_true",
                   help="bie's binary conv with backward_mode = \"fp8\" (grad_x on e4m3 where it "
                        "applies); the rows say \"backward\": \"fp8\"")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("conv_layers: no CUDA device", file=sys.stderr)
        return 0
    torch.backends.cudnn.benchmark = True  # PyTorch's fastest algorithms for each shape
    dev, dt = "cuda", torch.bfloat16
    shapes = [sh for sh in SHAPES if sh[0] == 64] if args.q4 else SHAPES
    cls = bie.Q4Conv2dCutlass if args.q4 else bie.BinaryConv2dCutlass
    for n, ci, co, hw, s in shapes:
        torch.manual_seed(0)
        ours = cls(ci, co, 3, stride=s, padding=1, device=dev, dtype=dt)
        bie.prepare_bie_layers(ours)
        if args.fp8 and not args.q4:
            ours.backward_mode = "fp8"
        ours.train()
        ref = torch.nn.Conv2d(ci, co, 3, stride=s, padding=1, bias=False, device=dev, dtype=dt)
        x = torch.randn(n, ci, hw, hw, device=dev, dtype=dt)
        with torch.no_grad():
            g = torch.randn_like(ref(x)) * 0.01
        for layout in ("nchw",) if args.q4 else ("nchw", "channels_last"):
            fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
            xl, gl = x.contiguous(memory_format=fmt), g.contiguous(memory_format=fmt)
            ref = ref.to(memory_format=fmt)
            steps = [layer_step(ours, xl, gl), layer_step(ref, xl, gl)]
            if args.q4:  # PyTorch in its faster layout as well
                cl = torch.channels_last
                ref_cl = torch.nn.Conv2d(ci, co, 3, stride=s, padding=1, bias=False, device=dev,
                                         dtype=dt).to(memory_format=cl)
                steps.append(layer_step(ref_cl, x.contiguous(memory_format=cl),
                                        g.contiguous(memory_format=cl)))
            if args.cuda_graph:
                steps = [captured(s, torch.device(dev)) for s in steps]
            times = [median_us(s, args.steps, args.warmup) for s in steps]
            ours_us, torch_us = times[0], times[1]
            row = {
                "bench": "conv_layers", "kind": "q4" if args.q4 else "binary", "batch": n,
                "in_c": ci, "out_c": co, "size": hw, "stride": s, "layout": layout,
                "cuda_graph": args.cuda_graph, "bie_us": round(ours_us, 1),
                "torch_bf16_us": round(torch_us, 1), "ratio": round(torch_us / ours_us, 3),
                "backward": "fp8" if args.fp8 and not args.q4 else "exact"}
            if args.q4:
                row["torch_bf16_channels_last_us"] = round(times[2], 1)
            row.update({"device_name": torch.cuda.get_device_name(), "torch": torch.__version__})
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
