#!/usr/bin/env python3
"""Per-call overhead of the PyTorch package against calling the C API directly.

Times the same binary linear layer calls: C (overhead_c.c, compiled here against the same
libbie, its own process), the same C calls made through ctypes from this process on
preallocated buffers (what the layer costs inside a torch process, without the package's
work), the nn.Module (bie.BinaryLinearCutlass), the standalone autograd
Function (bie.BinaryLinearForward, which copies the weight into a fresh C layer per call),
and, for scale, torch's own nn.Linear of the same shape (float32). Small shapes show the
fixed cost per call; large ones show it vanish. One JSON line per case: name, c_s,
ctypes_s, module_s, function_s, torch_linear_s, and overhead_us = module - ctypes (the
package's own cost per call); eval = inference forward, train = forward + backward.

    BIE_LIBRARY=build/libbie.so /usr/bin/python3 python/bench/overhead.py
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import bie  # noqa: E402
from bie import _lib  # noqa: E402

CASES = [("eval", 1, 64, 64), ("eval", 16, 256, 256), ("train", 1, 64, 64),
         ("train", 16, 256, 256), ("eval", 256, 2048, 2048), ("train", 256, 2048, 2048)]


def build_c(lib_path):
    root = HERE.parents[1]
    exe = pathlib.Path(tempfile.mkdtemp()) / "overhead_c"
    subprocess.run(["cc", "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror",
                    "-D_POSIX_C_SOURCE=200809L", str(HERE / "overhead_c.c"),
                    f"-I{root / 'include'}", str(lib_path), f"-Wl,-rpath,{lib_path.parent}",
                    "-o", str(exe)], check=True)
    return exe


def best_per_call(fn, iterations):
    fn()  # warm up (allocations, first-call initialisation)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iterations):
            fn()
        best = min(best, (time.perf_counter() - t0) / iterations)
    return best


def time_python(kind, m, k, n, iterations):
    layer = bie.BinaryLinearCutlass(k, n)
    layer.prepare_params()
    x = torch.randn(m, k)
    g = torch.randn(m, n)
    w, sa, sw, bias = layer.weight.detach(), layer.scale_a, layer.scale_w, layer.bias_a
    layer(x)  # initialises scale_a
    if kind == "eval":
        layer.eval()

        def module_call():
            with torch.no_grad():
                layer(x)

        def function_call():
            with torch.no_grad():
                bie.BinaryLinearForward.apply(x, w, sa, sw, -1, False, bias)
    else:
        xg = x.clone().requires_grad_()

        # Each training call starts from cleared gradients, as a training step's zero_grad
        # leaves them (without, the gradients would accumulate from call to call).
        def module_call():
            layer.zero_grad(set_to_none=True)
            xg.grad = None
            layer(xg).backward(g)

        def function_call():
            layer.zero_grad(set_to_none=True)
            xg.grad = w.grad = None
            bie.BinaryLinearForward.apply(xg, w, sa, sw, -1, True, bias).backward(g)
    raw_out, raw_gx = torch.empty(m, n), torch.empty(m, k)
    descs = [_lib.describe(t) for t in (x, raw_out, g, raw_gx)]
    raw = layer._layer
    forward = _lib.function("bie_layer_forward")
    backward = _lib.function("bie_layer_backward")

    def ctypes_call():
        _lib.check(forward(raw.handle, descs[0], descs[1]))
        if kind == "train":
            _lib.check(backward(raw.handle, descs[2], descs[3]))

    if kind == "train":
        layer.train()
    ctypes_s = best_per_call(ctypes_call, iterations)
    if kind == "eval":
        layer.eval()
    linear = torch.nn.Linear(k, n)
    if kind == "eval":
        def torch_call():
            with torch.no_grad():
                linear(x)
    else:
        def torch_call():
            linear.zero_grad(set_to_none=True)
            xg.grad = None
            linear(xg).backward(g)
    return (ctypes_s, best_per_call(module_call, iterations),
            best_per_call(function_call, iterations), best_per_call(torch_call, iterations))


def main():
    lib_path = pathlib.Path(bie.library_path()).resolve()
    exe = build_c(lib_path)
    threads = int(os.environ.get("BIE_BENCH_THREADS", "1"))
    bie.set_num_threads(threads)
    torch.set_num_threads(threads)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    for kind, m, k, n in CASES:
        iterations = 2000 if k * n <= 65536 else 20
        c_s = float(subprocess.run([str(exe), kind, str(m), str(k), str(n), str(iterations)],
                                   check=True, capture_output=True, text=True, env=env).stdout)
        ctypes_s, module_s, function_s, torch_s = time_python(kind, m, k, n, iterations)
        print(json.dumps({"name": f"binary_linear_{kind}_m{m}_k{k}_n{n}", "threads": threads,
                          "c_s": c_s, "ctypes_s": ctypes_s, "module_s": module_s,
                          "function_s": function_s, "torch_linear_s": torch_s,
                          "overhead_us": round((module_s - ctypes_s) * 1e6, 2)}), flush=True)


if __name__ == "__main__":
    main()
