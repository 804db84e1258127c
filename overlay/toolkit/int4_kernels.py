"""The 4-bit weight format and the GPU kernels of toolkit/int4_linear.py's Int4Linear.

The weight W[out, in] is stored as unsigned 4-bit codes with one scale and one
zero point per group of ``GROUP_SIZE`` (64) consecutive input features, the
numerics of torchao's ``UIntXWeightOnlyConfig(torch.uint4)`` (the fork's
``qtype: uint4``): asymmetric, range widened to include 0, scale in the
weight's dtype, ``W ~= (q - zero) * scale``.

Storage (all row-major, contiguous):
  qweight  uint8 [out, in // 2]   byte j of a row holds input feature 2j in the
                                  low nibble and 2j + 1 in the high nibble
  scale    float [out, in // 64]  (bf16 for bf16 weights)
  zero     uint8 [out, in // 64]  0..15

Ways to run the matmuls (the module's `Int4Kernel`, flux2_contract/qtypes.py, picks one at load time):
  * on a GPU (CUDA or ROCm, bf16/fp16 activations, fp32 accumulation): a Triton
    kernel dequantizes W a slice at a time into a small buffer (the Int4Kernel's
    chunk_bytes, 64 MiB by default) and cuBLAS/rocBLAS multiplies each slice. The bf16
    weight never exists whole (torchao's uint4 path builds it whole, through
    int32 temporaries, per call) and the vendor GEMM does the heavy part: on an
    H200, summed over one training step's FLUX.2 block Linears, 1.17-1.29x the
    time of bf16 weights, against 1.75-3.35x for torchao;
  * a plain PyTorch reference (dequantize, then matmul) that runs anywhere,
    including the CPU, and is the correctness oracle for the kernels.

The kernels use Triton's portable language only (no inline assembly, no
vendor intrinsics, nothing Hopper-specific requested), so the same source is
meant to run on ROCm (RDNA3 gfx1100) as on CUDA. `config_family` and `tuning_arch`
choose the autotuning lists of toolkit/int4_w4a8.py's GEMM per arch: RDNA and consumer
NVIDIA get lists that neither spill registers nor overflow shared memory there
(bench/kernel_isa.py compiles them on the CPU).
Tested: NVIDIA H200 (CUDA 13, Triton 3.6) and Triton's CPU interpreter (fp16). Not tested:
any AMD GPU, bf16 under the interpreter (the interpreter itself mishandles bf16).
"""

from __future__ import annotations

import os

import torch

from flux2_contract.qtypes import DEFAULT_CHUNK_MIB, device_arch, sm_number

GROUP_SIZE = 64
QMAX = 15  # unsigned 4-bit codes 0..15

try:  # Triton is optional: without it (CPU-only installs) the reference path runs.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    triton = None
    tl = None
    HAVE_TRITON = False


# --------------------------------------------------------------------------- pack / quantize


def pack_uint4(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes in 0..15 -> [..., n] uint8, even index in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_uint4 needs an even last dimension, got {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_uint4(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] uint8 -> [..., 2n] uint8 codes in 0..15 (inverse of pack_uint4)."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def quantize_weight(weight: torch.Tensor, group_size: int = GROUP_SIZE):
    """Quantize W[out, in] -> (qweight, scale, zero) in the layout above.

    Mirrors torchao 0.10's asymmetric affine quantization (preserve_zero,
    integer zero point) in the weight's own dtype, so the codes match the
    fork's ``qtype: uint4`` and the quantization error is the same.
    """
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"expected a floating-point weight, got {weight.dtype}")
    out_f, in_f = weight.shape
    if in_f % group_size or group_size % 2:
        raise ValueError(
            f"in_features={in_f} is not a multiple of the group size {group_size}; "
            "leave this layer unquantized or pick another group size"
        )
    w = weight.detach().reshape(out_f, in_f // group_size, group_size)
    min_neg = torch.clamp(w.amin(dim=-1), max=0)
    max_pos = torch.clamp(w.amax(dim=-1), min=0)
    scale = (max_pos - min_neg) / float(QMAX)
    scale = torch.clamp(scale, min=torch.finfo(torch.float32).eps)
    zero = torch.clamp(-torch.round(min_neg / scale), 0, QMAX)
    codes = torch.clamp(torch.round(w * (1.0 / scale[..., None])) + zero[..., None], 0, QMAX)
    codes = codes.reshape(out_f, in_f).to(torch.uint8)
    return pack_uint4(codes).contiguous(), scale.contiguous(), zero.to(torch.uint8).contiguous()


def dequantize_weight(qweight, scale, zero, group_size: int = GROUP_SIZE, dtype=None) -> torch.Tensor:
    """(qweight, scale, zero) -> W[out, in] in ``dtype`` (default: the scale's dtype).

    Computes (q - zero) * scale with q - zero exact, so the result rounds the
    same way as torchao's dequantize and as the kernels.
    """
    dtype = dtype or scale.dtype
    out_f = qweight.shape[0]
    codes = unpack_uint4(qweight).reshape(out_f, -1, group_size)
    centred = codes.to(torch.int16) - zero.to(torch.int16)[..., None]
    w = centred.to(dtype) * scale.to(dtype)[..., None]
    return w.reshape(out_f, -1)


# --------------------------------------------------------------------------- Triton kernels

SMALL_SHARED_MEMORY = (86, 89, 120, 121)
"""NVIDIA archs (sm_number) whose thread blocks get at most 99 KiB of shared memory, against 163-227 KiB
on the data-centre parts (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability")."""


def config_family(arch: str) -> str:
    """Which autotuning lists an arch gets: "amd" (sized for RDNA3/4: wave32, 64 KiB of LDS per
    workgroup, 1536 VGPRs per lane), "nvidia_99k" (consumer NVIDIA) or "nvidia" (H100/H200, A100)."""
    if arch.startswith("gfx"):
        return "amd"
    return "nvidia_99k" if sm_number(arch) in SMALL_SHARED_MEMORY else "nvidia"


def tuning_arch() -> str:
    """The arch the autotuned kernels are built for at import: the current GPU's, or where none is
    visible (CPU installs, Triton's interpreter) sm_90 on CUDA builds and gfx1100 on ROCm builds."""
    if torch.cuda.is_available():
        return device_arch()
    return "gfx1100" if getattr(torch.version, "hip", None) else "sm_90"


if HAVE_TRITON:

    @triton.jit
    def _swizzle(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        # groups of GROUP_M row-tiles walk the columns together, so weight tiles are reused from L2
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        num_pid_in_group = GROUP_M * num_pid_n
        group_id = pid // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
        pid_n = (pid % num_pid_in_group) // group_size_m
        return pid_m, pid_n


    # ---- one quantization group of weight rows: packed bytes loaded contiguously, unpacked with tl.interleave

    @triton.jit
    def _unpack_dequant(b, s, z, dtype: tl.constexpr):
        # b: [R, GROUP // 2] packed bytes of one group per row; s, z: [R] -> [R, GROUP] in dtype
        q = tl.interleave(b & 0xF, b >> 4).to(tl.float32)
        return ((q - z.to(tl.float32)[:, None]) * s.to(tl.float32)[:, None]).to(dtype)

    @triton.jit
    def _group_of_rows(qw_ptr, s_ptr, z_ptr, rows, g, N, stride_qn, stride_sn, dtype: tl.constexpr,
                       GROUP: tl.constexpr):
        # group g of the weight rows `rows` (those < N; the others read as 0) -> [R, GROUP] in dtype
        live = rows < N
        rows64 = rows.to(tl.int64)
        b = tl.load(qw_ptr + (rows64 * stride_qn)[:, None] + (g * (GROUP // 2) + tl.arange(0, GROUP // 2))[None, :],
                    mask=live[:, None], other=0)
        s = tl.load(s_ptr + rows64 * stride_sn + g, mask=live, other=0.0)
        z = tl.load(z_ptr + rows64 * stride_sn + g, mask=live, other=0)
        return _unpack_dequant(b, s, z, dtype)

    @triton.jit
    def _dequant_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, g_first, stride_qn, stride_sn, stride_on,
                        GROUP: tl.constexpr, BLOCK_R: tl.constexpr):
        # out[r, j*GROUP:(j+1)*GROUP] = W[r, (g_first+j)*GROUP : ...] for BLOCK_R rows, group j
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        j = tl.program_id(1)
        live = rows < N
        rows64 = rows.to(tl.int64)
        w = _group_of_rows(qw_ptr, s_ptr, z_ptr, rows, g_first + j, N, stride_qn, stride_sn,
                           out_ptr.dtype.element_ty, GROUP)
        offs_k = j * GROUP + tl.arange(0, GROUP)
        tl.store(out_ptr + (rows64 * stride_on)[:, None] + offs_k[None, :], w, mask=live[:, None])



KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def kernel_available(x: torch.Tensor) -> bool:
    """True when the Triton kernels can run this input (GPU tensor, bf16/fp16, Triton present)."""
    if not HAVE_TRITON:
        return False
    if x.device.type != "cuda" and not os.environ.get("TRITON_INTERPRET") == "1":
        return False  # torch names ROCm devices "cuda" too
    return x.dtype in KERNEL_DTYPES


def _check(qweight, scale, zero, group_size):
    if group_size != GROUP_SIZE:
        raise ValueError(f"the kernels are built for group size {GROUP_SIZE}, got {group_size}")
    for name, t in (("qweight", qweight), ("scale", scale), ("zero", zero)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def _shapes(a2d, qweight, group_size, what):
    M, F = a2d.shape
    N, K = qweight.shape[0], qweight.shape[1] * 2
    expect = K if what == "fwd" else N
    if F != expect:
        raise ValueError(f"input has {F} features, the 4-bit weight [{N}, {K}] expects {expect}")
    return M, N, K


def dequantize_slice(qweight, scale, zero, out, row0=0, group0=0, group_size: int = GROUP_SIZE):
    """Triton: write W[row0:row0+out.shape[0], group0*g : group0*g+out.shape[1]] into ``out``."""
    rows, cols = out.shape
    grid = (triton.cdiv(rows, 64), cols // group_size)
    _dequant_kernel[grid](qweight[row0:], scale[row0:], zero[row0:], out, rows, group0,
                          qweight.stride(0), scale.stride(0), out.stride(0), GROUP=group_size, BLOCK_R=64,
                          num_warps=4)
    return out


def int4_matmul_fwd(x2d: torch.Tensor, qweight, scale, zero, group_size: int = GROUP_SIZE,
                    chunk_bytes: int = DEFAULT_CHUNK_MIB * 2**20) -> torch.Tensor:
    """GPU: x2d[M, K] @ W^T -> [M, N] in x2d's dtype, at most chunk_bytes of W dequantized at once."""
    _check(qweight, scale, zero, group_size)
    x2d = x2d.contiguous()
    M, N, K = _shapes(x2d, qweight, group_size, "fwd")
    y = torch.empty((M, N), device=x2d.device, dtype=x2d.dtype)
    if M == 0:
        return y
    rows = max(64, (chunk_bytes // (2 * K)) // 64 * 64)
    buf = torch.empty((min(rows, N), K), device=x2d.device, dtype=x2d.dtype)
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        w = dequantize_slice(qweight, scale, zero, buf[: n1 - n0], row0=n0, group_size=group_size)
        torch.mm(x2d, w.t(), out=y[:, n0:n1])
    return y


def int4_matmul_bwd(dy2d: torch.Tensor, qweight, scale, zero, group_size: int = GROUP_SIZE,
                    chunk_bytes: int = DEFAULT_CHUNK_MIB * 2**20) -> torch.Tensor:
    """GPU: dy2d[M, N] @ W -> [M, K] in dy2d's dtype, at most chunk_bytes of W dequantized at once."""
    _check(qweight, scale, zero, group_size)
    dy2d = dy2d.contiguous()
    M, N, K = _shapes(dy2d, qweight, group_size, "bwd")
    dx = torch.empty((M, K), device=dy2d.device, dtype=dy2d.dtype)
    if M == 0:
        return dx
    groups = max(1, chunk_bytes // (2 * N * group_size))
    buf = torch.empty((N, min(groups, K // group_size) * group_size), device=dy2d.device, dtype=dy2d.dtype)
    for g0 in range(0, K // group_size, groups):
        g1 = min(K // group_size, g0 + groups)
        w = dequantize_slice(qweight, scale, zero, buf[:, : (g1 - g0) * group_size], group0=g0,
                             group_size=group_size)
        torch.mm(dy2d, w, out=dx[:, g0 * group_size: g1 * group_size])
    return dx


def reference_matmul_fwd(x2d, qweight, scale, zero, group_size: int = GROUP_SIZE):
    """Plain PyTorch: dequantize to x's dtype, then x @ W^T (the oracle; runs on CPU)."""
    return x2d @ dequantize_weight(qweight, scale, zero, group_size, x2d.dtype).t()


def reference_matmul_bwd(dy2d, qweight, scale, zero, group_size: int = GROUP_SIZE):
    """Plain PyTorch: dy @ W."""
    return dy2d @ dequantize_weight(qweight, scale, zero, group_size, dy2d.dtype)

