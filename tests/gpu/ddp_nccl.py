#!/usr/bin/env python3
"""Data-parallel training of every bie layer kind with NCCL, one GPU per rank: the check of
python/tests/test_distributed.py (which uses gloo on the CPU) on CUDA layers. Run it under
torchrun on a machine with 2 or more GPUs and a libbie built with the CUDA backend:

    BIE_LIBRARY=build-gpu/libbie.so torchrun --standalone --nproc_per_node=2 tests/gpu/ddp_nccl.py

Each rank trains the model of python/tests/ddp_check.py under DistributedDataParallel on
cuda:LOCAL_RANK with its own data (SignFlip for the int8 binary weights, Adam for the rest),
then the same without bie's data-parallel support. Rank 0 gathers every rank's parameters,
buffers, optimizer states and first-step gradients and checks that they are bit-identical
across ranks (and that they are not without the support). Exit status 0: passed; 1: failed;
77: skipped (fewer than 2 GPUs, no NCCL, or a libbie without CUDA layers). With ``--cpu`` it
runs the same on the CPU with gloo (to try the script where there is no GPU).
"""

import os
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python" / "tests"))  # ddp_check (it puts python/ on the path)

import ddp_check  # noqa: E402
import bie  # noqa: E402

SKIP = 77


def main():
    if "RANK" not in os.environ or "LOCAL_RANK" not in os.environ:
        print("ddp_nccl: run under torchrun, e.g. torchrun --standalone --nproc_per_node=2 "
              f"{sys.argv[0]}", file=sys.stderr)
        return 2
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if "--cpu" in sys.argv[1:]:
        torch.distributed.init_process_group("gloo")
        try:
            return _run(rank, world, torch.device("cpu"), "CPU, gloo")
        finally:
            torch.distributed.destroy_process_group()
    gpus_needed = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # the same on a node's ranks
    if (world < 2 or torch.cuda.device_count() < gpus_needed
            or torch.cuda.device_count() <= local or not torch.distributed.is_nccl_available()):
        print(f"ddp_nccl: skipped (world size {world}, {torch.cuda.device_count()} GPUs here, "
              f"NCCL {'available' if torch.distributed.is_nccl_available() else 'missing'})")
        return SKIP
    if not bie.cuda_built():
        print(f"ddp_nccl: skipped: {bie.library_path()} has no CUDA backend")
        return SKIP
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    # The checks compare the reduced gradients with the mean of the ranks' own ones at float32
    # precision: torch's float layers in full float32 (no TF32) with deterministic algorithms.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.distributed.init_process_group("nccl")
    try:
        return _run(rank, world, device, torch.cuda.get_device_name(device) + ", NCCL")
    finally:
        torch.distributed.destroy_process_group()


def _run(rank, world, device, what):
    """This rank's training; rank 0 gathers every rank's results and checks them."""
    results = ddp_check.run(rank, device)
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, results)
    if rank != 0:
        return 0
    problems = ddp_check.check(gathered)
    names = [n for n in gathered[0]["fixed"] if not n.startswith("local_")]
    print(f"ddp_nccl: {world} ranks ({what}), {ddp_check.STEPS} steps, {len(names)} tensors "
          f"compared, {gathered[0]['facts']['flipped']} sign flips on rank 0")
    for p in problems:
        print("FAIL:", p)
    print("ddp_nccl:", "FAILED" if problems else "passed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
