#!/usr/bin/env python3
"""The 4-bit matmuls (toolkit/int4_kernels.py) against bf16 and torchao, per FLUX.2 block Linear.

For each of the six distinct block Linear shapes of the full-size FLUX.2
transformer (Flux2Params defaults: hidden 6144, MLP 18432) at the token counts
that reach it at 512 px (1024 image + 512 text tokens) and 1024 px (4096 + 512):

  * correctness: the GPU path's y = x @ W^T and dx = dy @ W (Triton dequantizes
    W a slice at a time, the vendor GEMM multiplies) against an fp32 reference on
    the same dequantized weight, next to cuBLAS bf16's own error;
  * speed: forward and backward(dx) of the GPU path, of bf16 torch.matmul on a
    bf16 weight, of our own unfused path (dequantize, then matmul) and, when
    torchao imports, of torchao's UIntXWeightOnlyConfig(torch.uint4) (what the
    fork's `qtype: uint4` does): dequantize + matmul;
  * extra memory each path allocates for one forward + backward(dx).

Needs a GPU with Triton. The modules are imported from a trainer checkout (--trainer), so the
script runs against any checkout:

    python -m bench.int4_kernel --trainer <workdir>/trainer --out results.json
"""

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--trainer", required=True, type=Path, help="a patched trainer checkout (its toolkit/ is imported)")
p.add_argument("--out", required=True, help="JSON results (rewritten after every case)")
p.add_argument("--quick", action="store_true", help="two small cases only (smoke test)")
p.add_argument("--no-torchao", action="store_true")
p.add_argument("--unfused", action="store_true", help="also time our unfused path (dequantize all of W, matmul)")
args = p.parse_args()

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

sys.path.insert(0, str(args.trainer.resolve()))
from toolkit import int4_kernels as ik  # noqa: E402
from toolkit import int4_linear as il  # noqa: E402
from flux2_contract.qtypes import Int4Kernel  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

# the six block Linear shapes (name, in_features, out_features, where), as the self-test times them
from launcher.in_trainer.selftest.kernels import BLOCK_LINEARS  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: only a dry run under TRITON_INTERPRET=1
if DEV == "cpu":
    def do_bench(fn, warmup=0, rep=0):  # noqa: F811
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

bf16 = torch.bfloat16
ACT = bf16 if DEV == "cuda" else torch.float16  # the CPU interpreter mishandles bf16
RES = {512: (1024, 512), 1024: (4096, 512)}  # px: (image tokens, text tokens)


def token_counts(where):
    """Distinct M values reaching a Linear of this kind, with the resolutions they come from."""
    out = {}
    for px, (img, txt) in RES.items():
        ms = [img, txt] if where == "double" else [img + txt]
        for m in ms:
            out.setdefault(m, []).append(px)
    return out


R = {"argv": sys.argv[1:], "torch": torch.__version__, "triton": triton.__version__,
     "gpu": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu (dry run)", "cuda": torch.version.cuda,
     "hip": getattr(torch.version, "hip", None),
     "started": time.strftime("%Y-%m-%d %H:%M:%S"), "cases": [], "errors": []}


def save():
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(R, f, indent=1, default=str)
    os.replace(tmp, args.out)


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def bench_ms(fn):
    return do_bench(fn, warmup=25, rep=100)


def peak_extra(fn):
    """Bytes allocated above the current level while fn runs."""
    if DEV == "cpu":
        fn()
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def ceiling():
    if DEV == "cpu":
        return 0.0
    a = torch.randn(8192, 8192, device=DEV, dtype=bf16)
    b = torch.randn(8192, 8192, device=DEV, dtype=bf16)
    ms = bench_ms(lambda: a @ b)
    return 2 * 8192 ** 3 / (ms * 1e-3) / 1e12


torchao_cfg = None
if not args.no_torchao:
    try:
        import torchao  # noqa: F401
        from torchao.quantization.quant_api import UIntXWeightOnlyConfig, quantize_

        torchao_cfg = UIntXWeightOnlyConfig(torch.uint4)
        R["torchao"] = torchao.__version__
    except Exception as e:  # not installed there
        R["torchao"] = f"unavailable: {type(e).__name__}: {e}"
log("torchao:", R.get("torchao"))

R["matmul_ceiling_tflops"] = ceiling()
log(f"bf16 8192^3 ceiling {R['matmul_ceiling_tflops']:.1f} TFLOP/s")
save()

cases = []
for name, k, n, where in BLOCK_LINEARS:
    for m, pxs in token_counts(where).items():
        cases.append((name, k, n, m, pxs))
if args.quick:
    cases = [("quick.a", 256, 320, 100, []), ("quick.b", 6144, 6144, 512, [])]
    if DEV == "cpu":
        cases = [("quick.a", 256, 320, 100, []), ("quick.c", 128, 200, 70, [])]

for name, K, N, M, pxs in cases:
    case = {"name": name, "in": K, "out": N, "tokens": M, "px": pxs, "gflop": 2 * M * N * K / 1e9}
    R["cases"].append(case)
    try:
        g = torch.Generator(device=DEV).manual_seed(M + N + K)
        w = (torch.randn(N, K, device=DEV, generator=g) * 0.02).to(ACT)
        x = torch.randn(M, K, device=DEV, generator=g).to(ACT)
        dy = torch.randn(M, N, device=DEV, generator=g).to(ACT)
        q, s, z = ik.quantize_weight(w)
        wq = ik.dequantize_weight(q, s, z)  # the weight the 4-bit paths compute with, bf16
        del w

        # ---- correctness vs fp32 on the same dequantized weight
        y_ref = x.float() @ wq.float().t()
        dx_ref = dy.float() @ wq.float()

        def err(a, ref):
            d = (a.float() - ref).abs()
            return {"max_abs": float(d.max()), "max_rel_to_maxref": float(d.max() / ref.abs().max()),
                    "mean_abs": float(d.mean())}

        case["err_fwd_bf16_cublas"] = err(x @ wq.t(), y_ref)
        case["err_bwd_bf16_cublas"] = err(dy @ wq, dx_ref)
        case["err_fwd_chunked"] = err(ik.int4_matmul_fwd(x, q, s, z), y_ref)
        case["err_bwd_chunked"] = err(ik.int4_matmul_bwd(dy, q, s, z), dx_ref)
        del y_ref, dx_ref

        # ---- timing (ms, median of do_bench)
        t = {}
        mem = {}
        t["fwd_bf16"] = bench_ms(lambda: x @ wq.t())
        t["bwd_bf16"] = bench_ms(lambda: dy @ wq)
        mem["bf16"] = peak_extra(lambda: (x @ wq.t(), dy @ wq))
        t["fwd_int4_chunked"] = bench_ms(lambda: ik.int4_matmul_fwd(x, q, s, z))
        t["bwd_int4_chunked"] = bench_ms(lambda: ik.int4_matmul_bwd(dy, q, s, z))
        mem["int4_chunked"] = peak_extra(lambda: (ik.int4_matmul_fwd(x, q, s, z), ik.int4_matmul_bwd(dy, q, s, z)))
        if args.unfused:
            t["fwd_int4_unfused"] = bench_ms(lambda: ik.reference_matmul_fwd(x, q, s, z))
            t["bwd_int4_unfused"] = bench_ms(lambda: ik.reference_matmul_bwd(dy, q, s, z))
            mem["int4_unfused"] = peak_extra(lambda: (ik.reference_matmul_fwd(x, q, s, z),
                                                      ik.reference_matmul_bwd(dy, q, s, z)))

        # ---- the module + autograd.Function, kernel vs reference path, fwd+bwd
        kernel = Int4Kernel()
        mod = il.Int4Linear(K, N, device=DEV, kernel=kernel)
        mod.qweight, mod.scale, mod.zero = q, s, z
        xr = x.clone().requires_grad_(True)
        y1 = mod(xr)
        y1.backward(dy)
        g1 = xr.grad.clone()
        xr.grad = None
        mod.kernel = Int4Kernel(use_kernel=False)
        y2 = mod(xr)
        y2.backward(dy)
        case["module_kernel_vs_reference"] = {"y": err(y1, y2.float()), "dx": err(g1, xr.grad.float())}
        mod.kernel = kernel
        del y1, y2, g1, xr

        def module_step():
            xx = x.detach().requires_grad_(True)
            mod(xx).backward(dy)

        t["fwd_bwd_module"] = bench_ms(module_step)

        if torchao_cfg is not None:
            try:
                lin = nn.Linear(K, N, bias=False, device=DEV, dtype=ACT)
                with torch.no_grad():
                    lin.weight.copy_(wq)  # requantizing the 4-bit weight nearly reproduces it (see the max_abs below)
                quantize_(nn.Sequential(lin), torchao_cfg)
                wa = lin.weight
                case["torchao_vs_ours_weight_max_abs"] = float((wa.dequantize().float() - wq.float()).abs().max())
                xa = x.clone().requires_grad_(True)
                ya = torch.nn.functional.linear(xa, wa)
                t["fwd_torchao"] = bench_ms(lambda: torch.nn.functional.linear(x, wa))
                t["bwd_torchao"] = bench_ms(lambda: torch.autograd.grad(ya, xa, dy, retain_graph=True))
                del ya

                def ao_step():
                    xx = x.detach().requires_grad_(True)
                    torch.autograd.grad(torch.nn.functional.linear(xx, wa), xx, dy)

                mem["torchao"] = peak_extra(ao_step)
                del lin, wa, xa
            except Exception as e:
                case["torchao_error"] = f"{type(e).__name__}: {e}"[:1000]

        case["ms"] = t
        case["tflops"] = {k2: case["gflop"] / v for k2, v in t.items() if not k2.startswith("fwd_bwd")}
        case["vs_bf16"] = {k2: v / t["fwd_bf16" if k2.startswith("fwd") else "bwd_bf16"]
                           for k2, v in t.items() if not k2.startswith("fwd_bwd")}
        case["extra_mem_mib"] = {k2: v / 2 ** 20 for k2, v in mem.items()}
        log(f"{name:18s} M={M:5d} K={K:5d} N={N:5d} | ms fwd/bwd: bf16 {t['fwd_bf16']:.3f}/{t['bwd_bf16']:.3f} "
            f"chunked {t['fwd_int4_chunked']:.3f}/{t['bwd_int4_chunked']:.3f} "
            f"ao {t.get('fwd_torchao', float('nan')):.3f}/{t.get('bwd_torchao', float('nan')):.3f} | rel err "
            f"chunked {case['err_fwd_chunked']['max_rel_to_maxref']:.1e}/{case['err_bwd_chunked']['max_rel_to_maxref']:.1e}"
            f" cublas {case['err_fwd_bf16_cublas']['max_rel_to_maxref']:.1e}")
        del x, dy, q, s, z, wq, mod
        if DEV == "cuda":
            torch.cuda.empty_cache()
    except Exception as e:
        case["error"] = f"{type(e).__name__}: {e}"[:2000]
        R["errors"].append({"case": name, "tb": traceback.format_exc()[-4000:]})
        log("FAILED", name, M, case["error"])
        traceback.print_exc()
    save()


def total(key_f, key_b, sel=None):
    """Sum of fwd + bwd ms over the block Linears of one step at a resolution (per-block counts)."""
    out = {}
    for px, (img, txt) in RES.items():
        tot = 0.0
        for c in R["cases"]:
            if "ms" not in c or key_f not in c["ms"]:
                return None
            mult = 8 if c["name"].startswith("double") else 48  # depth, depth_single_blocks
            if c["name"].startswith("double") and c["tokens"] in (img, txt):
                tot += mult * (c["ms"][key_f] + c["ms"][key_b])
            elif c["name"].startswith("single") and c["tokens"] == img + txt:
                tot += mult * (c["ms"][key_f] + c["ms"][key_b])
        out[px] = tot
    return out


if not args.quick:
    # forward twice (checkpoint recompute) + backward(dx) once: the block Linear time of one training step
    R["step_block_linear_ms"] = {}
    labels = [("bf16", "fwd_bf16", "bwd_bf16"), ("int4_unfused", "fwd_int4_unfused", "bwd_int4_unfused"),
              ("torchao", "fwd_torchao", "bwd_torchao"), ("int4_chunked", "fwd_int4_chunked", "bwd_int4_chunked")]
    for label, kf, kb in labels:
        once = total(kf, kb)
        fwd_only = total(kf, kf)
        if once is not None:
            R["step_block_linear_ms"][label] = {px: once[px] + fwd_only[px] / 2 for px in once}
    log("block-Linear ms per checkpointed step (2 fwd + 1 bwd(dx)):", R["step_block_linear_ms"])
R["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
save()
log("done; errors:", len(R["errors"]))
