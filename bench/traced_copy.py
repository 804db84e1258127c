"""A compiled block's FP8 matmuls against its held 8-bit copies: traced into the block's graph
(toolkit/int4_w4a8.traced_copy_matmul) against the 4-bit operator with the same copies, one GPU.

Four FLUX.2 single blocks of `--hidden` width (norm, modulation, linear1, the attention part left as
the q slice, a SiLU-gated MLP of `--mlp`, linear2, the residual), random 4-bit weights with both 8-bit
copies of every Linear held, FP8 through torch._scaled_mm. One step: forward and backward of
`--tokens` tokens; milliseconds per step over 20 steps after 3, for the block compiled with the
traced matmul, compiled through the operator (the same code, `traceable_copy` answering no), and
uncompiled. Relative differences of the output and the input gradient against the operator's.
One JSON line on stdout.

  python3 -m bench.traced_copy [--tokens 1536] [--hidden 6144] [--mlp 18432]      # GPU, repository root
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def blocks_of(hidden: int, mlp: int, count: int, il, kernel) -> torch.nn.ModuleList:
    def linear(inputs: int, outputs: int):
        module = il.Int4Linear.from_linear(torch.nn.Linear(inputs, outputs, bias=False, device="cuda",
                                                           dtype=torch.bfloat16))
        module.kernel = kernel
        return module

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(hidden, elementwise_affine=False, device="cuda", dtype=torch.bfloat16)
            self.linear1, self.linear2 = linear(hidden, 3 * hidden + 2 * mlp), linear(hidden + mlp, hidden)

        def forward(self, x, shift, scale):
            h = self.linear1(self.norm(x) * (1 + scale) + shift)
            qkv, gated = h.split([3 * hidden, 2 * mlp], -1)
            a, gate = gated.chunk(2, -1)
            return x + self.linear2(torch.cat([qkv[..., :hidden], torch.nn.functional.silu(a) * gate], -1))

    return torch.nn.ModuleList([Block() for _ in range(count)])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1536)
    parser.add_argument("--hidden", type=int, default=6144)
    parser.add_argument("--mlp", type=int, default=18432)
    args = parser.parse_args(argv)
    sys.path[:0] = [str(REPO / "overlay"), str(REPO)]
    from toolkit import int4_linear as il, int4_w4a8
    from flux2_contract.qtypes import FP8, Int4Kernel

    torch.manual_seed(0)
    blocks = blocks_of(args.hidden, args.mlp, 4, il, Int4Kernel(FP8, "scaled_mm", 256 * 2**20, True))
    held = sum(m.hold_copy(t) for t in (False, True) for b in blocks for m in (b.linear1, b.linear2))
    x0 = torch.randn(1, args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
    shift, scale = (torch.randn(args.hidden, device="cuda", dtype=torch.bfloat16) * 0.1 for _ in range(2))

    def step(forward):
        x = x0.clone().requires_grad_(True)
        y = x
        for block in blocks:
            y = forward(block, y, shift, scale)
        y.float().square().mean().backward()
        return y.detach(), x.grad

    def ms_per_step(forward) -> float:
        for _ in range(3):
            step(forward)
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(20):
            step(forward)
        torch.cuda.synchronize()
        return round((time.perf_counter() - began) / 20 * 1e3, 2)

    row = {"device": torch.cuda.get_device_name(), "tokens": args.tokens, "hidden": args.hidden,
           "copies_gib": round(held / 2**30, 2)}
    traceable, results = int4_w4a8.traceable_copy, {}
    compiled = torch.compile(type(blocks[0]).forward)
    for route in ("traced", "operator"):
        torch._dynamo.reset()
        int4_w4a8.traceable_copy = traceable if route == "traced" else (lambda *_: False)
        results[route] = step(compiled)
        row[f"{route}_ms"] = ms_per_step(compiled)
    int4_w4a8.traceable_copy = traceable
    uncompiled = type(blocks[0]).__call__
    results["eager"] = step(uncompiled)
    row["eager_ms"] = ms_per_step(uncompiled)

    def relative(a, b) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    for route in ("traced", "eager"):
        row[f"{route}_vs_operator"] = [relative(results[route][i], results["operator"][i]) for i in (0, 1)]
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
