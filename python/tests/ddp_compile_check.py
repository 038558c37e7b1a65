"""One rank of the torch.compile + DistributedDataParallel check (test_compile.py): trains
ddp_check's model (every bie kind) for a few steps on this rank's own data under DDP (gloo),
eager or compiled in one of the two usual ways, and saves the trained state.

Usage: ddp_compile_check.py RANK WORLD PORT MODE OUT, MODE one of eager, inner
(``DDP(torch.compile(model))``), outer (``torch.compile(DDP(model))``)."""

import pathlib
import sys

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import ddp_check  # noqa: E402  (puts python/ on the path)

import bie  # noqa: E402


def main(rank, world, port, mode, out):
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=world)
    try:
        torch.manual_seed(100 + rank)  # DDP broadcasts rank 0's parameters
        model = ddp_check.make_model()
        bie.prepare_bie_layers(model)
        if mode == "inner":
            net = DDP(torch.compile(model, backend="aot_eager"))
        elif mode == "outer":
            net = torch.compile(DDP(model), backend="aot_eager")
        else:
            net = DDP(model)
        opt = bie.SignFlip(model.parameters(), lr=1e-2, betas=(0.9, 0.99), float_lr=1e-2,
                           seed=7)
        data = torch.Generator().manual_seed(1000 + rank)
        flipped = 0
        for _ in range(5):
            x = torch.randn(ddp_check.BATCH, 3, 8, 8, generator=data) * (1 + rank)
            y = torch.randint(0, 10, (ddp_check.BATCH,), generator=data)
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            flipped += opt.flipped
        state = {k: v.detach().clone() for k, v in model.state_dict().items()
                 if "running" not in k}  # batch norm's statistics are each rank's own
        torch.save({"state": state, "flipped": flipped}, out)
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
