#!/usr/bin/env python3
"""Where one bie layer's training step (forward, then backward with every gradient) spends
its device time: the PyTorch profiler over a few eager steps, one row per kernel (device
microseconds per step, calls per step), then the step's time as a CUDA graph replay beside
the same bf16 layer in PyTorch (cuBLAS / cuDNN), as conv_layers.py and the C bench time it.

    BIE_LIBRARY=build-gpu/libbie.so PYTHONPATH=python python3 python/bench/profile_layer.py \\
        --layer linear --size 4096 --backward fp8
    ... --layer conv --batch 64 --channels 256 --size 14 --channels-last
    ... --layer q4linear --size 4096

The table's last line is JSON: the layer, the step's graph time for bie and PyTorch, their
ratio (PyTorch / bie) and the kernels' device time per eager step."""

import argparse
import collections
import json
import pathlib
import sys

import torch

import bie

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from conv_layers import layer_step, median_us  # noqa: E402
from train_resnet import captured  # noqa: E402


def build(args, dev, dt):
    """(bie module, the PyTorch module, input, output gradient) for the arguments."""
    torch.manual_seed(0)
    if args.layer in ("linear", "q4linear"):
        cls = bie.BinaryLinearCutlass if args.layer == "linear" else bie.Q4LinearCutlass
        n = args.size
        ours = cls(n, n, device=dev, dtype=dt)
        ref = torch.nn.Linear(n, n, bias=False, device=dev, dtype=dt)
        x = torch.randn(args.batch or n, n, device=dev, dtype=dt)
    else:
        c, s = args.channels, args.stride
        cls = bie.BinaryConv2dCutlass if args.layer == "conv" else bie.Q4Conv2dCutlass
        ours = cls(c, c, 3, stride=s, padding=1, device=dev, dtype=dt)
        ref = torch.nn.Conv2d(c, c, 3, stride=s, padding=1, bias=False, device=dev, dtype=dt)
        x = torch.randn(args.batch or 64, c, args.size, args.size, device=dev, dtype=dt)
        if args.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
            ref = ref.to(memory_format=torch.channels_last)
    bie.prepare_bie_layers(ours)
    if args.backward != "exact":
        ours.backward_mode = args.backward
    ours.train()
    with torch.no_grad():
        g = (torch.randn_like(ref(x)) * 0.01).contiguous(
            memory_format=torch.channels_last if args.channels_last else torch.contiguous_format)
    return ours, ref, x, g


def kernel_table(step, steps):
    """{kernel name: (device µs per step, calls per step)} over ``steps`` profiled steps."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            rows[e.name][0] += e.device_time / steps if hasattr(e, "device_time") else \
                e.cuda_time / steps
            rows[e.name][1] += 1
    return {k: (v[0], v[1] / steps) for k, v in rows.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layer", choices=("linear", "q4linear", "conv", "q4conv"),
                   default="linear")
    p.add_argument("--size", type=int, default=4096,
                   help="features (linear) or the image's side (conv)")
    p.add_argument("--batch", type=int, default=0,
                   help="rows (linear, default --size) or images (conv, default 64)")
    p.add_argument("--channels", type=int, default=256, help="conv: in and out channels")
    p.add_argument("--stride", type=int, default=1)
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--backward", choices=("exact", "fp8"), default="exact")
    p.add_argument("--steps", type=int, default=10, help="profiled and timed steps")
    p.add_argument("--rows", type=int, default=20)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_layer: no CUDA device", file=sys.stderr)
        return 0
    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda")
    ours, ref, x, g = build(args, dev, torch.bfloat16)
    step = layer_step(ours, x, g)
    for _ in range(5):
        step()
    table = kernel_table(step, args.steps)
    total = sum(t for t, _ in table.values())
    print(f"{'µs/step':>9} {'calls':>5}  kernel")
    for name, (t, calls) in sorted(table.items(), key=lambda kv: -kv[1][0])[:args.rows]:
        print(f"{t:9.1f} {calls:5.1f}  {name[:110]}")
    graphs = [captured(s, dev) for s in (step, layer_step(ref, x, g))]
    bie_us, torch_us = (median_us(s, 3 * args.steps, 5) for s in graphs)
    print(json.dumps({
        "bench": "profile_layer", "layer": args.layer, "size": args.size,
        "batch": x.shape[0], "channels": args.channels if "conv" in args.layer else None,
        "channels_last": args.channels_last, "backward": args.backward,
        "bie_graph_us": round(bie_us, 1), "torch_bf16_graph_us": round(torch_us, 1),
        "ratio": round(torch_us / bie_us, 3), "kernels_us": round(total, 1),
        "device_name": torch.cuda.get_device_name()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
