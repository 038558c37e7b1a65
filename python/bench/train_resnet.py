#!/usr/bin/env python3
"""End-to-end training and inference of a binary ResNet-18: bie's modules against the same
network in pure PyTorch (a straight-through sign), images per second and peak memory.

The network (Bi-Real style, 3 x 32 x 32 inputs, 10 classes): a float stem (3 x 3 conv 3 -> 64,
batch norm, PReLU; no max-pool), 4 stages of 64, 128, 256, 512 channels with 2 basic blocks
each (ResNet-18), every basic block 2 binary units, each unit
``PReLU(BN(binary_conv3x3(x)) + shortcut(x))`` with its own real-valued shortcut: the identity,
or, where the unit changes the resolution (stride 2) or the width, ``AvgPool2d(2)`` (stride 2
only) + float 1 x 1 conv + BN; the head is a global average pool and a float linear layer.
16 binary convolutions, the rest float.

- ``bie``: the binary convolutions are ``bie.BinaryConv2dCutlass`` (int8 weights after
  ``bie.prepare_bie_layers``, learnable ``scale_a`` and ``bias_a``; on CUDA in the run's dtype),
  and the batch norm + residual add + PReLU after each of them (and the stem's batch norm +
  PReLU) is one ``bie.BatchNormAct`` (one bie call each way; float32 statistics and
  parameters, activations in the run's dtype on CUDA); the shortcuts' batch norms stay
  ``nn.BatchNorm2d``. Trained with ``bie.SignFlip`` (sign flips for the int8 weights, Adam for
  the float parameters, ``float_lr`` 1e-3).
- ``torch``: the same network whose binary convolution is ``F.conv2d`` of ``sign(x)`` (a
  straight-through estimator: the gradient passes where ``|x| <= 1``) and of ``sign(w) *
  mean|w|`` per output channel (a float32 latent weight, the same estimator), trained with
  ``torch.optim.Adam`` (lr 1e-3). No ``bias_a`` / ``scale_a``: slightly less work than bie's
  layer does; the binarized weight is recomputed at every forward, in inference too. Batch
  norm, the residual add and PReLU are torch's ``nn.BatchNorm2d``, ``+`` and ``F.prelu``.

``--dtype bf16`` runs both under ``torch.autocast(bfloat16)`` (float parameters stay float32;
bie's layers compute in bfloat16 on CUDA, in float32 on the CPU, where bie has only float32
layers); ``fp32`` runs both without autocast. One training step is forward, cross-entropy,
backward and optimizer step on a fixed synthetic batch (random images and labels); inference
is ``eval()`` and a forward under ``torch.no_grad()``. Each (side, batch, mode) gets a fresh
model (seeded alike), ``--warmup`` untimed steps, then ``--steps`` timed ones: CUDA events
between the steps on CUDA, with no synchronisation until the last (``images_per_s`` is the
batch over the mean step time), ``time.perf_counter`` on the CPU. On CUDA, one untimed step of
every side and mode at the smallest batch comes first; ``torch.backends.cudnn.benchmark`` is
on for both sides.

Peak memory (CUDA only), per process: ``peak_allocated_bytes`` is
``torch.cuda.max_memory_allocated()`` over the timed steps (reset before each model);
``outside_bytes`` is the device memory held outside torch's allocator after them (device used
memory less ``torch.cuda.memory_reserved()``, less the same quantity measured before the model
was built): bie's C layers allocate their own buffers (packed weights, the saved input signs
and masks, weight gradients) with ``cudaMalloc``, which torch's counters do not see. bie's
per-call ``cudaMallocAsync`` workspaces (the im2col path, not the default implicit GEMM) are
not counted. ``peak_bytes`` = the sum, the value compared.

Data parallel: under ``torchrun`` (``WORLD_SIZE`` > 1) each process runs one GPU (NCCL) or a
CPU share (gloo); both models are wrapped in ``DistributedDataParallel`` for training as the
README's data-parallel section says (``prepare_bie_layers`` first, ``SignFlip`` after the
wrap). ``--batch`` is the batch of each process (weak scaling: the global batch is
``--batch`` x processes); ``images_per_s`` is rank 0's, ``images_per_s_total`` the sum over
the processes, ``images_per_s_ranks`` each one's. Inference needs no communication: each
process runs its unwrapped model. Only rank 0 prints. Scaling from 1 to 2 GPUs is
``images_per_s_total`` of the 2-process run over that of the 1-process run at the same
``--batch``; ``--baseline FILE`` (the ``--json`` output of a 1-process run) prints it.
``--cuda-graph`` captures each side's whole step (forward, backward and a ``capturable``
optimizer step: bie.SignFlip's, torch's Adam) in a CUDA graph and times its replays, which
leave no host work (one process).
``median_host_ms_per_step_ranks``: each process's median host time per step (the time its
Python thread spent in the step's calls); where it is about ``median_ms_per_step`` the step
is host-limited (the device waits for work).

One line per (side, batch, mode) and, with both sides, one ratio line per (batch, mode):
``images_per_s_ratio`` = bie / torch (training target >= 1.3), ``peak_bytes_ratio`` = bie /
torch (training target <= 0.5). ``--json``: JSON lines only.

    BIE_LIBRARY=build/libbie.so python3 python/bench/train_resnet.py --json
    BIE_LIBRARY=build/libbie.so torchrun --standalone --nproc_per_node=2 \\
        python/bench/train_resnet.py --json --baseline one_gpu.jsonl
    BIE_LIBRARY=build/libbie.so python3 python/bench/train_resnet.py --device cpu --batch 4 \\
        --steps 2 --warmup 1 --dtype fp32 --width-div 8        # a quick check on the CPU
"""

import argparse
import contextlib
import gc
import json
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import bie  # noqa: E402

WIDTHS = (64, 128, 256, 512)
CLASSES = 10
TARGETS = {"train": {"images_per_s_ratio": ">= 1.3", "peak_bytes_ratio": "<= 0.5"},
           "infer": {}}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# ------------------------------------------------------------------ the network


class SignSTE(torch.autograd.Function):
    """sign with sign(0) = +1; backward: the gradient where |x| <= 1, else 0."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)  # shared with the other users of x: no extra memory
        one = x.new_ones(())
        return torch.where(x >= 0, one, -one)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return torch.where(x.abs() <= 1, grad, grad.new_zeros(()))


class TorchBinaryConv2d(nn.Module):
    """The pure-PyTorch binary 3 x 3 convolution: F.conv2d(sign(x), sign(w) * mean|w|)."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0):
        super().__init__()
        self.stride, self.padding = stride, padding
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, kernel_size,
                                               kernel_size))
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    def forward(self, x):
        scale = self.weight.abs().mean(dim=(1, 2, 3), keepdim=True).detach()
        w = SignSTE.apply(self.weight) * scale
        return F.conv2d(SignSTE.apply(x), w, None, self.stride, self.padding)


class PReLU(nn.PReLU):
    """nn.PReLU whose weight takes the input's dtype (a bfloat16 input under autocast)."""

    def forward(self, x):
        return F.prelu(x, self.weight.to(x.dtype))


def shortcut(in_c, out_c, stride):
    """A unit's shortcut: identity, or (avg-pool 2 where stride 2) + float 1 x 1 conv + BN
    where the shape changes."""
    if stride == 1 and in_c == out_c:
        return nn.Identity()
    pool = [nn.AvgPool2d(2)] if stride != 1 else []
    return nn.Sequential(*pool, nn.Conv2d(in_c, out_c, 1, bias=False), nn.BatchNorm2d(out_c))


class Unit(nn.Module):
    """PReLU(BN(binary_conv3x3(x)) + shortcut(x)) in torch's modules (the torch side)."""

    def __init__(self, conv, in_c, out_c, stride):
        super().__init__()
        self.conv = conv(in_c, out_c, 3, stride, 1)
        self.bn = nn.BatchNorm2d(out_c)
        self.shortcut = shortcut(in_c, out_c, stride)
        self.act = PReLU(out_c)

    def forward(self, x):
        return self.act(self.bn(self.conv(x)) + self.shortcut(x))


class FusedUnit(nn.Module):
    """The same unit with BN, the residual add and PReLU as one bie.BatchNormAct (bie's
    side): ``bn(conv(x), res=shortcut(x))``."""

    def __init__(self, conv, in_c, out_c, stride, recompute=False):
        super().__init__()
        self.conv = conv(in_c, out_c, 3, stride, 1)
        # weight, bias (BN's), slope (PReLU's); recompute: the conv output is not kept
        self.bn = bie.BatchNormAct(out_c, recompute=recompute)
        self.shortcut = shortcut(in_c, out_c, stride)

    def forward(self, x):
        return self.bn(self.conv(x), self.shortcut(x))


def resnet18(conv, width_div=1, fused=False, recompute=False):
    """The binary ResNet-18 with ``conv(in_c, out_c, kernel_size, stride, padding)`` as its
    binary convolution; channel widths divided by ``width_div``. ``fused``: batch norm
    (+ residual add) + PReLU of the stem and of every unit as one bie.BatchNormAct
    (``recompute``: the units' BatchNormAct(recompute=True))."""
    widths = [max(1, w // width_div) for w in WIDTHS]
    layers = [nn.Conv2d(3, widths[0], 3, padding=1, bias=False)]
    layers += ([bie.BatchNormAct(widths[0])] if fused
               else [nn.BatchNorm2d(widths[0]), PReLU(widths[0])])
    in_c = widths[0]
    for stage, out_c in enumerate(widths):
        for block in range(2):
            for unit in range(2):  # a basic block: 2 binary units, each with its shortcut
                stride = 2 if stage > 0 and block == 0 and unit == 0 else 1
                layers.append(FusedUnit(conv, in_c, out_c, stride, recompute) if fused
                              else Unit(conv, in_c, out_c, stride))
                in_c = out_c
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_c, CLASSES)]
    return nn.Sequential(*layers)


def build(side, device, dtype, width_div, channels_last, capturable=False, recompute=False):
    """The model of ``side`` on ``device`` and its optimizer factory (called after DDP);
    ``capturable``: optimizers whose step can be captured in a CUDA graph; ``recompute``:
    bie's units compute their conv output again in the backward instead of keeping it."""
    torch.manual_seed(0)
    if side == "bie":
        # bie's CUDA layers compute in the run's dtype; the CPU ones only in float32.
        layer_dtype = dtype if device.type == "cuda" else torch.float32

        def conv(in_c, out_c, k, stride, padding):
            return bie.BinaryConv2dCutlass(in_c, out_c, k, stride=stride, padding=padding,
                                           device=device, dtype=layer_dtype)

        model = resnet18(conv, width_div, fused=True, recompute=recompute).to(device)
        bie.prepare_bie_layers(model)  # before DDP and the optimizer: int8 binary weights
        if channels_last:  # (bie's weights stay as they are; its layers follow the input)
            model = model.to(memory_format=torch.channels_last)
        return model, lambda params: bie.SignFlip(params, float_lr=1e-3, capturable=capturable)
    model = resnet18(TorchBinaryConv2d, width_div).to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model, lambda params: torch.optim.Adam(params, lr=1e-3, capturable=capturable)


# ------------------------------------------------------------------ measuring


def timed(step, steps, device):
    """(seconds of each of ``steps`` calls of ``step``, seconds the host spent in each call):
    on CUDA the first from CUDA events recorded between the calls (no synchronisation until
    the last, so the host runs ahead as in training; a step whose host time is about its
    time is host-limited), on the CPU both from perf_counter."""
    host = []
    if device.type == "cuda":
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        marks[0].record()
        for mark in marks[1:]:
            t0 = time.perf_counter()
            step()
            host.append(time.perf_counter() - t0)
            mark.record()
        marks[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])], host
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)
    return list(host), host


def outside_bytes(device):
    """Device memory in use that torch's caching allocator does not hold (0 on the CPU)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def release(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def captured(step, device):
    """``step`` captured in a CUDA graph (after three more calls on a side stream, as torch's
    graph capture wants): the graph's replay, which runs the same kernels with no host work."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(side, mode, batch, args, device, dist):
    """Time ``args.steps`` training steps or inference forwards of a fresh model; returns
    (seconds per step, median step seconds, peak_allocated_bytes, outside_bytes, median host
    seconds per step) of this process."""
    dtype = DTYPES[args.dtype]
    release(device)
    base_outside = outside_bytes(device)
    model, make_opt = build(side, device, dtype, args.width_div,
                            args.channels_last, args.cuda_graph, args.recompute)
    gen = torch.Generator().manual_seed(1 + (dist.get_rank() if dist else 0))
    x = torch.randn(batch, 3, 32, 32, generator=gen).to(device)
    y = torch.randint(0, CLASSES, (batch,), generator=gen).to(device)
    if args.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    # (a CUDA graph needs autocast's weight cache off: a captured cast is replayed anyway)
    autocast = (torch.autocast(device.type, dtype=dtype, cache_enabled=not args.cuda_graph)
                if dtype != torch.float32 else contextlib.nullcontext())
    if mode == "train":
        if dist is not None:
            cuda = device.type == "cuda"
            model = nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if cuda else None)
        opt = make_opt(model.parameters())
        model.train()

        def step():
            opt.zero_grad(set_to_none=True)
            with autocast:
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
    else:
        model.eval()

        def step():
            with torch.no_grad(), autocast:
                model(x)
    for _ in range(args.warmup):
        step()
    if args.cuda_graph:
        step = captured(step, device)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if dist is not None:
        dist.barrier()
    times, host = timed(step, args.steps, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    outside = max(0, outside_bytes(device) - base_outside)
    return (sum(times) / len(times), statistics.median(times), peak, outside,
            statistics.median(host))


def prime(args, device, dist, sides, modes):
    """One untimed step of every (side, mode) before the measurements, so that what the first
    use of a device creates outside torch's allocator (the CUDA libraries' handles, kernels
    loaded lazily, NCCL's communicator) is in every model's baseline, not in the first
    model's outside_bytes."""
    if dist is not None:
        dist.barrier()  # NCCL: creates the communicator DDP uses
    primed = argparse.Namespace(**vars(args))
    primed.steps, primed.warmup = 1, 0
    for side in sides:
        for mode in modes:
            measure(side, mode, min(args.batch), primed, device, dist)


def gather(dist, values):
    """The list of ``values`` (a list of floats) of every rank, on every rank."""
    if dist is None:
        return [values]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, values)
    return out


# ------------------------------------------------------------------ main


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 1024],
                        help="batch sizes, per process under torchrun (default 256 1024)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps (default 5)")
    parser.add_argument("--device", default=None,
                        help="cuda (default where available) or cpu")
    parser.add_argument("--mode", choices=("train", "infer", "both"), default="both")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--side", choices=("bie", "torch", "both"), default="both")
    parser.add_argument("--width-div", type=int, default=1,
                        help="divide the channel widths 64..512 by this (quick tests)")
    parser.add_argument("--channels-last", action="store_true",
                        help="both sides' activations in channels_last (NHWC) memory")
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU threads for torch and bie (0: their defaults)")
    parser.add_argument("--baseline", default=None,
                        help="JSON lines of an earlier run (1 process): print the scaling")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="capture each side's whole step (forward, backward, optimizer) "
                             "in a CUDA graph and time its replays (one process, CUDA)")
    parser.add_argument("--recompute", action="store_true",
                        help="bie's units: BatchNormAct(recompute=True) (the binary conv's "
                             "output computed again in the backward instead of kept)")
    parser.add_argument("--json", action="store_true", help="JSON lines only")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.width_div < 1 or min(args.batch) < 1:
        parser.error("--steps, --width-div and --batch must be >= 1, --warmup >= 0")
    return args


def setup(args):
    """(device, torch.distributed or None): the process group under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    want = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = torch.device(want).type == "cuda"
    if cuda and not bie.cuda_built():
        raise SystemExit("train_resnet: this libbie has no CUDA backend "
                         f"({bie.library_path()}); use --device cpu or a CUDA build")
    if args.cuda_graph and (not cuda or world > 1):
        raise SystemExit("train_resnet: --cuda-graph needs CUDA and one process")
    if cuda:
        index = int(os.environ.get("LOCAL_RANK", "0")) if world > 1 else torch.device(want).index
        device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    else:
        device = torch.device("cpu")
    dist = None
    if world > 1:
        dist = torch.distributed
        dist.init_process_group("nccl" if cuda else "gloo")
    if args.threads:
        torch.set_num_threads(args.threads)
        bie.set_num_threads(args.threads)
    return device, dist


def describe(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def emit(record, as_json, out):
    if as_json:
        print(json.dumps(record), file=out, flush=True)
        return
    if "images_per_s_ratio" in record:
        text = (f"ratio bie/torch  {record['mode']:5s} batch {record['batch']:5d}: images/s "
                f"{record['images_per_s_ratio']:.3f}")
        if record.get("peak_bytes_ratio") is not None:
            text += f", peak memory {record['peak_bytes_ratio']:.3f}"
    elif "scaling" in record:
        text = (f"scaling {record['side']:5s} {record['mode']:5s} batch {record['batch']:5d}: "
                f"{record['baseline_world_size']} -> {record['world_size']} processes "
                f"{record['scaling']:.3f}x")
    else:
        text = (f"{record['side']:5s} {record['mode']:5s} batch {record['batch']:5d} "
                f"x{record['world_size']}: {record['images_per_s_total']:10.1f} images/s "
                f"({record['ms_per_step']:.2f} ms/step)")
        if record["peak_bytes"] is not None:
            text += (f", peak {record['peak_bytes'] / 2 ** 20:.1f} MiB "
                     f"({record['outside_bytes'] / 2 ** 20:.1f} outside torch)")
    print(text, file=out, flush=True)


def load_baseline(path):
    """(side, mode, batch) -> the record of a 1-process run's JSON lines."""
    found = {}
    for line in pathlib.Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "images_per_s_total" in record:
            found[(record["side"], record["mode"], record["batch"])] = record
    return found


def main(argv=None, out=None):
    """Run the benchmark; returns the records rank 0 printed (an empty list elsewhere)."""
    args = parse(argv)
    out = out or sys.stdout
    device, dist = setup(args)
    rank = dist.get_rank() if dist else 0
    world = dist.get_world_size() if dist else 1
    sides = ("bie", "torch") if args.side == "both" else (args.side,)
    modes = ("train", "infer") if args.mode == "both" else (args.mode,)
    baseline = load_baseline(args.baseline) if args.baseline else {}
    records, results = [], {}
    cuda = device.type == "cuda"
    if cuda:
        prime(args, device, dist, sides, modes)
    for batch in args.batch:
        for mode in modes:
            for side in sides:
                mean_s, median_s, peak, outside, host_s = measure(side, mode, batch, args,
                                                                  device, dist)
                ranks = gather(dist, [batch / mean_s, peak, outside, host_s])
                record = {
                    "bench": "train_resnet", "side": side, "mode": mode, "batch": batch,
                    "global_batch": batch * world, "world_size": world, "device": str(device),
                    "device_name": describe(device), "dtype": args.dtype,
                    "width_div": args.width_div, "cuda_graph": args.cuda_graph,
                    "channels_last": args.channels_last, "recompute": args.recompute,
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "torch": torch.__version__, "ms_per_step": mean_s * 1e3,
                    "median_ms_per_step": median_s * 1e3, "images_per_s": batch / mean_s,
                    "median_host_ms_per_step_ranks": [r[3] * 1e3 for r in ranks],
                    "images_per_s_total": sum(r[0] for r in ranks),
                    "images_per_s_ranks": [r[0] for r in ranks],
                    "peak_allocated_bytes": max(r[1] for r in ranks) if cuda else None,
                    "outside_bytes": max(r[2] for r in ranks) if cuda else None,
                    "peak_bytes": max(r[1] + r[2] for r in ranks) if cuda else None}
                results[(side, mode, batch)] = record
                lines = [record]
                before = baseline.get((side, mode, batch))
                if before is not None and before["world_size"] != world:
                    lines.append({"bench": "train_resnet", "side": side, "mode": mode,
                                  "batch": batch, "world_size": world,
                                  "baseline_world_size": before["world_size"],
                                  "scaling": record["images_per_s_total"]
                                  / before["images_per_s_total"]})
                if rank == 0:
                    for line in lines:
                        emit(line, args.json, out)
                    records.extend(lines)
            if len(sides) == 2:
                b, t = results[("bie", mode, batch)], results[("torch", mode, batch)]
                ratio = {"bench": "train_resnet", "mode": mode, "batch": batch,
                         "world_size": world, "dtype": args.dtype,
                         "images_per_s_ratio": b["images_per_s_total"]
                         / t["images_per_s_total"],
                         "peak_bytes_ratio": b["peak_bytes"] / t["peak_bytes"] if cuda
                         else None, "targets": TARGETS[mode]}
                if rank == 0:
                    emit(ratio, args.json, out)
                    records.append(ratio)
    if dist is not None:
        dist.barrier()
        dist.destroy_process_group()
    return records


if __name__ == "__main__":
    main()
