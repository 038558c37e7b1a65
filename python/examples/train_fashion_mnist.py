#!/usr/bin/env python3
"""Train the binary Fashion-MNIST CNN in PyTorch with bie's layers.

The network is the `bie train` tool's "cnn" preset, written as a torch.nn.Sequential: a 4-bit
first convolution (it sees raw pixels), binary convolutions and a binary dense layer in the
middle (each binarises its own input: sign(x + bias_a), so no activation function is needed
in front of it), batch norm before each binary layer, and a float classifier. Binary weights
are trained by sign flips, everything else by Adam (bie.SignFlip).

    /usr/bin/python3 python/examples/train_fashion_mnist.py --epochs 1
    /usr/bin/python3 python/examples/train_fashion_mnist.py --limit 6000   # a quick run

On a GPU, bie's layers compute in bfloat16 under ``torch.autocast`` (``--bf16``), optionally on
channels-last activations, and ``--backward fp8`` takes the opt-in FP8 backward products of
the binary layers (compare its test accuracy with ``--backward exact``, same seed):

    BIE_LIBRARY=build-gpu/libbie.so python3 python/examples/train_fashion_mnist.py \
        --device cuda --bf16 --channels-last --epochs 3 --backward fp8

Data: Debian's dataset-fashion-mnist (IDX files in /usr/share/datasets/fashion-mnist).
"""

import argparse
import contextlib
import gzip
import math
import pathlib
import struct
import sys
import time

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # in-place use
import bie  # noqa: E402

DATA = pathlib.Path("/usr/share/datasets/fashion-mnist")


def read_idx(path):
    """An IDX file (gzip-compressed) as a uint8 tensor of its declared shape."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    zero, dtype, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype != 0x08:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes")
    shape = struct.unpack(">" + "I" * ndim, raw[4:4 + 4 * ndim])
    return torch.frombuffer(bytearray(raw[4 + 4 * ndim:]), dtype=torch.uint8).view(shape)


def load(split, limit, data=DATA):
    prefix = "train" if split == "train" else "t10k"
    images = read_idx(data / f"{prefix}-images-idx3-ubyte.gz")[:limit]
    labels = read_idx(data / f"{prefix}-labels-idx1-ubyte.gz")[:limit]
    x = images.float().div_(255).sub_(0.2860).div_(0.3530).unsqueeze(1)  # the set's mean/std
    return x, labels.long()


class ChannelsLast(nn.Module):
    """Its input in channels_last (NHWC) memory: bie's 4-bit conv returns NCHW, and the binary
    convs' channels-last backward (where the FP8 grad_x applies) needs NHWC inputs."""

    def forward(self, x):
        return x.contiguous(memory_format=torch.channels_last)


def binary_cnn(width=32, dense=256, device=None, dtype=torch.float32, channels_last=False):
    """The network; ``device`` and ``dtype`` are those of bie's layers (the float layers are
    float32 on ``device``); ``channels_last``: NHWC activations after the 4-bit conv."""
    c, on = width, {"device": device, "dtype": dtype}
    nhwc = [ChannelsLast()] if channels_last else []
    return nn.Sequential(
        bie.Q4Conv2dCutlass(1, c, 3, padding=1, **on), *nhwc, nn.BatchNorm2d(c),
        bie.BinaryConv2dCutlass(c, c, 3, padding=1, **on), nn.MaxPool2d(2), nn.BatchNorm2d(c),
        bie.BinaryConv2dCutlass(c, 2 * c, 3, padding=1, **on), nn.MaxPool2d(2),
        nn.BatchNorm2d(2 * c),
        bie.BinaryConv2dCutlass(2 * c, 2 * c, 3, padding=1, **on), nn.BatchNorm2d(2 * c),
        nn.Flatten(),
        bie.BinaryLinearCutlass(2 * c * 7 * 7, dense, **on), nn.BatchNorm1d(dense),
        nn.PReLU(dense), nn.Linear(dense, 10)).to(device)


def evaluate(model, x, y, batch_size, autocast=contextlib.nullcontext()):
    model.eval()
    correct = 0
    with torch.no_grad(), autocast:
        for i in range(0, len(x), batch_size):
            correct += int((model(x[i:i + batch_size]).argmax(1) == y[i:i + batch_size]).sum())
    model.train()
    return correct / len(x)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--limit", type=int, default=60000, help="training images used")
    parser.add_argument("--width", type=int, default=32, help="channels of the first convs")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's rate (float params)")
    parser.add_argument("--binary-lr", type=float, default=1e-4,
                        help="the sign-flip rate of the binary weights (SignFlip's lr; "
                             "bie train uses 0.1)")
    parser.add_argument("--threads", type=int, default=0, help="bie and torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", type=pathlib.Path, default=DATA, help="folder of the IDX files")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--bf16", action="store_true",
                        help="bie's layers in bfloat16 under torch.autocast (CUDA only)")
    parser.add_argument("--channels-last", action="store_true",
                        help="activations in channels_last (NHWC) memory")
    parser.add_argument("--backward", choices=("exact", "fp8"), default="exact",
                        help="the binary layers' backward products (fp8: opt-in, CUDA only; "
                             "layers or devices it does not apply to run the exact products)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.bf16 and device.type != "cuda":
        parser.error("--bf16 needs --device cuda (bie's CPU layers compute in float32)")
    if args.backward != "exact" and device.type != "cuda":
        parser.error(f"--backward {args.backward} needs --device cuda (the CPU layers have the "
                     "exact backward only)")
    if args.threads:
        bie.set_num_threads(args.threads)
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    x_train, y_train = load("train", args.limit, args.data)
    x_test, y_test = load("test", 10000, args.data)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    x_train, x_test = (t.to(device).contiguous(memory_format=fmt) for t in (x_train, x_test))
    y_train, y_test = y_train.to(device), y_test.to(device)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    autocast = (torch.autocast(device.type, dtype=dtype) if args.bf16
                else contextlib.nullcontext())
    model = binary_cnn(args.width, device=device, dtype=dtype,
                       channels_last=args.channels_last).to(memory_format=fmt)
    for module in model.modules():  # bie's own generator, seeded from torch's
        if hasattr(module, "prepare_params"):
            module.reset_parameters()
    bie.prepare_bie_layers(model)  # binary weights become int8, before the optimizer
    for module in model.modules():  # (the 4-bit layer has the exact backward only)
        if args.backward != "exact" and isinstance(module, (bie.BinaryConv2dCutlass,
                                                            bie.BinaryLinearCutlass)):
            module.backward_mode = args.backward
    # scale_a kept at or above half its first value, as bie train does (Adam would drive an
    # activation scale through zero within a few epochs, and the accuracy collapse)
    optimizer = bie.SignFlip(model.parameters(), lr=args.binary_lr, float_lr=args.lr,
                             scale_a_floor=0.5)
    steps = args.epochs * ((len(x_train) + args.batch_size - 1) // args.batch_size)
    print(f"libbie {bie.version()} ({bie.library_path()}), CPU kernels {bie.cpu_kernel_set()}, "
          f"{len(x_train)} training images, {steps} steps, {device.type}"
          f"{', bfloat16' if args.bf16 else ''}{', channels-last' if args.channels_last else ''}"
          f", {args.backward} backward")
    step = 0
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_train), device=device)
        # the loss and flip totals stay on the device (no wait for it each step)
        start = time.perf_counter()
        total = torch.zeros((), device=device)
        flips = torch.zeros((), dtype=torch.int64, device=device)
        for i in range(0, len(x_train), args.batch_size):
            idx = order[i:i + args.batch_size]
            if len(idx) < 2:  # batch norm needs two samples
                continue
            # cosine decay of both rates, as bie train's schedule (a constant sign-flip rate
            # of 0.1 keeps flipping a tenth of the weights an epoch and the accuracy collapses)
            factor = 0.5 * (1 + math.cos(math.pi * step / steps))
            for group in optimizer.param_groups:
                group["float_lr"] = args.lr * factor
                group["lr"] = args.binary_lr * factor
            optimizer.zero_grad()
            with autocast:
                loss = nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            optimizer.step()
            total += loss.detach() * len(idx)
            for count in optimizer.flip_counts:
                flips += count.to(device)
            step += 1
        total, flips = float(total), int(flips)
        seconds = time.perf_counter() - start
        accuracy = evaluate(model, x_test, y_test, 500, autocast)
        print(f"epoch {epoch + 1}: loss {total / len(x_train):.4f}, test accuracy "
              f"{100 * accuracy:.2f}%, {flips} sign flips, {seconds:.1f} s "
              f"({len(x_train) / seconds:.0f} images/s)")


if __name__ == "__main__":
    main()
