#!/usr/bin/env python3
"""The W4A8 quality gate at full FLUX.2 block shapes: qtype int4_w4a8 against int4_fused, per Linear.

For each of the six distinct block Linear shapes of full-size FLUX.2 at the token counts of
512 px (1024 image + 512 text tokens), with an N(0, 0.02) weight quantized by the trainer's
Int4Linear (torchao-uint4 numerics) and activations / output gradients N(0, 1) (and, as a
second set, with 4 input channels scaled 100x, the outliers transformer activations have):

  * quality: relative Frobenius error of y = x @ W^T and dx = dy @ W with 8-bit activations
    (each format / GEMM the GPU runs) against the bf16-activation path on the same weight,
    next to the 4-bit weight's own error against the bf16 weight;
  * correctness: the W4A8 kernels against the module's plain-PyTorch reference (same codes).

Each path passes when its kernel stays within the self-test's tolerance of its reference
(`kernel_check`). `--time ROUNDS` then times the block Linears of one training step at
`--tokens` with the self-test's own timing (2 forwards, as checkpointing recomputes, + 1 input
gradient per Linear, summed over the 56 blocks) for bf16 weights, int4_fused and every path,
ROUNDS rounds taken in turn so that clock drift is shared, and keeps each one's median.
Loads the trainer's modules from --trainer (a checkout, or the files bench/carry.py copies):

    python -m bench.w4a8_quality --trainer .bench-carry/trainer --out $OUT/w4a8_quality.json --time 5
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--trainer", required=True, type=Path)
p.add_argument("--out", required=True, type=Path)
p.add_argument("--tiny", action="store_true", help="small shapes (a CPU dry run under TRITON_INTERPRET=1)")
p.add_argument("--time", type=int, default=0, metavar="ROUNDS", help="also time one step's block Linears")
p.add_argument("--tokens", default="1024,512;4096,512", help="image,text tokens of the timed steps")
args = p.parse_args()
sys.path.insert(0, str(args.trainer.resolve()))

import torch  # noqa: E402
from toolkit import int4_kernels as ik  # noqa: E402
from toolkit import int4_w4a8 as w  # noqa: E402
from flux2_contract import qtypes  # noqa: E402

from launcher.in_trainer.selftest import kernels  # noqa: E402
from launcher.in_trainer.selftest.kernels import block_linear_cases, candidates  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ACT = torch.bfloat16 if DEV == "cuda" else torch.float16  # the CPU interpreter mishandles bf16
R = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu (dry run)",
     "started": time.strftime("%Y-%m-%d %H:%M:%S"), "cases": []}


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def activations(tokens, width, g, outliers):
    x = torch.randn(tokens, width, device=DEV, generator=g)
    if outliers:
        x[:, :4] *= 100
    return x.to(ACT)


def one_case(name, in_f, out_f, tokens, outliers, paths):
    g = torch.Generator(device=DEV).manual_seed(in_f + out_f + tokens)
    weight = (torch.randn(out_f, in_f, device=DEV, generator=g) * 0.02).to(ACT)
    q, s, z = ik.quantize_weight(weight)
    x = activations(tokens, in_f, g, outliers)
    dy = torch.randn(tokens, out_f, device=DEV, generator=g).to(ACT)
    case = {"linear": name, "in": in_f, "out": out_f, "tokens": tokens, "outliers": outliers}
    y16 = ik.reference_matmul_fwd(x, q, s, z) if DEV == "cpu" else ik.int4_matmul_fwd(x, q, s, z)
    dx16 = ik.reference_matmul_bwd(dy, q, s, z) if DEV == "cpu" else ik.int4_matmul_bwd(dy, q, s, z)
    case["int4_vs_bf16_weight"] = {"y": rel(y16, x.float() @ weight.float().t()), "dx": rel(dx16, dy.float() @ weight.float())}
    del weight
    for path in paths:
        kernel = qtypes.kernel_for("int4_w4a8", path["kernel"], DEV)
        fmt = kernel.activations
        scales = w.WeightScales(q, s, z, ik.GROUP_SIZE, fmt)
        y8 = w.w4a8_matmul(x, q, s, z, ik.GROUP_SIZE, kernel, True, transposed=False)
        dx8 = w.w4a8_matmul(dy, q, s, z, ik.GROUP_SIZE, kernel, True, transposed=True)
        y_ref = w.reference_fwd(x, q, s, z, scales, fmt)
        dx_ref = w.reference_bwd(dy, q, s, z, scales, fmt)
        case[path["name"]] = {"vs_bf16_activations": {"y": rel(y8, y16), "dx": rel(dx8, dx16)},
                              "kernel_vs_reference": {"y": rel(y8, y_ref), "dx": rel(dx8, dx_ref)}}
    return case


def main():
    fp8 = qtypes.has_fp8_units(torch.device(DEV))
    paths = [c for c in candidates(fp8, bool(getattr(torch.version, "hip", None))) if c["qtype"] == "int4_w4a8"]
    cases = [(n, i, o, t) for n, i, o, t, _ in block_linear_cases(1024, 512)]
    if args.tiny:
        cases = [(n, i // 48, o // 48, t // 16) for n, i, o, t in cases][:3]
        w._scaled_gemm_kernel.configs = w._scaled_gemm_kernel.configs[:1]  # no autotuning without a GPU
    R["paths"] = [p_["name"] for p_ in paths]
    for outliers in (False, True):
        for name, in_f, out_f, tokens in cases:
            case = one_case(name, in_f, out_f, tokens, outliers, paths)
            R["cases"].append(case)
            log(f"{name:17s} {tokens:5d} tok{' outliers' if outliers else ''}: 4-bit vs bf16 weight "
                f"{case['int4_vs_bf16_weight']['y']:.4f} | " + " | ".join(
                    f"{p_['name']}: y {case[p_['name']]['vs_bf16_activations']['y']:.4f} dx "
                    f"{case[p_['name']]['vs_bf16_activations']['dx']:.4f} (kernel-ref "
                    f"{max(case[p_['name']]['kernel_vs_reference'].values()):.1e})" for p_ in paths))
            if DEV == "cuda":
                torch.cuda.empty_cache()
    R["kernel_check"] = kernel_check(paths)
    if args.time:
        R["timing"] = timing(paths, fp8)
    R["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    args.out.write_text(json.dumps(R, indent=1))


def kernel_check(paths) -> dict:
    """Per path: the largest kernel-vs-reference error over every case, against the self-test's limit."""
    limit = qtypes.QTYPES["int4_w4a8"].tolerance
    verdict = {}
    for path in paths:
        worst = max(max(case[path["name"]]["kernel_vs_reference"].values()) for case in R["cases"])
        verdict[path["name"]] = {"max_relative_error": worst, "tolerance": limit, "passed": worst <= limit}
        log(f"kernel vs reference, {path['name']}: {worst:.1e} ({'pass' if worst <= limit else 'FAIL'}, limit {limit})")
    return verdict


def cpu_timed_ms(torch_, fn, reps: int = 2) -> float:
    """The dry run's stand-in for the self-test's CUDA-event timer."""
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) * 1e3 / reps


def timing(paths, fp8: bool) -> list:
    """Median block-Linear ms of one step per path over args.time interleaved rounds, per token shape."""
    m = kernels.Modules()
    timed = [None] + [c for c in candidates(fp8, bool(getattr(torch.version, "hip", None)))
                      if c["qtype"] == "int4_fused"] + paths
    if DEV == "cpu":
        kernels.timed_ms = cpu_timed_ms
    shapes = []
    for part in args.tokens.split(";"):
        image, text = (int(v) for v in part.split(","))
        cases = block_linear_cases(image, text)
        if args.tiny:
            cases = [(n, i // 48, o // 48, max(1, t // 64), calls) for n, i, o, t, calls in cases][:2]
        log(f"timing the block Linears at {image} image + {text} text tokens, {args.time} rounds")
        runs = {}
        for _ in range(args.time):
            for cand in timed:
                row = kernels.time_candidate(m, cand, cases, DEV, log)
                runs.setdefault(row["candidate"], []).append(row["step_ms"])
        medians = {name: sorted(ms)[len(ms) // 2] for name, ms in runs.items()}
        rows = [{"candidate": name, "median_ms": ms, "x_bf16": ms / medians["bf16"], "runs_ms": runs[name]}
                for name, ms in medians.items()]
        for row in rows:
            log(f"  {row['candidate']:28s} {row['median_ms']:8.1f} ms  x{row['x_bf16']:.3f} bf16  "
                f"(runs {', '.join(f'{v:.1f}' for v in row['runs_ms'])})")
        shapes.append({"image_tokens": image, "text_tokens": text, "results": rows})
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return shapes


if __name__ == "__main__":
    if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("no GPU: run with TRITON_INTERPRET=1 and --tiny for a dry run")
    main()
