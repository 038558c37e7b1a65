#!/usr/bin/env python3
"""Where a training step of train_resnet.py's binary ResNet-18 spends its time: the PyTorch
profiler over a few steps of one side (bie's modules or the plain PyTorch network), the top
operators and kernels by device time (CPU time on the CPU), and optionally a Chrome trace.

    BIE_LIBRARY=build-gpu/libbie.so python3 python/bench/profile_resnet.py --side bie \\
        --batch 1024 --trace bie_1024.json

Same network, data and step as train_resnet.py (which it imports); bf16 autocast on CUDA,
float32 on the CPU. The table has a row per operator (aten::*, bie's autograd Functions) and,
on CUDA, per kernel; self device time is what each launched itself. ``--sort cpu`` orders by
host time instead (for steps the host limits). Under torchrun (2 or more processes) the model
is wrapped in DistributedDataParallel as in train_resnet.py and rank 0 prints its profile:

    BIE_LIBRARY=build-gpu/libbie.so torchrun --standalone --nproc_per_node=2 \
        python/bench/profile_resnet.py --side bie --batch 256 --sort cpu
"""

import argparse
import contextlib
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import train_resnet  # noqa: E402  (the network and its builder)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--side", choices=("bie", "torch"), default="bie")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=5, help="profiled steps (default 5)")
    p.add_argument("--warmup", type=int, default=3, help="steps before profiling (default 3)")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--width-div", type=int, default=1, help="divide every width (quick runs)")
    p.add_argument("--rows", type=int, default=25, help="rows of the table (default 25)")
    p.add_argument("--trace", default=None, help="write a Chrome trace to this file")
    p.add_argument("--sort", choices=("device", "cpu"), default="device",
                   help="order the table by device time (CUDA; default) or host time")
    p.add_argument("--channels-last", action="store_true",
                   help="activations in channels_last (NHWC) memory, as train_resnet.py's")
    p.add_argument("--recompute", action="store_true",
                   help="bie's units: BatchNormAct(recompute=True), as train_resnet.py's")
    p.add_argument("--groups", action="store_true",
                   help="also print the device time per step of kernel groups (CUDA)")
    return p.parse_args(argv)


# Kernel groups by name (first match wins), for --groups.
GROUPS = (
    ("bie grad_w", r"wgrad"),
    ("bie grad_x", r"bie_cuda.*dgrad"),
    ("bie other (forward, packing, copies, sums)", r"bie_cuda"),
    ("batch norm", r"batch_norm"),
    ("PReLU", r"prelu"),
    ("average pool", r"avg_pool"),
    ("cuDNN convolutions (with layout copies)", r"cudnn|sm90_xmma|cutlass|implicit_|nvjet|dgrad"),
    ("adds", r"CUDAFunctor_add"),
    ("straight-through sign (where, abs, compare)", r"where|compare_scalar|AbsFunctor"),
    ("reductions", r"reduce_kernel"),
    ("optimizer", r"multi_tensor|foreach|adam|lerp"),
)


def print_groups(prof, steps):
    """Device time per step of the kernels, summed by GROUPS (kernels only, no operators)."""
    import re
    totals, launches = {}, {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0)
        # (ranges such as the optimizer's step annotation show on the device timeline too)
        if (t <= 0 or "CUDA" not in str(e.device_type)
                or getattr(e, "is_user_annotation", False) or e.key.startswith("Optimizer.")):
            continue
        name = next((g for g, pat in GROUPS if re.search(pat, e.key)), "other")
        totals[name] = totals.get(name, 0.0) + t
        launches[name] = launches.get(name, 0) + e.count
    print("kernel group                                   ms per step  kernels per step")
    for name, t in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"{name:46s} {t / 1e3 / steps:8.3f} {launches[name] / steps:10.0f}")
    print(f"{'total':46s} {sum(totals.values()) / 1e3 / steps:8.3f} "
          f"{sum(launches.values()) / steps:10.0f}")


def main(argv=None):
    args = parse(argv)
    args.threads, args.cuda_graph = 0, False
    device, dist = train_resnet.setup(args)  # the process group under torchrun
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    model, make_opt = train_resnet.build(args.side, device, dtype, args.width_div,
                                         args.channels_last, recompute=args.recompute)
    if dist is not None:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if cuda else None)
    opt = make_opt(model.parameters())
    model.train()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 3, 32, 32, generator=gen).to(device)
    if args.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, train_resnet.CLASSES, (args.batch,), generator=gen).to(device)
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype != torch.float32
                else contextlib.nullcontext())

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    if dist is not None and dist.get_rank() != 0:
        dist.destroy_process_group()
        return
    key = "self_cuda_time_total" if cuda and args.sort == "device" else "self_cpu_time_total"
    ranks = f", rank 0 of {dist.get_world_size()} (DDP)" if dist is not None else ""
    print(f"profile_resnet: side {args.side}, batch {args.batch}, {args.steps} steps on "
          f"{torch.cuda.get_device_name(device) if cuda else 'the CPU'}{ranks}")
    print(prof.key_averages().table(sort_by=key, row_limit=args.rows))
    if args.groups and cuda:
        print_groups(prof, args.steps)
    if args.trace:
        prof.export_chrome_trace(args.trace)
        print(f"wrote {args.trace}")
    if dist is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
