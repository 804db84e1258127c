#!/usr/bin/env python3
"""The longest single GPU dispatch of a FLUX.2 [dev] training step on an AMD card, against
Windows' GPU timeout: a dispatch that runs past TdrDelay (2 s by default) resets the GPU (TDR).

No AMD card has run the project yet, so this scales the H200's figures the way predict_step.py
scales compute: by the H200's block-Linear rate (`predict_step.h200_gemm_tflops`) against the card's
bf16 GEMM rate at the slow end of its range (`predict_step.rates`), the slowest case:
- the largest GEMM: the slowest single bf16 Linear call of the H200 self-test (forward or input
  gradient of single.linear1, one BLAS dispatch; int4_fused cuts it into 64 MiB weight slices, so
  this bounds every 4-bit path), archive/selftest_h200_2026-11-30.json;
- the attention backward of one block: the profile's attention per step (results/step_profile.csv,
  the bf16 row predict_step.py reads, full width) per block, split 1 : 1 : 2.5 between the forward,
  its recompute and the backward (a flash backward does 2.5x the forward's FLOPs);
- with only the math backend (`sdpa_kernels: math`): its softmax, one read and one write of one
  block's fp32 attention matrix (48 heads x tokens^2 x 4 B) at the card's bandwidth.

    python -m bench.longest_kernel      # the table of docs/amd.md, "Runtime traps on Windows"
"""

import json

from bench.predict_step import HERE, h200_breakdown, h200_gemm_tflops, rates
from flux2_contract import memory_plan
from launcher.card_specs import SPECS

TDR_DELAY_S = 2.0
"""Windows' default TdrDelay (HKLM\\System\\CurrentControlSet\\Control\\GraphicsDrivers)."""
SELFTEST = HERE / "archive" / "selftest_h200_2026-11-30.json"
BACKWARD_SHARE = 2.5 / (1 + 1 + 2.5)
"""The attention backward's part of one block's attention time: forward, recompute, backward."""
SIZES = (512, 1024)
SHOWN = ("RX 7900 XTX", "RX 7800 XT")


def h200_largest_gemm_ms(px: int, path=SELFTEST) -> float:
    """The slowest single bf16 Linear call (forward or input gradient) of the H200 self-test at `px`."""
    timing = json.loads(path.read_text(encoding="utf-8"))["timing"]
    shape = next(s for s in timing if s["image_tokens"] == (px // 16) ** 2)
    bf16 = next(r for r in shape["results"] if r["candidate"] == "bf16")
    return max(max(row["fwd_ms"], row["bwd_ms"]) for row in bf16["linears"])


def longest_s(card: str, px: int, h200_gemm_ms: float, h200_attention_s: float) -> dict:
    """Seconds of the longest dispatch of each kind on `card` at `px`, from the H200's figures."""
    slower = h200_gemm_tflops() / rates(card)[0]
    shape = memory_plan.Flux2Shape()
    matrix = shape.heads * memory_plan.tokens(px) ** 2 * memory_plan.FP32
    blocks = shape.depth + shape.depth_single
    return {"gemm": h200_gemm_ms / 1000 * slower,
            "attention backward": h200_attention_s / blocks * BACKWARD_SHARE * slower,
            "math softmax": 2 * matrix / (SPECS[card].bandwidth_gbs * 1e9)}


def rows() -> list[dict]:
    """One row per shown card and size: each kind's seconds and the longest against TDR_DELAY_S."""
    found = []
    for card in SHOWN:
        for px in SIZES:
            kinds = longest_s(card, px, h200_largest_gemm_ms(px), h200_breakdown("flux2", px)["attention"])
            found.append({"card": card, "px": px, **kinds, "margin": TDR_DELAY_S / max(kinds.values())})
    return found


def markdown_table() -> str:
    lines = ["| card | px | largest GEMM | attention backward (one block) | math softmax (one block) | 2 s / longest |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in rows():
        lines.append(f"| {row['card']} | {row['px']} | {row['gemm'] * 1000:.0f} ms | "
                     f"{row['attention backward'] * 1000:.0f} ms | {row['math softmax'] * 1000:.0f} ms | "
                     f"{row['margin']:.0f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
