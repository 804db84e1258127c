"""The project's qtypes in one table: what a qtype name means, from the preset to the kernel.

Each entry names the Linear class its transformer-block Linears become, the precision of their
activations, the default GEMM path, and the qtype whose quantized cache file it loads (int4_w4a8
is int4_fused's model with other matmuls, so both read one file). The trainer's quantize module
(`set_int4_activations`), the quantized cache (its key), the launcher's self-test (the kernel
it checks) and the launcher itself (through `launcher.in_trainer.qtypes`) read this table; no
other module spells these rules.

An Int4Linear holds its kernel choice (`Int4Kernel`) from load time: `configure_linears` sets
it once after the model is loaded, and nothing reads the environment per call. The environment
variables below are overrides of the defaults, read once by `kernel_for`; an argument given to
`kernel_for` (the self-test passes its candidate's) wins over them:

  INT4_LINEAR_VARIANT   chunked|fused   bf16 path: dequantize slices + vendor GEMM (default), or
                                        the fused Triton kernels
  INT4_LINEAR_KERNEL    0               the plain-PyTorch reference even on a GPU
  INT4_LINEAR_CHUNK_MIB 64              bf16 path: MiB of dequantized weight per slice
  INT4_W4A8_ACT         fp8|int8        int4_w4a8's 8-bit type (default: fp8 where the GPU has
                                        FP8 matrix units, NVIDIA sm89+ and AMD gfx12; int8 elsewhere)
  INT4_W4A8_GEMM        triton|scaled_mm  int4_w4a8's GEMM (scaled_mm: FP8 on NVIDIA only)
  INT4_W4A8_CHUNK_MIB   256             int4_w4a8: MiB of 8-bit weight per requantized slice

Stdlib-only at module level: the launcher reads the table without torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

BF16 = "bf16"
FP8 = "fp8"
INT8 = "int8"
EIGHT_BIT = "8bit"  # a qtype whose activations are fp8 or int8, chosen per device
INT4_VARIANTS = ("chunked", "fused")
W4A8_GEMMS = ("triton", "scaled_mm")
DEFAULT_CHUNK_MIB = 64


@dataclass(frozen=True)
class Qtype:
    name: str
    linear: str  # the class the block Linears become
    activations: str  # BF16 or EIGHT_BIT
    gemm: str  # the default GEMM path of those activations
    cache_qtype: str  # the qtype whose quantized cache file this one loads and writes
    chunk_mib: int  # the default weight slice of its sliced GEMM path


INT4_LINEAR = "toolkit.int4_linear.Int4Linear"
QTYPES = {
    spec.name: spec
    for spec in (
        Qtype("int4_fused", INT4_LINEAR, BF16, "chunked", "int4_fused", DEFAULT_CHUNK_MIB),
        # 256 MiB: a FLUX.2 block Linear in one or two slices. At 512 px the 8-bit path is bound by
        # kernel launches, and 64 MiB slices cost 13 % of a step (bench/RESULTS.md, "Slice size")
        Qtype("int4_w4a8", INT4_LINEAR, EIGHT_BIT, "triton", "int4_fused", 256),
    )
}


@dataclass(frozen=True)
class Int4Kernel:
    """How one Int4Linear multiplies: fixed when the model loads."""

    activations: str = BF16  # BF16, FP8 or INT8
    gemm: str = "chunked"  # bf16: an INT4_VARIANTS entry; 8-bit: a W4A8_GEMMS entry
    chunk_bytes: int = DEFAULT_CHUNK_MIB * 2**20  # weight slice of the sliced paths
    use_kernel: Optional[bool] = None  # None: the GPU kernels where they run, else the reference


def cache_qtype(name: str) -> str:
    """The qtype whose quantized cache `name` uses (itself for every qtype not in the table)."""
    spec = QTYPES.get(name)
    return spec.cache_qtype if spec else name


def _chunk_bytes(environ: Mapping[str, str], variable: str, default_mib: int) -> int:
    text = environ.get(variable, str(default_mib)).strip()
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{variable}={text!r}: a whole number of MiB, at least 1 (default {default_mib})")
    return int(text) * 2**20


def _pick(value: str, choices: tuple, what: str) -> str:
    value = value.strip().lower()
    if value not in choices:
        raise ValueError(f"{what}={value!r}: pick one of {', '.join(choices)}")
    return value


def sm_number(arch: str) -> int:
    """"sm_89" -> 89, "sm_120" -> 120 (major * 10 + minor); 0 for an AMD arch."""
    digits = arch[3:].rstrip("abf") if arch.startswith("sm_") else ""
    return int(digits) if digits.isdigit() else 0


def arch_has_fp8_units(arch: str) -> bool:
    """Whether `arch` multiplies FP8 e4m3 in its matrix units: NVIDIA sm_89 and newer (Ada, Hopper,
    Blackwell) and AMD RDNA4 (gfx12: v_wmma_f32_16x16x16_fp8_fp8). RDNA3 (gfx11) and Ampere have
    none: Triton widens FP8 to fp16 there (gfx11: v_wmma_f32_16x16x16_f16). CDNA3's FP8 (gfx94x) is the
    fnuz variant, not the e4m3fn these kernels store."""
    return sm_number(arch) >= 89 or arch.startswith("gfx12")


def device_arch(device=None) -> str:
    """A GPU's arch name as the compilers spell it: "gfx1100" on ROCm (gcnArchName without its
    feature suffix), "sm_89" on CUDA."""
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device)
    if _is_hip():
        return props.gcnArchName.split(":")[0]
    return f"sm_{props.major}{props.minor}"


def has_fp8_units(device=None) -> bool:
    """The current (or the given) GPU has FP8 matrix units (`arch_has_fp8_units`)."""
    import torch

    if not torch.cuda.is_available():
        return False
    device = torch.device("cuda") if device is None else torch.device(device)
    return device.type == "cuda" and arch_has_fp8_units(device_arch(device))


def _is_hip() -> bool:
    import torch

    return bool(getattr(torch.version, "hip", None))


def kernel_for(name: str, device=None, *, activations: Optional[str] = None, gemm: Optional[str] = None,
               use_kernel: Optional[bool] = None, chunk_bytes: Optional[int] = None,
               environ: Optional[Mapping[str, str]] = None) -> Int4Kernel:
    """The kernel choice of qtype `name` on `device` (default: the current CUDA/ROCm device):
    explicit arguments first, then the environment's overrides, then the table's defaults."""
    spec = QTYPES.get(name)
    if spec is None:
        raise ValueError(f"qtype {name!r} has no 4-bit Linear kernel; the table knows {', '.join(QTYPES)}")
    env = os.environ if environ is None else environ
    if use_kernel is None and env.get("INT4_LINEAR_KERNEL", "1").strip() == "0":
        use_kernel = False
    if spec.activations == BF16:
        return Int4Kernel(BF16, _pick(gemm or env.get("INT4_LINEAR_VARIANT") or spec.gemm, INT4_VARIANTS,
                                      "INT4_LINEAR_VARIANT"),
                          chunk_bytes or _chunk_bytes(env, "INT4_LINEAR_CHUNK_MIB", spec.chunk_mib), use_kernel)
    chosen = activations or env.get("INT4_W4A8_ACT", "").strip()
    fmt = _pick(chosen, (FP8, INT8), "INT4_W4A8_ACT") if chosen else (FP8 if has_fp8_units(device) else INT8)
    path = _pick(gemm or env.get("INT4_W4A8_GEMM") or spec.gemm, W4A8_GEMMS, "INT4_W4A8_GEMM")
    if path == "scaled_mm" and (fmt != FP8 or _is_hip()):
        raise ValueError("INT4_W4A8_GEMM=scaled_mm needs FP8 activations on an NVIDIA GPU")
    return Int4Kernel(fmt, path, chunk_bytes or _chunk_bytes(env, "INT4_W4A8_CHUNK_MIB", spec.chunk_mib), use_kernel)


def configure_linears(model, name: str, device=None, **choice) -> int:
    """After loading (from the checkpoint or the quantized cache): every Int4Linear of `model`
    takes qtype `name`'s kernel, resolved once here. Returns how many run 8-bit activations;
    a qtype outside the table has no Int4Linear and leaves the model alone."""
    if name not in QTYPES:
        return 0
    from toolkit.int4_linear import Int4Linear

    kernel = kernel_for(name, device, **choice)
    count = 0
    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.kernel = kernel
            count += kernel.activations != BF16
    return count
