"""The self-test's kernel checks and timings, on the trainer's own 4-bit modules.

A *candidate* is a qtype plus the kernel choice that picks its GPU path: `int4_fused` (bf16
activations, 4-bit weight dequantized a slice at a time), and `int4_w4a8` with FP8 activations
(GPUs with FP8 matrix units) or int8 activations, each through the portable Triton GEMM or, for
FP8 on NVIDIA, torch._scaled_mm (both on 8-bit weight slices), or through the Triton GEMM that reads
the 4-bit weight itself (`in_register`). The choice is a candidate's `kernel`: the model_kwargs
(`w4a8_activations`, `w4a8_gemm`: flux2_contract/settings.py) the trainer's qtype table reads
(`kernel_for`), and the ones `run` writes into a run's config when it picks the candidate. Every function takes the trainer's modules as
arguments (`Modules`): nothing here imports torch at module level, because the launcher imports
this file in its own interpreter for the constants.
"""

import time

CHECK_SHAPES = [(320, 640, 576), (77, 192, 200)]
"""(tokens, in, out) for the kernel-vs-reference checks: partial tiles, an odd token count (where
torch._scaled_mm, which wants multiples of 16, hands over to the Triton GEMM)."""

QUALITY_TOLERANCE = {"int8": 0.03, "fp8": 0.06, "outliers": 0.06}
"""Largest relative error of an 8-bit-activation layer (6144 -> 384, 256 tokens) against the
bf16-activation one, on N(0, 1) activations and an N(0, 0.02) weight; "outliers": the same
with 4 of the 6144 input channels scaled 100x, as transformer activations have. Measured
(tests/trainer_patches/test_int4_w4a8.py; bench/results/w4a8_quality.csv, which the paper verdicts
of docs/cards.md read): both formats pass without the outliers, fp8 with them too, and int8 with them
fails (one step per token is stretched by the outliers)."""

HIDDEN, MLP = 6144, 18432  # full-size FLUX.2 [dev]: Flux2Params() hidden_size, 3 x hidden MLP
DOUBLE_BLOCKS, SINGLE_BLOCKS = 8, 48
BLOCK_LINEARS = [
    # name, in, out, where: double blocks see image and text tokens apart, single blocks both
    ("double.attn.qkv", HIDDEN, 3 * HIDDEN, "double"),
    ("double.attn.proj", HIDDEN, HIDDEN, "double"),
    ("double.mlp.0", HIDDEN, 2 * MLP, "double"),
    ("double.mlp.2", MLP, HIDDEN, "double"),
    ("single.linear1", HIDDEN, 3 * HIDDEN + 2 * MLP, "single"),
    ("single.linear2", HIDDEN + MLP, HIDDEN, "single"),
]


class Modules:
    """torch and the trainer's 4-bit modules, imported from a trainer checkout on sys.path."""

    def __init__(self):
        import torch
        from toolkit import int4_linear, int4_w4a8
        from flux2_contract import qtypes

        self.torch = torch
        self.int4 = int4_linear
        self.w4a8 = int4_w4a8
        self.qtypes = qtypes


def candidate(qtype: str, activations: str | None = None, gemm: str | None = None, label: str = "") -> dict:
    """One candidate: a qtype and its kernel choice, as the model_kwargs `run` writes when it is chosen."""
    kernel = {key: value for key, value in (("w4a8_activations", activations), ("w4a8_gemm", gemm)) if value}
    name = " ".join(part for part in (qtype, activations, gemm) if part) + label
    return {"name": name, "qtype": qtype, "kernel": kernel}


def candidates(fp8_units: bool, hip: bool) -> list[dict]:
    """The 4-bit paths worth trying on this GPU, each a qtype plus the kernel choice that selects it."""
    found = [candidate("int4_fused")]
    formats = (["fp8"] if fp8_units else []) + ["int8"]
    for fmt in formats:
        gemms = ["triton"] + (["scaled_mm"] if fmt == "fp8" and not hip else []) + ["in_register"]
        found += [candidate("int4_w4a8", fmt, gemm) for gemm in gemms]
    return found


def kernel_of(m: Modules, candidate: dict, device):
    """The candidate's kernel, from the trainer's qtype table with the candidate's choice passed in."""
    return m.qtypes.kernel_for(candidate["qtype"], candidate.get("kernel"), device)


def random_layer(m: Modules, in_f: int, out_f: int, candidate: dict, device, seed: int):
    """An Int4Linear of an N(0, 0.02) weight, multiplying with the candidate's kernel."""
    torch = m.torch
    g = torch.Generator(device=device).manual_seed(seed)
    weight = torch.randn(out_f, in_f, device=device, generator=g, dtype=torch.bfloat16) * 0.02
    q, s, z = m.int4.quantize_weight(weight)
    layer = m.int4.Int4Linear(in_f, out_f, device=device, kernel=kernel_of(m, candidate, device))
    layer.qweight, layer.scale, layer.zero = q, s, z
    return layer


def relative_error(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def forward_backward(m: Modules, layer, x, dy, use_kernel):
    """y and dx through the GPU kernels (use_kernel) or the reference path, the layer's kernel otherwise."""
    held = layer.kernel
    layer.kernel = m.qtypes.Int4Kernel(held.activations, held.gemm, held.chunk_bytes, use_kernel)
    xr = x.detach().clone().requires_grad_(True)
    y = layer(xr)
    y.backward(dy)
    layer.kernel = held
    return y.detach(), xr.grad


def check_candidate(m: Modules, candidate: dict, device) -> dict:
    """The candidate's kernels against its reference path on CHECK_SHAPES: y and dx."""
    torch = m.torch
    worst = 0.0
    try:
        for i, (tokens, in_f, out_f) in enumerate(CHECK_SHAPES):
            layer = random_layer(m, in_f, out_f, candidate, device, seed=i)
            g = torch.Generator(device=device).manual_seed(100 + i)
            x = torch.randn(tokens, in_f, device=device, generator=g, dtype=torch.bfloat16)
            dy = torch.randn(tokens, out_f, device=device, generator=g, dtype=torch.bfloat16)
            y, dx = forward_backward(m, layer, x, dy, use_kernel=True)
            y_ref, dx_ref = forward_backward(m, layer, x, dy, use_kernel=False)
            worst = max(worst, relative_error(y, y_ref), relative_error(dx, dx_ref))
    except Exception as error:  # a kernel that does not compile or run on this GPU is a finding
        return {"candidate": candidate["name"], "passed": False, "error": f"{type(error).__name__}: {error}"[:800]}
    tolerance = m.qtypes.QTYPES[candidate["qtype"]].tolerance
    return {"candidate": candidate["name"], "passed": worst <= tolerance, "max_relative_error": worst,
            "tolerance": tolerance}


def check_quality(m: Modules, fmt: str, device, outliers: bool) -> dict:
    """Reference path: an 8-bit-activation layer against the bf16-activation one (y and dx)."""
    torch = m.torch
    layer = random_layer(m, 6144, 384, candidate("int4_w4a8", fmt), device, seed=7)
    g = torch.Generator(device=device).manual_seed(8)
    x = torch.randn(256, 6144, device=device, generator=g)
    if outliers:
        x[:, :4] *= 100
    x = x.to(torch.bfloat16)
    dy = torch.randn(256, 384, device=device, generator=g, dtype=torch.bfloat16)
    y8, dx8 = forward_backward(m, layer, x, dy, use_kernel=False)
    layer.kernel = kernel_of(m, candidate("int4_fused"), device)
    y, dx = forward_backward(m, layer, x, dy, use_kernel=False)
    worst = max(relative_error(y8, y), relative_error(dx8, dx))
    tolerance = QUALITY_TOLERANCE["outliers" if outliers else fmt]
    return {"check": f"{fmt}{', 100x outlier channels' if outliers else ''}", "format": fmt,
            "outliers": outliers, "passed": worst <= tolerance, "max_relative_error": worst, "tolerance": tolerance}


def reference_candidates() -> list[dict]:
    """Without a GPU: the qtypes' reference paths (the CPU runs both activation formats)."""
    return [candidate("int4_fused", label=" (reference)")] + [
        candidate("int4_w4a8", fmt, label=" (reference)") for fmt in ("fp8", "int8")]


def quality_passed(checks: list, candidate: dict) -> bool:
    """int4_w4a8 candidates need both quality checks of their format; int4_fused has none."""
    fmt = candidate.get("kernel", {}).get("w4a8_activations")
    return fmt is None or all(c["passed"] for c in checks if c.get("format") == fmt)


def block_linear_cases(image_tokens: int, text_tokens: int) -> list[tuple]:
    """(name, in, out, tokens, calls per step) for the FLUX.2 block Linears at one batch."""
    cases = []
    for name, in_f, out_f, where in BLOCK_LINEARS:
        if where == "double":
            for tokens in (image_tokens, text_tokens):
                cases.append((name, in_f, out_f, tokens, DOUBLE_BLOCKS))
        else:
            cases.append((name, in_f, out_f, image_tokens + text_tokens, SINGLE_BLOCKS))
    return cases


def timed_ms(torch, fn, reps: int = 6) -> float:
    """Mean ms of fn on the GPU after two warm-up calls (the first autotunes and compiles)."""
    fn()
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def time_case(m: Modules, candidate: dict | None, case: tuple, device) -> dict:
    """Forward and input-gradient ms of one block Linear: bf16 weights when candidate is None."""
    torch = m.torch
    name, in_f, out_f, tokens, _ = case
    g = torch.Generator(device=device).manual_seed(tokens + out_f)
    x = torch.randn(tokens, in_f, device=device, generator=g, dtype=torch.bfloat16)
    dy = torch.randn(tokens, out_f, device=device, generator=g, dtype=torch.bfloat16)
    if candidate is None:
        weight = torch.randn(out_f, in_f, device=device, generator=g, dtype=torch.bfloat16) * 0.02
        layer = lambda t: torch.nn.functional.linear(t, weight)  # noqa: E731
    else:
        layer = random_layer(m, in_f, out_f, candidate, device, seed=tokens)
    xr = x.detach().requires_grad_(True)
    y = layer(xr)
    with torch.no_grad():
        fwd = timed_ms(torch, lambda: layer(x))
    bwd = timed_ms(torch, lambda: torch.autograd.grad(y, xr, dy, retain_graph=True))
    return {"linear": name, "in": in_f, "out": out_f, "tokens": tokens, "fwd_ms": fwd, "bwd_ms": bwd}


def time_candidate(m: Modules, candidate: dict | None, cases: list[tuple], device, log) -> dict:
    """Block-Linear ms of one training step (2 forwards, as checkpointing recomputes, + 1 input
    gradient per call) and its TFLOP/s, with the per-Linear figures."""
    label = candidate["name"] if candidate else "bf16"
    t0 = time.perf_counter()
    rows = [time_case(m, candidate, case, device) for case in cases]
    step_ms = sum(case[4] * (2 * row["fwd_ms"] + row["bwd_ms"]) for case, row in zip(cases, rows))
    flop = sum(case[4] * 3 * 2 * case[1] * case[2] * case[3] for case in cases)
    log(f"  timed {label}: {step_ms:.1f} ms of block Linears per step ({time.perf_counter() - t0:.0f} s)")
    return {"candidate": label, "step_ms": step_ms, "tflops": flop / (step_ms * 1e-3) / 1e12, "linears": rows}
