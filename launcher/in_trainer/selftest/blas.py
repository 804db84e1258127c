"""The self-test's BLAS check (ROCm only): hipBLAS against hipBLASLt at FLUX.2 block GEMM shapes.

PyTorch picks the BLAS library of a ROCm GPU's bf16 matmuls by architecture, and for RDNA3
(gfx110x) that pick has flipped between releases: hipBLAS by default because hipBLASLt regressed
there (https://github.com/ROCm/pytorch/pull/2168), hipBLASLt again later
(https://github.com/ROCm/pytorch/pull/3207, https://github.com/pytorch/pytorch/pull/185375). So
the self-test times both on the user's card at the GEMMs the 4-bit path really runs (int4_fused
dequantizes a slice of the weight, then `torch.mm`: the slices of toolkit/int4_kernels.py at the
preset's token counts) and records the faster; `run` hands it to the trainer as
`model_kwargs: {rocm_blas}` (toolkit/rocm_blas.py sets it before the first matmul). On NVIDIA
and on the CPU nothing is chosen. On RDNA4 (gfx12) hipBLASLt is not timed at all: with ROCm
10.0.0, training through it reset RX 9070 / R9700 GPUs (RESETS), and the self-test is the first
thing a new owner runs. Stdlib-only at module level: torch comes in as an argument.
"""

HIPBLAS, HIPBLASLT, DEFAULT = "hipblas", "hipblaslt", "default"
LIBRARIES = (HIPBLAS, HIPBLASLT)
MARGIN = 0.03
"""A library is chosen over PyTorch's own pick only when it is this much faster (run-to-run noise
of the summed step time is about 1 %); within it the default stays."""
AGREEMENT = 1e-2
"""Largest relative difference of one GEMM's output between the two libraries: both sum bf16
products in fp32, in other orders; a wrong kernel is off by far more."""
RESETS = {
    "gfx12": "hipBLASLt reset RX 9070 / R9700 GPUs in training with ROCm 10.0.0 (TheRock issue #7699, "
             "2026-08; the workaround is TORCH_BLAS_PREFER_HIPBLASLT=0)",
}
"""Architecture prefix: why hipBLASLt is neither timed nor chosen there (docs/amd.md, "Runtime traps
on Windows"); `rocm_blas: hipblaslt` in a preset still uses it."""
CHUNK_BYTES = 64 * 2**20
"""int4_fused's default weight slice (flux2_contract/qtypes.py DEFAULT_CHUNK_MIB)."""


def slice_widths(total: int, width: int, multiple: int) -> list[int]:
    """The widths of the slices `total` rows (or columns) are cut into, at most CHUNK_BYTES of
    bf16 weight of `width` each, a multiple of `multiple` (toolkit/int4_kernels.py's rule)."""
    step = max(multiple, (CHUNK_BYTES // (2 * width)) // multiple * multiple)
    return [min(step, total - first) for first in range(0, total, step)]


def gemm_cases(cases: list[tuple]) -> list[dict]:
    """The bf16 GEMMs of one step of block Linears (kernels.block_linear_cases): per Linear, the
    forward slices (M tokens, K in, N a slice of out) and the input-gradient slices (M tokens,
    K out, N a slice of in, 64-column groups), each written into a column slice of an output `ld`
    wide, with its calls per step (forwards count twice: checkpointing recomputes them)."""
    gemms = []
    for name, in_f, out_f, tokens, calls in cases:
        for width in slice_widths(out_f, in_f, 64):
            gemms.append({"linear": name, "m": tokens, "k": in_f, "n": width, "ld": out_f, "transposed": False,
                          "calls": 2 * calls})
        for width in slice_widths(in_f, out_f, 64):
            gemms.append({"linear": name, "m": tokens, "k": out_f, "n": width, "ld": in_f, "transposed": True,
                          "calls": calls})
    return merged(gemms)


def merged(gemms: list[dict]) -> list[dict]:
    """One entry per distinct GEMM, its calls summed."""
    seen = {}
    for gemm in gemms:
        key = (gemm["m"], gemm["k"], gemm["n"], gemm["ld"], gemm["transposed"])
        if key in seen:
            seen[key]["calls"] += gemm["calls"]
        else:
            seen[key] = dict(gemm)
    return list(seen.values())


def pick(step_ms: dict, default: str) -> dict:
    """The library `rocm_blas: auto` takes from each library's summed ms per step (None: it could
    not run here): the faster where it beats the other by more than MARGIN, else PyTorch's own
    pick (`default`, the library it prefers on this GPU)."""
    timed = {name: ms for name, ms in step_ms.items() if ms}
    if not timed:
        return {"library": DEFAULT, "reason": "neither library could be timed"}
    if len(timed) == 1:
        (name, ms), = timed.items()
        return {"library": name if name != default else DEFAULT, "reason": f"only {name} ran here ({ms:.1f} ms)"}
    fast, slow = sorted(timed, key=timed.get)
    gain = timed[slow] / timed[fast] - 1
    if gain <= MARGIN:
        return {"library": DEFAULT, "reason": f"{fast} {timed[fast]:.1f} ms and {slow} {timed[slow]:.1f} ms are within "
                                              f"{MARGIN:.0%}: PyTorch's own pick ({default}) stays"}
    return {"library": fast, "reason": f"{fast} {timed[fast]:.1f} ms, {slow} {timed[slow]:.1f} ms per step "
                                       f"({gain:.0%} faster)"}


def library_of(torch) -> str:
    """The library PyTorch's preference names now (on ROCm `Cublas` is hipBLAS, `Cublaslt` hipBLASLt)."""
    backend = str(torch.backends.cuda.preferred_blas_library()).lower()
    return HIPBLASLT if backend.endswith("cublaslt") else HIPBLAS if backend.endswith("cublas") else backend


def time_gemms(torch, gemms: list[dict], device, timer) -> tuple[float, object]:
    """(ms per step, the output of the first GEMM) with the library set now: every GEMM timed
    once per distinct shape by `timer(fn) -> ms`, weighted by its calls."""
    total, first = 0.0, None
    for gemm in gemms:
        g = torch.Generator(device=device).manual_seed(gemm["m"] + gemm["n"])
        a = torch.randn(gemm["m"], gemm["k"], device=device, generator=g, dtype=torch.bfloat16)
        shape = (gemm["k"], gemm["n"]) if gemm["transposed"] else (gemm["n"], gemm["k"])
        w = torch.randn(*shape, device=device, generator=g, dtype=torch.bfloat16) * 0.02
        b = w if gemm["transposed"] else w.t()  # dy @ W slice, or x @ W_slice^T as int4_kernels does
        out = torch.empty(gemm["m"], gemm["ld"], device=device, dtype=torch.bfloat16)[:, : gemm["n"]]
        total += gemm["calls"] * timer(lambda: torch.mm(a, b, out=out))
        if first is None:
            first = out.float().clone()
    return total, first


def measure(torch, gemms: list[dict], device, timer, log) -> dict:
    """Each library set in turn through `torch.backends.cuda.preferred_blas_library`, its GEMMs
    timed; the preference is put back as it was. A library PyTorch will not use on this GPU (it
    falls back with a warning) is reported as not available, not timed."""
    held = torch.backends.cuda.preferred_blas_library()
    default = library_of(torch)
    step_ms, outputs, notes = {}, {}, {}
    try:
        for name in LIBRARIES:
            torch.backends.cuda.preferred_blas_library(name)
            if library_of(torch) != name:
                step_ms[name], notes[name] = None, f"PyTorch does not use {name} on this GPU"
                continue
            step_ms[name], outputs[name] = time_gemms(torch, gemms, device, timer)
            log(f"  {name}: {step_ms[name]:.1f} ms of block GEMMs per step")
    finally:
        torch.backends.cuda.preferred_blas_library(held)
    choice = pick(step_ms, default)
    if len(outputs) == 2:
        a, b = outputs[HIPBLAS], outputs[HIPBLASLT]
        difference = float((a - b).norm() / b.norm().clamp_min(1e-30))
        choice["max_relative_difference"] = difference
        if difference > AGREEMENT:
            choice = {"library": DEFAULT, "max_relative_difference": difference,
                      "reason": f"the two libraries' results differ by {difference:.1e} (limit {AGREEMENT:.0e})"}
    return {"ran": True, "default": default, "step_ms": step_ms, "notes": notes, **choice}


def resets(arch: str) -> str | None:
    """Why timing hipBLASLt could reset a GPU of `arch` (gfx1201, maybe with `:feature` suffixes), or None."""
    return next((why for prefix, why in RESETS.items() if arch.startswith(prefix)), None)


def check(torch, hip: bool, arch: str, cases: list[tuple], device, timer, log) -> dict:
    """The BLAS part of the report: measured on a ROCm GPU, skipped with the reason elsewhere; on an
    architecture where hipBLASLt reset GPUs, hipBLAS without timing either."""
    if device is None or not torch.cuda.is_available():
        return {"ran": False, "library": DEFAULT, "reason": "no GPU: nothing to choose"}
    if not hip:
        return {"ran": False, "library": DEFAULT, "reason": "NVIDIA: cuBLAS/cuBLASLt stay PyTorch's pick"}
    why = resets(arch)
    if why:
        return {"ran": False, "library": HIPBLAS, "reason": f"{arch}: hipBLASLt not timed, hipBLAS taken: {why}"}
    log("timing hipBLAS against hipBLASLt at the FLUX.2 block GEMMs of the 4-bit path")
    try:
        return measure(torch, gemm_cases(cases), device, timer, log)
    except Exception as error:  # a library that fails on this GPU is a finding, not a crash
        return {"ran": False, "library": DEFAULT, "reason": f"{type(error).__name__}: {error}"[:500]}
