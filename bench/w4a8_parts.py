"""The 8-bit matmul's parts per FLUX.2 block Linear shape at 512 px, or 1024 (`compiled_step kernels`).

Per shape (M tokens, N outputs, K inputs; random 4-bit codes, group scales ~0.003): milliseconds
(triton.testing.do_bench, median) of the bf16 cuBLAS matmul, of toolkit/int4_w4a8.w4a8_matmul as
the trainer runs it (FP8, torch._scaled_mm, 256 MiB slices), of its parts (the activation
quantization, the whole weight requantized, torch._scaled_mm on it
with and without fast accumulation), with the 8-bit weight held, through the sliced Triton GEMM
(gemm "triton") and through gemm "in_register" (the GEMM reads the 4-bit weight; its input gradient
is the sliced Triton path); forward and input gradient. Relative errors: each FP8 path against its
reference, and against the bf16 matmul on the same 4-bit weight. Per step: each shape's count in
the 44 blocks (the double blocks' image and text streams, the single blocks), the forward twice
(the pass and its checkpointed recompute).
"""

import json

import torch

TXT = 512  # text tokens


def shapes(px: int) -> list[tuple]:
    """(name, M, N, K, layers in the 44 blocks) at `px` (image tokens: one per 16x16 pixels)."""
    img = (px // 16) ** 2
    return [
        ("single.linear1", img + TXT, 55296, 6144, 36), ("single.linear2", img + TXT, 6144, 24576, 36),
        ("img.qkv", img, 18432, 6144, 8), ("txt.qkv", TXT, 18432, 6144, 8),
        ("img.proj", img, 6144, 6144, 8), ("txt.proj", TXT, 6144, 6144, 8),
        ("img.mlp0", img, 36864, 6144, 8), ("txt.mlp0", TXT, 36864, 6144, 8),
        ("img.mlp2", img, 6144, 18432, 8), ("txt.mlp2", TXT, 6144, 18432, 8),
    ]


def bench(fn) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=10, rep=40))


def random_weight(N: int, K: int, device):
    generator = torch.Generator(device=device).manual_seed(N + K)
    qweight = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device=device, generator=generator)
    scale = torch.empty(N, K // 64, dtype=torch.bfloat16, device=device).uniform_(0.002, 0.004, generator=generator)
    zero = torch.full((N, K // 64), 8, dtype=torch.uint8, device=device)
    return qweight, scale, zero


def relative(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def shape_row(w, qtypes, name, M, N, K, count, device) -> dict:
    qweight, scale, zero = random_weight(N, K, device)
    x = torch.randn(M, K, dtype=torch.bfloat16, device=device)
    dy = torch.randn(M, N, dtype=torch.bfloat16, device=device)
    from toolkit.int4_kernels import dequantize_weight

    weight = dequantize_weight(qweight, scale, zero, 64, torch.bfloat16)  # what the bf16 rows multiply
    kernel = qtypes.Int4Kernel(qtypes.FP8, "scaled_mm", 256 * 2**20, True)
    fp8 = qtypes.FP8
    row = {"shape": name, "M": M, "N": N, "K": K, "layers": count, "ms": {}}
    ms = row["ms"]
    scales = w.weight_scales(qweight, scale, zero, 64, fp8)
    row["vs_reference_fwd"] = relative(w.w4a8_matmul(x, qweight, scale, zero, 64, kernel, True, False),
                                       w.reference_fwd(x, qweight, scale, zero, scales, fp8))
    row["vs_reference_bwd"] = relative(w.w4a8_matmul(dy, qweight, scale, zero, 64, kernel, True, True),
                                       w.reference_bwd(dy, qweight, scale, zero, scales, fp8))
    ms["bf16_fwd"] = bench(lambda: torch.nn.functional.linear(x, weight))
    ms["bf16_bwd"] = bench(lambda: dy @ weight)
    y_bf16, dx_bf16 = torch.nn.functional.linear(x, weight), dy @ weight
    for gemm in ("triton", "in_register"):
        other = qtypes.Int4Kernel(fp8, gemm, 256 * 2**20, True)
        y, dx = (w.w4a8_matmul(a, qweight, scale, zero, 64, other, True, t) for a, t in ((x, False), (dy, True)))
        y_ref, dx_ref = (w.w4a8_matmul(a, qweight, scale, zero, 64, other, False, t) for a, t in ((x, False), (dy, True)))
        row[f"{gemm}_vs_reference_fwd"], row[f"{gemm}_vs_reference_bwd"] = relative(y, y_ref), relative(dx, dx_ref)
        row[f"{gemm}_vs_bf16_fwd"], row[f"{gemm}_vs_bf16_bwd"] = relative(y, y_bf16), relative(dx, dx_bf16)
        ms[f"{gemm}_fwd"] = bench(lambda: w.w4a8_matmul(x, qweight, scale, zero, 64, other, True, False))
        ms[f"{gemm}_bwd"] = bench(lambda: w.w4a8_matmul(dy, qweight, scale, zero, 64, other, True, True))
    row["in_register_config"] = str(w._in_register_gemm_kernel.best_config)
    row["w4a8_vs_bf16_fwd"] = relative(w.w4a8_matmul(x, qweight, scale, zero, 64, kernel, True, False), y_bf16)
    row["w4a8_vs_bf16_bwd"] = relative(w.w4a8_matmul(dy, qweight, scale, zero, 64, kernel, True, True), dx_bf16)
    ms["w4a8_fwd"] = bench(lambda: w.w4a8_matmul(x, qweight, scale, zero, 64, kernel, True, False))
    ms["w4a8_bwd"] = bench(lambda: w.w4a8_matmul(dy, qweight, scale, zero, 64, kernel, True, True))
    ms["quantize_x"] = bench(lambda: w.quantize_rows(x, fp8))
    ms["quantize_dy"] = bench(lambda: w.quantize_rows(dy, fp8))
    for transposed, label in ((False, "fwd"), (True, "bwd")):
        a = dy if transposed else x
        aq, a_scale = w.quantize_rows(a, fp8)
        width, inner, inverse, column_scale = w._orientation(qweight, scales, transposed)
        buf = w._weight_buffer(width, inner, device, fp8)
        w.requantize_slice(qweight, scale, zero, inverse, buf, fp8, transposed, 0)
        ms[f"requantize_{label}"] = bench(lambda: w.requantize_slice(qweight, scale, zero, inverse, buf, fp8,
                                                                     transposed, 0))

        def gemm(fast: bool):
            return torch._scaled_mm(aq, buf.t(), scale_a=a_scale[:, None], scale_b=column_scale[None, :],
                                    out_dtype=torch.bfloat16, use_fast_accum=fast)

        ms[f"scaled_mm_{label}"] = bench(lambda: gemm(False))
        ms[f"scaled_mm_fast_{label}"] = bench(lambda: gemm(True))
        row[f"fast_accum_difference_{label}"] = relative(gemm(True), gemm(False))
    copies = [w.eight_bit_copy(qweight, scale, zero, 64, fp8, transposed) for transposed in (False, True)]
    ms["held_fwd"] = bench(lambda: w.w4a8_matmul(x, qweight, scale, zero, 64, kernel, True, False, copies[0]))
    ms["held_bwd"] = bench(lambda: w.w4a8_matmul(dy, qweight, scale, zero, 64, kernel, True, True, copies[1]))
    row["tflops_bf16_fwd"] = 2 * M * N * K / ms["bf16_fwd"] / 1e9
    row["tflops_scaled_mm_fwd"] = 2 * M * N * K / ms["scaled_mm_fwd"] / 1e9
    row["requantize_gbps_fwd"] = N * K * 1.5 / ms["requantize_fwd"] / 1e6  # 4-bit read, 8-bit written
    row["requantize_gbps_bwd"] = N * K * 1.5 / ms["requantize_bwd"] / 1e6
    return row


def per_step(rows: list) -> dict:
    """Milliseconds per step of each measure: forward twice (pass and recompute), gradient once."""
    total = {}
    for row in rows:
        ms, count = row["ms"], row["layers"]
        for key, value in ms.items():
            times = 1 if key.endswith(("_bwd", "_dy")) else 2
            total[key] = total.get(key, 0.0) + value * times * count
    return {key: round(value, 2) for key, value in total.items()}


def largest_errors(rows: list) -> dict:
    """Each relative error's largest value over the shapes."""
    keys = [key for key in rows[0] if "vs_" in key]
    return {key: max(row[key] for row in rows) for key in keys}


def main(args) -> int:
    from bench import _trainer

    _trainer.Trainer(args.trainer)
    from toolkit import int4_w4a8
    from flux2_contract import qtypes

    device = torch.device("cuda")
    rows = []
    for name, M, N, K, count in shapes(args.px):
        rows.append(shape_row(int4_w4a8, qtypes, name, M, N, K, count, device))
        print(json.dumps({"shape": name, **{k: round(v, 3) for k, v in rows[-1]["ms"].items()}}), flush=True)
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "px": args.px, "shapes": rows,
              "per_step_ms": per_step(rows), "max_relative_error": largest_errors(rows)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(json.dumps({**result["per_step_ms"], **result["max_relative_error"]}), flush=True)
    return 0
