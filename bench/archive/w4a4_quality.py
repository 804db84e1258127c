#!/usr/bin/env python3
"""Would int4 x int4 (W4A4) matmuls pass the self-test's quality gate? (CPU, plain PyTorch)

On an RX 7900 XTX int8 WMMA runs at the bf16 rate and only int4 x int4 doubles it, so W4A4 is the
one path that could make the 4-bit step there faster than bf16. Its weight side costs nothing in
the forward: the stored 4-bit codes (group 64, zero point) enter an int4 GEMM as they are, the zero
point folded in per group. Its cost is the 4-bit activations, and, for the input gradient (which
reduces over the output features, across the weight's groups), the weight requantized to
symmetric int4 per input column and group of 64 output rows.

For each FLUX.2 block Linear shape (full width, --tokens tokens), an N(0, 0.02) weight quantized
by the trainer's Int4Linear and activations / output gradients N(0, 1), then with 4 input channels
scaled 100x (the outliers transformer activations have), this measures the relative Frobenius
error of y = x @ W^T and dx = dy @ W against the bf16-activation path on the same 4-bit weight
(what the gate measures, `launcher/in_trainer/selftest/kernels.py` QUALITY_TOLERANCE), for:

  fp8_token          FP8 e4m3 per token (what int4_w4a8 runs on NVIDIA; the gate's yardstick)
  int4_token         symmetric int4 per token
  int4_group64       symmetric int4 per token and group of 64 channels
  int4_group64_out1  the same, with the 1 % of channels of largest mean |x| kept in int8 per token
                     (chosen on the same batch: an optimistic, calibration-free bound)

    python -m bench.archive.w4a4_quality --trainer overlay --out w4a4_quality.json
"""

import argparse
import json
import sys
import time
from pathlib import Path

INT4_MAX, INT8_MAX = 7.0, 127.0
GROUP = 64
OUTLIER_SHARE = 0.01


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trainer", required=True, type=Path, help="a folder holding toolkit/ (a trainer checkout, or overlay)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--tokens", type=int, default=256, help="tokens per case (the error hardly depends on it)")
    args = p.parse_args()
    sys.path.insert(0, str(args.trainer.resolve()))
    import torch
    from toolkit import int4_linear
    from toolkit import int4_w4a8 as w

    from launcher.in_trainer.selftest.kernels import BLOCK_LINEARS, QUALITY_TOLERANCE

    def symmetric(x, qmax, groups: int = 1):
        """x quantized per row (and per group of columns) to a symmetric grid, returned dequantized."""
        rows, cols = x.shape
        xg = x.reshape(rows, groups, cols // groups)
        scale = xg.abs().amax(dim=2, keepdim=True).clamp_min(1e-30) / qmax
        return (torch.round(xg / scale).clamp(-qmax, qmax) * scale).reshape(rows, cols)

    def fp8_token(x):
        codes, scale = w.quantize_rows_reference(x, "fp8")
        return codes * scale[:, None]

    def int4_group64_with_outliers(x):
        k = max(1, round(x.shape[1] * OUTLIER_SHARE))
        outliers = x.abs().mean(dim=0).topk(k).indices
        rest = x.clone()
        rest[:, outliers] = 0
        out = symmetric(rest, INT4_MAX, x.shape[1] // GROUP)
        out[:, outliers] = symmetric(x[:, outliers].contiguous(), INT8_MAX)
        return out

    schemes = {
        "fp8_token": fp8_token,
        "int4_token": lambda x: symmetric(x, INT4_MAX),
        "int4_group64": lambda x: symmetric(x, INT4_MAX, x.shape[1] // GROUP),
        "int4_group64_out1": int4_group64_with_outliers,
    }
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    result = {"torch": torch.__version__, "tokens": args.tokens, "gate": QUALITY_TOLERANCE["fp8"],
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "cases": []}
    for name, in_f, out_f, _ in BLOCK_LINEARS:
        g = torch.Generator().manual_seed(in_f + out_f)
        layer = torch.nn.Linear(in_f, out_f, bias=False)
        torch.nn.init.normal_(layer.weight, std=0.02, generator=g)
        weight = int4_linear.Int4Linear.from_linear(layer).dequantize(torch.float32)  # the stored 4-bit weight
        # int4_w4a8 requantizes the weight to FP8 per output row (forward) and per input column
        # (input gradient); W4A4 uses the 4-bit codes as they are in the forward, and symmetric int4
        # per input column and group of 64 output rows in the input gradient
        row_scale = weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / w.QMAX["fp8"]
        column_scale = weight.abs().amax(dim=0, keepdim=True).clamp_min(1e-30) / w.QMAX["fp8"]
        y_weight = {"fp8": w.to_grid(weight / row_scale, "fp8") * row_scale, "int4": weight}
        dx_weight = {"fp8": (w.to_grid(weight / column_scale, "fp8") * column_scale).t(),
                     "int4": symmetric(weight.t().contiguous(), INT4_MAX, out_f // GROUP)}
        for outliers in (False, True):
            x = torch.randn(args.tokens, in_f, generator=g)
            if outliers:
                x[:, :4] *= 100
            dy = torch.randn(args.tokens, out_f, generator=g)
            y16, dx16 = x @ weight.t(), dy @ weight
            case = {"linear": name, "in": in_f, "out": out_f, "outliers": outliers}
            for scheme, quantize in schemes.items():
                kind = scheme.split("_")[0]
                case[scheme] = {"y": rel(quantize(x) @ y_weight[kind].t(), y16),
                                "dx": rel(quantize(dy) @ dx_weight[kind].t(), dx16)}
            result["cases"].append(case)
            print(json.dumps(case), flush=True)
    for scheme in schemes:
        worst = max(max(c[scheme]["y"], c[scheme]["dx"]) for c in result["cases"])
        result[f"worst_{scheme}"] = worst
        result[f"passes_{scheme}"] = worst <= result["gate"]
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k.startswith(("worst", "passes"))}, indent=1))


if __name__ == "__main__":
    main()
