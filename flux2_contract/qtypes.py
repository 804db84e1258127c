"""The project's qtypes in one table: what a qtype name means, from the preset to the kernel.

Each entry names the Linear class its transformer-block Linears become, the precision of their
activations, the default GEMM path, the qtype whose quantized cache file it loads (int4_w4a8 is
int4_fused's model with other matmuls, so both read one file) and how far its GPU kernels may
stray from their reference path. The trainer's quantize module, the quantized cache (its key and
backend), the memory plan (which qtypes stream), the launcher's self-test (the kernels it checks,
their tolerance) and the launcher itself (`launcher/selftest/verdict.py`: what `qtype: auto` may
become) read this table; no other module spells these rules.

An Int4Linear holds its kernel choice (`Int4Kernel`) from load time: `kernel_for` makes it once
from the run's model_kwargs (`w4a8_activations`, `w4a8_gemm`, `int4_chunk_mib`, `int4_kernel`:
flux2_contract/settings.py), and nothing reads the environment or the config per call.

Stdlib-only at module level: the launcher reads the table without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from .settings import read

BF16 = "bf16"
FP8 = "fp8"
INT8 = "int8"
EIGHT_BIT = "8bit"  # a qtype whose activations are fp8 or int8, chosen per device
CHUNKED = "chunked"  # the bf16 path: dequantize a slice of W, then the vendor GEMM
IN_REGISTER = "in_register"  # 8-bit GEMM that reads the 4-bit weight itself (forward; the input gradient: sliced)
DEFAULT_CHUNK_MIB = 64


@dataclass(frozen=True)
class Qtype:
    name: str
    linear: str  # the class the block Linears become
    activations: str  # BF16 or EIGHT_BIT
    gemm: str  # the default GEMM path of those activations
    cache_qtype: str  # the qtype whose quantized cache file this one loads and writes
    chunk_mib: int  # the default weight slice of its sliced GEMM path
    tolerance: float  # largest relative (Frobenius) difference of its GPU kernels from the reference:
    # the same codes, summed in another fp32 order; for 8-bit activations also the rare activation
    # code on a rounding tie (the kernel divides in Triton, the reference in torch)


INT4_LINEAR = "toolkit.int4_linear.Int4Linear"
QTYPES = {
    spec.name: spec
    for spec in (
        Qtype("int4_fused", INT4_LINEAR, BF16, CHUNKED, "int4_fused", DEFAULT_CHUNK_MIB, 1e-2),
        # 256 MiB: a FLUX.2 block Linear in one or two slices. At 512 px the 8-bit path is bound by
        # kernel launches, and 64 MiB slices cost 13 % of a step (bench/RESULTS.md, "Slice size")
        Qtype("int4_w4a8", INT4_LINEAR, EIGHT_BIT, "triton", "int4_fused", 256, 2e-2),
    )
}
STREAMABLE = tuple(QTYPES)
"""The qtypes whose blocks a memory plan can stream (plain tensors in an Int4Linear): `qtype: auto`
picks among these, and the fastest the self-test passed, where the plan may stream."""
STREAMING_FALLBACK = "int4_fused"
"""What `qtype: auto` becomes where no kernel passed the self-test and a memory plan may stream
blocks: the table's bf16 qtype, whose plain-PyTorch path runs on any device."""
FALLBACK = "uint4"
"""The fork's own torchao 4-bit path: what `qtype: auto` becomes where no kernel of the table passed
the self-test and nothing streams. Its 4-bit codes equal int4_fused's, so a run may change between
them on a resume (`same_codes`)."""


@dataclass(frozen=True)
class Int4Kernel:
    """How one Int4Linear multiplies: fixed when the model loads."""

    activations: str = BF16  # BF16, FP8 or INT8
    gemm: str = CHUNKED  # bf16: CHUNKED; 8-bit: triton, scaled_mm or in_register
    chunk_bytes: int = DEFAULT_CHUNK_MIB * 2**20  # weight slice of the sliced paths
    use_kernel: Optional[bool] = None  # None: the GPU kernels where they run, else the reference


def has_eight_bit_kernel(name: str) -> bool:
    """Whether qtype `name` multiplies 8-bit activations, whose kernel (`w4a8_activations`,
    `w4a8_gemm`) `run` picks per device where a preset leaves it to `auto`."""
    spec = QTYPES.get(name)
    return spec is not None and spec.activations == EIGHT_BIT


def cache_qtype(name: str) -> str:
    """The qtype whose quantized cache `name` uses (itself for every qtype not in the table)."""
    spec = QTYPES.get(name)
    return spec.cache_qtype if spec else name


def same_codes(old: str, new: str) -> bool:
    """Whether a LoRA trained on qtype `old` may go on training on `new`: the same 4-bit codes of
    the same base weights (uint4 and every qtype of the table), only other matmuls."""
    four_bit = {FALLBACK, *QTYPES}
    return old in four_bit and new in four_bit


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


def kernel_for(name: str, model_kwargs: Optional[Mapping] = None, device=None) -> Int4Kernel:
    """The kernel of qtype `name` on `device` (default: the current CUDA/ROCm device), from the
    run's model_kwargs (the self-test passes its candidate's) and the table's defaults."""
    spec = QTYPES.get(name)
    if spec is None:
        raise ValueError(f"qtype {name!r} has no 4-bit Linear kernel; the table knows {', '.join(QTYPES)}")
    model_kwargs = model_kwargs or {}
    use_kernel = None if read(model_kwargs, "int4_kernel") else False
    chunk_bytes = (read(model_kwargs, "int4_chunk_mib") or spec.chunk_mib) * 2**20
    if spec.activations == BF16:
        return Int4Kernel(BF16, CHUNKED, chunk_bytes, use_kernel)
    fmt = read(model_kwargs, "w4a8_activations") or (FP8 if has_fp8_units(device) else INT8)
    gemm = read(model_kwargs, "w4a8_gemm")
    if gemm == "scaled_mm" and (fmt != FP8 or _is_hip()):
        raise ValueError("model_kwargs w4a8_gemm: scaled_mm needs w4a8_activations: fp8 on an NVIDIA GPU")
    return Int4Kernel(fmt, gemm, chunk_bytes, use_kernel)
