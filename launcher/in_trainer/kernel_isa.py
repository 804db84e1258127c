#!/usr/bin/env python3
"""The 4-bit Linear's Triton kernels compiled for consumer GPUs, on the CPU: what the compiler
made of each. Runs in the trainer's venv with its `toolkit` importable (the tests' trainer
checkout, or bench/kernel_isa.py's --trainer folder).

Triton's AMD and NVIDIA backends compile without a GPU (`triton.compile` with a GPUTarget), so the
machine code of toolkit/int4_kernels.py and toolkit/int4_w4a8.py can be checked for cards nobody
here has: RDNA3 (gfx1100 RX 7900, gfx1101 RX 7800/7700), RDNA4 (gfx1201 RX 9070) and NVIDIA
Ampere/Ada/Blackwell consumer parts (sm_86, sm_89, sm_120). Each kernel is compiled with every
config the runtime would autotune over on that arch (int4_w4a8's `gemm_configs(arch)`,
`in_register_configs(arch, fp8)`) and in
every 8-bit format the arch would run (`qtypes.arch_has_fp8_units`); `measure_all` returns, per
target, kernel, variant and config:

  instructions   AMD: the v_wmma_* / v_mfma_* of the AMDGCN; NVIDIA: the mma / wgmma of the PTX
                 (static counts in the code)
  registers      AMD: .vgpr_count / .sgpr_count of the kernel's metadata note; NVIDIA: `ptxas -v`
                 (the ptxas Triton bundles and uses for that arch)
  spill          AMD: .private_segment_fixed_size (scratch per lane) and the VGPR/SGPR spill counts;
                 NVIDIA: ptxas's stack frame and spill stores + loads
  shared memory  Triton's dynamic allocation (metadata `shared`) plus any static LDS
                 (.group_segment_fixed_size), against the arch's per-block limit
  occupancy      AMD: waves per SIMD = min(16, 1536 // (VGPRs rounded up to 24)) on wave32 RDNA3/4
                 (LLVM's AMDGPUBaseInfo: getTotalNumVGPRs 1536 with the full register file,
                 getVGPRAllocGranule 24, getMaxWavesPerEU 16 on gfx10.3+), next to LLVM's own
                 "; Occupancy:" comment in the assembly. NVIDIA: resident warps per SM from registers
                 (65536 per SM, allocated per warp in units of 256), shared memory per SM (plus 1 KiB
                 reserved per block) and the SM's warp limit (CUDA C++ Programming Guide, "Technical
                 Specifications per Compute Capability").

Compiling is CPU work, about a second a kernel; Triton's cache (TRITON_CACHE_DIR) keeps results.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

TARGETS = ("gfx1100", "gfx1101", "gfx1201", "sm_86", "sm_89", "sm_120")
KIB = 1024

SHARED_LIMIT = {"gfx1100": 64 * KIB, "gfx1101": 64 * KIB, "gfx1201": 64 * KIB,
                "sm_86": 99 * KIB, "sm_89": 99 * KIB, "sm_120": 99 * KIB, "sm_90": 227 * KIB}
"""Shared memory one workgroup / thread block may use: 64 KiB of LDS on RDNA3/4 (RDNA3 ISA guide,
"Local Data Share"), the opt-in per-block maximum on NVIDIA (CUDA guide, compute capabilities 8.6,
8.9 and 12.0: 99 KiB; 9.0: 227 KiB)."""

NVIDIA_SM = {"sm_86": (100 * KIB, 48), "sm_89": (100 * KIB, 48), "sm_120": (100 * KIB, 48), "sm_90": (228 * KIB, 64)}
"""Per SM: shared memory (KiB) and resident warps (CUDA guide, compute capabilities)."""

GEMMS = ("_scaled_gemm_kernel", "_in_register_gemm_kernel")
"""The 8-bit GEMMs: each must run on the matrix units of its format."""

RDNA_VGPRS, RDNA_GRANULE, RDNA_MAX_WAVES = 1536, 24, 16
MATRIX = re.compile(r"\b(v_wmma_\w+|v_mfma_\w+|v_swmmac_\w+)|\b((?:mma|wgmma\.mma_async)(?:\.[\w:]+)+)")
FP8_MATRIX = re.compile(r"fp8|bf8|e4m3|e5m2|f8f6f4")


@dataclass
class Job:
    """One compile: a kernel, the arguments that select its variant, one config."""

    kernel: str
    variant: str
    config: str
    fn: object
    signature: dict
    aligned: tuple  # arguments the runtime sees 16-aligned (pointers, strides, widths)
    constexprs: dict
    options: dict = field(default_factory=dict)


def jit_function(kernel):
    """The JITFunction under triton.autotune / triton.heuristics wrappers."""
    from triton.runtime.jit import JITFunction

    while not isinstance(kernel, JITFunction):
        kernel = kernel.fn
    return kernel


def config_label(config) -> str:
    shape = "x".join(str(v) for k, v in config.kwargs.items() if k.startswith("BLOCK_"))
    extra = " ".join(f"{k}={v}" for k, v in config.kwargs.items() if not k.startswith("BLOCK_") and k != "GROUP_M")
    return f"{shape} {extra} w{config.num_warps} s{config.num_stages}".replace("  ", " ")


def formats(arch: str) -> list[str]:
    """The 8-bit formats the runtime may pick on `arch`: FP8 only with FP8 matrix units."""
    from flux2_contract import qtypes

    return [qtypes.FP8, qtypes.INT8] if qtypes.arch_has_fp8_units(arch) else [qtypes.INT8]


def jobs(arch: str) -> list[Job]:
    """Every kernel of the two modules, in every variant and config the runtime uses on `arch`."""
    from toolkit import int4_kernels as ik
    from toolkit import int4_w4a8 as w
    from flux2_contract import qtypes

    found = []
    weight = {"qw_ptr": "*u8", "s_ptr": "*bf16", "z_ptr": "*u8"}
    found.append(Job("_dequant_kernel", "bf16", "64 rows w4", ik._dequant_kernel,
                     {**weight, "out_ptr": "*bf16", "N": "i32", "g_first": "i32", "stride_qn": "i32",
                      "stride_sn": "i32", "stride_on": "i32"},
                     ("qw_ptr", "s_ptr", "z_ptr", "out_ptr", "stride_qn", "stride_on"),
                     {"GROUP": ik.GROUP_SIZE, "BLOCK_R": 64}, {"num_warps": 4}))
    for fmt in formats(arch):
        code = "*fp8e4nv" if fmt == qtypes.FP8 else "*i8"
        eight = {"QMAX": w.QMAX[fmt], "FP8": fmt == qtypes.FP8}
        found.append(Job("_quantize_rows_kernel", fmt, "1024 w4", w._quantize_rows_kernel,
                         {"x_ptr": "*bf16", "q_ptr": code, "s_ptr": "*fp32", "K": "i32", "stride_x": "i32",
                          "stride_q": "i32"}, ("x_ptr", "q_ptr", "s_ptr", "stride_x", "stride_q"),
                         {**eight, "BLOCK": 1024}, {"num_warps": 4}))
        for per_column in (False, True):
            found.append(Job("_requantize_kernel", f"{fmt} {'per column' if per_column else 'per row'}", "64 rows w4",
                             w._requantize_kernel,
                             {**weight, "inv_ptr": "*fp32", "out_ptr": code, "N": "i32", "g_first": "i32",
                              "stride_qn": "i32", "stride_sn": "i32", "stride_out": "i32"},
                             ("qw_ptr", "s_ptr", "z_ptr", "inv_ptr", "out_ptr", "stride_qn", "stride_out"),
                             {**eight, "PER_COLUMN": per_column, "GROUP": ik.GROUP_SIZE, "BLOCK_R": 64},
                             {"num_warps": 4}))
        for config in w.gemm_configs(arch):
            found.append(Job("_scaled_gemm_kernel", fmt, config_label(config), jit_function(w._scaled_gemm_kernel),
                             {"a_ptr": code, "b_ptr": code, "c_ptr": "*bf16", "sa_ptr": "*fp32", "sb_ptr": "*fp32",
                              "M": "i32", "N": "i32", "K": "i32", "stride_am": "i32", "stride_bn": "i32",
                              "stride_cm": "i32"},
                             ("a_ptr", "b_ptr", "c_ptr", "sa_ptr", "sb_ptr", "N", "K", "stride_am", "stride_bn",
                              "stride_cm"),
                             {"FP8": fmt == qtypes.FP8, **config.kwargs},
                             {"num_warps": config.num_warps, "num_stages": config.num_stages}))
        for config in w.in_register_configs(arch, fmt == qtypes.FP8):
            found.append(Job("_in_register_gemm_kernel", fmt, config_label(config),
                             jit_function(w._in_register_gemm_kernel),
                             {"a_ptr": code, **weight, "c_ptr": "*bf16", "sa_ptr": "*fp32", "M": "i32", "N": "i32",
                              "K": "i32", "stride_am": "i32", "stride_qn": "i32", "stride_sn": "i32",
                              "stride_cm": "i32"},
                             ("a_ptr", "qw_ptr", "s_ptr", "z_ptr", "c_ptr", "sa_ptr", "K", "stride_am", "stride_qn",
                              "stride_cm"),
                             {"FP8": fmt == qtypes.FP8, "GROUP": ik.GROUP_SIZE, **config.kwargs},
                             {"num_warps": config.num_warps, "num_stages": config.num_stages}))
    return found


def kernels_of_modules() -> set[str]:
    """Names of every @triton.jit kernel (a function named *_kernel) of the two modules."""
    from toolkit import int4_kernels as ik
    from toolkit import int4_w4a8 as w

    return {name for module in (ik, w) for name, value in vars(module).items()
            if name.endswith("_kernel") and hasattr(value, "run")}


def gpu_target(arch: str):
    from triton.backends.compiler import GPUTarget

    if arch.startswith("gfx"):
        return GPUTarget("hip", arch, 32)
    return GPUTarget("cuda", int(arch[3:]), 32)


def backend_class(arch: str):
    if arch.startswith("gfx"):
        from triton.backends.amd.compiler import HIPBackend

        return HIPBackend
    from triton.backends.nvidia.compiler import CUDABackend

    return CUDABackend


def compile_job(job: Job, arch: str):
    import triton

    backend = backend_class(arch)
    names = job.fn.arg_names
    signature = {name: job.signature.get(name, "constexpr") for name in names}
    attrs = {(names.index(name),): backend.parse_attr("D") for name in job.aligned}
    source = triton.compiler.ASTSource(fn=job.fn, signature=signature, constexprs=job.constexprs, attrs=attrs)
    return triton.compile(source, target=gpu_target(arch), options=job.options)


def note_field(asm: str, key: str) -> int:
    found = re.search(rf"^\s*\.{key}:\s*(\d+)", asm, re.M)
    return int(found.group(1)) if found else 0


def matrix_instructions(text: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for match in MATRIX.finditer(text):
        name = match.group(1) or match.group(2)
        counts[name] = counts.get(name, 0) + 1
    return counts


def rdna_waves(vgprs: int) -> int:
    """Waves per SIMD a wave32 RDNA3/4 kernel of `vgprs` VGPRs can keep resident."""
    granules = -(-max(vgprs, 1) // RDNA_GRANULE)
    return min(RDNA_MAX_WAVES, RDNA_VGPRS // (granules * RDNA_GRANULE))


def amd_row(compiled) -> dict:
    asm = compiled.asm["amdgcn"]
    occupancy = re.search(r";\s*Occupancy:\s*(\d+)", asm)
    vgprs = note_field(asm, "vgpr_count")
    return {"instructions": matrix_instructions(asm), "registers": vgprs, "sgprs": note_field(asm, "sgpr_count"),
            "scratch_bytes": note_field(asm, "private_segment_fixed_size"),
            "spilled": note_field(asm, "vgpr_spill_count") + note_field(asm, "sgpr_spill_count"),
            "shared_bytes": note_field(asm, "group_segment_fixed_size") + compiled.metadata.shared,
            "occupancy": rdna_waves(vgprs), "compiler_occupancy": int(occupancy.group(1)) if occupancy else None}


def ptxas_report(ptx: str, arch: str) -> dict:
    """Registers, stack frame and spill bytes from `ptxas -v` for `arch` (the ptxas Triton uses)."""
    from triton.backends.nvidia.compiler import get_ptxas

    tool = get_ptxas(int(arch[3:])).path
    gpu_name = re.search(r"^\.target (\w+)", ptx, re.M).group(1)  # Triton's: sm_120a, sm_90a
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx, encoding="utf-8")
        done = subprocess.run([tool, "-v", f"--gpu-name={gpu_name}", str(source), "-o", str(Path(folder) / "kernel.o")],
                              capture_output=True, text=True, encoding="utf-8", errors="replace")
    if done.returncode:
        raise RuntimeError(f"ptxas for {gpu_name}: {done.stderr.strip()[-300:]}")
    log = done.stderr

    def number(pattern):
        found = re.search(pattern, log)
        return int(found.group(1)) if found else 0

    return {"registers": number(r"Used (\d+) registers"), "stack": number(r"(\d+) bytes stack frame"),
            "spill": number(r"(\d+) bytes spill stores") + number(r"(\d+) bytes spill loads")}


def nvidia_warps(registers: int, shared: int, num_warps: int, arch: str) -> int:
    """Resident warps per SM of a kernel with `registers` per thread and `shared` bytes per block."""
    shared_per_sm, max_warps = NVIDIA_SM[arch]
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    blocks = min(65536 // per_warp // num_warps, max_warps // num_warps,
                 shared_per_sm // (shared + KIB) if shared else max_warps)
    return blocks * num_warps


def nvidia_row(compiled, arch: str, num_warps: int) -> dict:
    ptx = compiled.asm["ptx"]
    report = ptxas_report(ptx, arch)
    shared = compiled.metadata.shared
    return {"instructions": matrix_instructions(ptx), "registers": report["registers"], "sgprs": None,
            "scratch_bytes": report["stack"], "spilled": report["spill"], "shared_bytes": shared,
            "occupancy": nvidia_warps(report["registers"], shared, num_warps, arch), "compiler_occupancy": None}


def measure(job: Job, arch: str) -> dict:
    """One compile's figures; an `error` instead where the toolchain refused the kernel."""
    row = {"target": arch, "kernel": job.kernel, "variant": job.variant, "config": job.config,
           "shared_limit": SHARED_LIMIT[arch]}
    try:
        compiled = compile_job(job, arch)
        figures = amd_row(compiled) if arch.startswith("gfx") else nvidia_row(compiled, arch, job.options["num_warps"])
    except Exception as error:  # recorded, and every check treats it as a failure
        return {**row, "error": f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"}
    return {**row, **figures, "error": None}


def measure_all(targets=TARGETS) -> list[dict]:
    return [measure(job, arch) for arch in targets for job in jobs(arch)]


def uses_fp8_matrix(row: dict) -> bool:
    return any(FP8_MATRIX.search(name) for name in row.get("instructions") or {})


def problems(row: dict) -> list[str]:
    """What is wrong with one compiled kernel; empty when nothing is."""
    from flux2_contract import qtypes

    if row["error"]:
        return [row["error"]]
    found = []
    if row["scratch_bytes"] or row["spilled"]:
        found.append(f"spills ({row['scratch_bytes']} B scratch/stack, {row['spilled']} spilled)")
    if row["shared_bytes"] > row["shared_limit"]:
        found.append(f"{row['shared_bytes']} B of shared memory, over the {row['shared_limit']} B limit")
    if uses_fp8_matrix(row) and not qtypes.arch_has_fp8_units(row["target"]):
        found.append("FP8 matrix instructions on an arch without FP8 matrix units")
    if row["kernel"] in GEMMS and row["variant"] == qtypes.INT8 and row["target"].startswith("gfx1"):
        if "v_wmma_i32_16x16x16_iu8" not in row["instructions"]:
            found.append("no int8 WMMA (v_wmma_i32_16x16x16_iu8)")
    return found
