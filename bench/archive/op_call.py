#!/usr/bin/env python3
"""What the 4-bit matmul operator costs per call, and whether a 4-bit block compiles whole.

Under torch.compile, toolkit/int4_linear.py runs every 4-bit matmul through a PyTorch operator of
its own, so that the compiler keeps it as one node of a block's graph; uncompiled, the same kernels
run through a plain autograd.Function. This times one forward + input gradient of a small layer
both ways (the host time per call: a full-size step makes ~1,300 such calls, 56 blocks, forward,
recompute and input gradient), then compiles a small block (norm, 4-bit Linear, GELU, 4-bit
Linear, residual) with Inductor and checks it has no graph break and matches the uncompiled block.

    python -m bench.archive.op_call --trainer <workdir>/trainer --out op_call.json   (or --trainer overlay)
"""

import argparse
import json
import sys
import time
from pathlib import Path


def per_call_us(fn, calls: int, sync) -> float:
    for _ in range(20):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trainer", required=True, type=Path, help="a folder holding toolkit/ (a trainer checkout, or overlay)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--qtype", default="int4_w4a8")
    p.add_argument("--gemm", help="the qtype's GEMM path (default: the table's)")
    args = p.parse_args()
    sys.path.insert(0, str(args.trainer.resolve()))
    import torch

    from toolkit import int4_linear

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "qtype": args.qtype,
              "gemm": args.gemm}
    choice = {"w4a8_gemm": args.gemm} if args.gemm and args.qtype == "int4_w4a8" else {}

    # 1. overhead: a small matmul, so the call, not the GEMM, is what is timed
    lin = int4_linear.Int4Linear.from_linear(torch.nn.Linear(64, 64).to(device, torch.bfloat16))
    int4_linear.configure_linears(lin, args.qtype, choice, device)
    kernel = lin.kernel
    x = torch.randn(16, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    settings = (lin.group_size, kernel.activations, kernel.gemm, kernel.chunk_bytes, cuda)
    weights = (lin.qweight, lin.scale, lin.zero)

    def through(matmul):
        return lambda: matmul(x, *weights, *settings).sum().backward()

    calls = 2000 if cuda else 500
    for name, matmul in (("operator", int4_linear.int4_matmul), ("function", int4_linear.Int4LinearFunction.apply)) * 2:
        result[f"{name}_us_per_fwd_bwd"] = per_call_us(through(matmul), calls, sync)  # the second round counts

    # 2. a small 4-bit block, compiled whole
    width = 1024
    norm = torch.nn.LayerNorm(width, elementwise_affine=False)
    up = int4_linear.Int4Linear.from_linear(torch.nn.Linear(width, 4 * width).to(device, torch.bfloat16))
    down = int4_linear.Int4Linear.from_linear(torch.nn.Linear(4 * width, width).to(device, torch.bfloat16))
    for layer in (up, down):
        int4_linear.configure_linears(layer, args.qtype, choice, device)

    def block(h):
        return h + down(torch.nn.functional.gelu(up(norm(h)), approximate="tanh"))

    h = torch.randn(2048, width, device=device, dtype=torch.bfloat16, requires_grad=True)

    def step(fn):
        h.grad = None
        out = fn(h)
        out.float().square().mean().backward()
        return out.detach(), h.grad.detach()

    want = step(block)
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(block)
    start = time.perf_counter()
    got = step(compiled)
    sync()
    result["compile_s"] = time.perf_counter() - start
    result["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
    result["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    result["max_relative_difference"] = max(float((a.float() - b.float()).norm() / b.float().norm())
                                            for a, b in zip(got, want))
    result["eager_block_us"] = per_call_us(lambda: step(block), 50, sync)
    result["compiled_block_us"] = per_call_us(lambda: step(compiled), 50, sync)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
