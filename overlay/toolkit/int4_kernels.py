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

Ways to run the matmuls (the module's `Int4Kernel`, toolkit/qtypes.py, picks one at load time):
  * on a GPU (CUDA or ROCm, bf16/fp16 activations, fp32 accumulation), one of
    - "chunked" (default): a Triton kernel dequantizes W a slice at a time into
      a small buffer (the kernel's chunk_bytes, 64 MiB) and cuBLAS/rocBLAS multiplies
      each slice. Not fused, but the bf16 weight never exists whole (torchao's
      uint4 path builds it whole, through int32 temporaries, per call) and the
      vendor GEMM does the heavy part: on an H200, summed over one training
      step's FLUX.2 block Linears, 1.17-1.29x the time of bf16 weights, against
      1.75-3.35x for torchao;
    - "fused": a pair of Triton kernels, y = x @ W^T and dx = dy @ W, which
      unpack and dequantize W in registers tile by tile and never write it to
      memory (no temporary at all); 1.9-2.2x bf16 on an H200;
  * a plain PyTorch reference (dequantize, then matmul) that runs anywhere,
    including the CPU, and is the correctness oracle for the kernels.

The kernels use Triton's portable language only (no inline assembly, no
vendor intrinsics, nothing Hopper-specific requested), so the same source is
meant to run on ROCm (RDNA3 gfx1100) as on CUDA. The autotuning lists are chosen per
arch (`config_family`): RDNA and consumer NVIDIA get lists that neither spill registers
nor overflow shared memory there (bench/kernel_isa.py compiles them on the CPU).
Tested: NVIDIA H200 (CUDA 13, Triton 3.6) and Triton's CPU interpreter (fp16). Not tested:
any AMD GPU, bf16 under the interpreter (the interpreter itself mishandles bf16).
"""

from __future__ import annotations

import os

import torch

from toolkit.qtypes import device_arch, sm_number

GROUP_SIZE = 64
QMAX = 15  # unsigned 4-bit codes 0..15
VARIANTS = ("chunked", "fused")
DEFAULT_CHUNK_BYTES = 64 * 2**20

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


    # ---- fused: packed bytes loaded contiguously (vectorised, pipelined), unpacked with tl.interleave

    # Per config family (config_family); none spills or overflows shared memory on the archs
    # bench/kernel_isa.py compiles for (H200's lists are measured on the H200: bench/RESULTS.md).
    FUSED_FWD = {  # BLOCK_M, BLOCK_N, W_AS_A, num_warps, num_stages
        "amd": [(64, 64, 0, 4, 2), (128, 64, 0, 8, 2), (128, 128, 1, 8, 2), (64, 64, 1, 4, 2)],
        "nvidia_99k": [(128, 128, 0, 8, 4), (256, 64, 0, 8, 3), (64, 128, 0, 4, 4), (128, 64, 0, 4, 4),
                       (128, 128, 1, 8, 4), (64, 256, 1, 8, 3), (64, 128, 1, 4, 4), (128, 64, 1, 4, 4)],
        "nvidia": [(128, 128, 0, 4, 4), (128, 256, 0, 8, 3), (256, 128, 0, 8, 3), (128, 128, 0, 8, 4),
                   (128, 128, 1, 4, 4), (128, 256, 1, 8, 3), (256, 128, 1, 8, 3), (64, 128, 1, 4, 4)],
    }
    FUSED_BWD = {  # BLOCK_M, BLOCK_R, NSUB, W_AS_A, num_warps, num_stages
        "amd": [(64, 64, 1, 0, 4, 2), (128, 64, 1, 0, 8, 2), (64, 64, 2, 0, 8, 2), (64, 64, 1, 1, 4, 2),
                (64, 64, 2, 1, 8, 2)],
        "nvidia_99k": [(128, 64, 2, 0, 8, 3), (64, 64, 2, 0, 4, 4), (128, 64, 1, 0, 4, 4), (256, 64, 1, 0, 8, 3),
                       (128, 64, 2, 1, 8, 3), (128, 64, 1, 1, 4, 4), (128, 128, 2, 1, 8, 3)],
        "nvidia": [(128, 64, 2, 0, 8, 3), (256, 64, 2, 0, 8, 3), (128, 64, 1, 0, 4, 4), (256, 64, 1, 0, 8, 3),
                   (128, 64, 2, 1, 8, 3), (256, 64, 2, 1, 8, 3), (128, 64, 1, 1, 4, 4), (128, 128, 2, 1, 8, 3)],
    }

    def fused_fwd_configs(arch: str):
        """The fused forward kernel's autotuning list on `arch` (bench/kernel_isa.py compiles each)."""
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "W_AS_A": a, "GROUP_M": 8}, num_warps=w, num_stages=s)
                for bm, bn, a, w, s in FUSED_FWD[config_family(arch)]]

    def fused_bwd_configs(arch: str):
        """The fused input-gradient kernel's autotuning list on `arch`."""
        return [triton.Config({"BLOCK_M": bm, "BLOCK_R": br, "NSUB": ns, "W_AS_A": a, "GROUP_M": 8},
                              num_warps=w, num_stages=s)
                for bm, br, ns, a, w, s in FUSED_BWD[config_family(arch)]]

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

    @triton.autotune(configs=fused_fwd_configs(tuning_arch()), key=["M", "N", "K"])
    @triton.jit
    def _fused_fwd_kernel(
        x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr,
        M, N, K,
        stride_xm, stride_ym, stride_qn, stride_sn,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        W_AS_A: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        # y[M, N] = x[M, K] @ W[N, K]^T, one quantization group (GROUP inputs) per step
        pid_m, pid_n = _swizzle(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        offs_k = tl.arange(0, GROUP)
        offs_b = tl.arange(0, GROUP // 2)
        rows_x = offs_m.to(tl.int64) * stride_xm
        w_ptrs = qw_ptr + (offs_n.to(tl.int64) * stride_qn)[:, None] + offs_b[None, :]
        s_ptrs = s_ptr + offs_n.to(tl.int64) * stride_sn
        z_ptrs = z_ptr + offs_n.to(tl.int64) * stride_sn
        if W_AS_A:
            x_ptrs = x_ptr + rows_x[None, :] + offs_k[:, None]
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            x_ptrs = x_ptr + rows_x[:, None] + offs_k[None, :]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in range(0, K // GROUP):
            xt = tl.load(x_ptrs)
            w = _unpack_dequant(tl.load(w_ptrs), tl.load(s_ptrs + g), tl.load(z_ptrs + g), xt.dtype)
            if W_AS_A:
                acc = tl.dot(w, xt, acc)
            else:
                acc = tl.dot(xt, tl.trans(w), acc)
            x_ptrs += GROUP
            w_ptrs += GROUP // 2
        out_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        out_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if W_AS_A:
            y_ptrs = y_ptr + out_m.to(tl.int64)[None, :] * stride_ym + out_n[:, None]
            mask = (out_m[None, :] < M) & (out_n[:, None] < N)
        else:
            y_ptrs = y_ptr + out_m.to(tl.int64)[:, None] * stride_ym + out_n[None, :]
            mask = (out_m[:, None] < M) & (out_n[None, :] < N)
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _fused_bwd_store(dx_ptr, acc, out_m, gi, M, K, stride_dxm, GROUP: tl.constexpr, W_AS_A: tl.constexpr):
        out_k = gi * GROUP + tl.arange(0, GROUP)
        if W_AS_A:
            ptrs = dx_ptr + out_m.to(tl.int64)[None, :] * stride_dxm + out_k[:, None]
            mask = (out_m[None, :] < M) & (out_k[:, None] < K)
        else:
            ptrs = dx_ptr + out_m.to(tl.int64)[:, None] * stride_dxm + out_k[None, :]
            mask = (out_m[:, None] < M) & (out_k[None, :] < K)
        tl.store(ptrs, acc.to(dx_ptr.dtype.element_ty), mask=mask)

    @triton.autotune(configs=fused_bwd_configs(tuning_arch()), key=["M", "N", "K"])
    @triton.heuristics({"EVEN_R": lambda a: a["N"] % a["BLOCK_R"] == 0})
    @triton.jit
    def _fused_bwd_kernel(
        dy_ptr, qw_ptr, s_ptr, z_ptr, dx_ptr,
        M, N, K,
        stride_dym, stride_dxm, stride_qn, stride_sn,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, NSUB: tl.constexpr,
        W_AS_A: tl.constexpr, GROUP_M: tl.constexpr, EVEN_R: tl.constexpr,
    ):
        # dx[M, K] = dy[M, N] @ W[N, K]: each program owns NSUB (1 or 2) quantization groups of
        # output columns, so every W tile it unpacks has one scale per row.
        pid_m, pid_k = _swizzle(tl.program_id(0), M, K, BLOCK_M, GROUP * NSUB, GROUP_M)
        n_groups = K // GROUP
        g0 = pid_k * NSUB
        g1 = tl.minimum(g0 + 1, n_groups - 1)
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
        offs_r = tl.arange(0, BLOCK_R)
        offs_b = tl.arange(0, GROUP // 2)
        rows_dy = offs_m.to(tl.int64) * stride_dym
        if W_AS_A:
            dy_ptrs = dy_ptr + rows_dy[None, :] + offs_r[:, None]
            acc0 = tl.zeros((GROUP, BLOCK_M), dtype=tl.float32)
            acc1 = tl.zeros((GROUP, BLOCK_M), dtype=tl.float32)
        else:
            dy_ptrs = dy_ptr + rows_dy[:, None] + offs_r[None, :]
            acc0 = tl.zeros((BLOCK_M, GROUP), dtype=tl.float32)
            acc1 = tl.zeros((BLOCK_M, GROUP), dtype=tl.float32)
        w_rows = offs_r.to(tl.int64) * stride_qn
        s_rows = offs_r.to(tl.int64) * stride_sn
        w0_ptrs = qw_ptr + w_rows[:, None] + (g0 * (GROUP // 2) + offs_b)[None, :]
        w1_ptrs = qw_ptr + w_rows[:, None] + (g1 * (GROUP // 2) + offs_b)[None, :]
        s0_ptrs = s_ptr + s_rows + g0
        s1_ptrs = s_ptr + s_rows + g1
        z0_ptrs = z_ptr + s_rows + g0
        z1_ptrs = z_ptr + s_rows + g1
        for r0 in range(0, N, BLOCK_R):
            if EVEN_R:
                dyt = tl.load(dy_ptrs)
                w0 = _unpack_dequant(tl.load(w0_ptrs), tl.load(s0_ptrs), tl.load(z0_ptrs), dyt.dtype)
            else:
                live = (r0 + offs_r) < N
                if W_AS_A:
                    dyt = tl.load(dy_ptrs, mask=live[:, None], other=0.0)
                else:
                    dyt = tl.load(dy_ptrs, mask=live[None, :], other=0.0)
                w0 = _unpack_dequant(tl.load(w0_ptrs, mask=live[:, None], other=0),
                                     tl.load(s0_ptrs, mask=live, other=0.0), tl.load(z0_ptrs, mask=live, other=0),
                                     dyt.dtype)
            if W_AS_A:
                acc0 = tl.dot(tl.trans(w0), dyt, acc0)
            else:
                acc0 = tl.dot(dyt, w0, acc0)
            if NSUB == 2:
                if EVEN_R:
                    w1 = _unpack_dequant(tl.load(w1_ptrs), tl.load(s1_ptrs), tl.load(z1_ptrs), dyt.dtype)
                else:
                    w1 = _unpack_dequant(tl.load(w1_ptrs, mask=live[:, None], other=0),
                                         tl.load(s1_ptrs, mask=live, other=0.0),
                                         tl.load(z1_ptrs, mask=live, other=0), dyt.dtype)
                if W_AS_A:
                    acc1 = tl.dot(tl.trans(w1), dyt, acc1)
                else:
                    acc1 = tl.dot(dyt, w1, acc1)
            dy_ptrs += BLOCK_R
            w0_ptrs += BLOCK_R * stride_qn
            w1_ptrs += BLOCK_R * stride_qn
            s0_ptrs += BLOCK_R * stride_sn
            s1_ptrs += BLOCK_R * stride_sn
            z0_ptrs += BLOCK_R * stride_sn
            z1_ptrs += BLOCK_R * stride_sn
        out_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        _fused_bwd_store(dx_ptr, acc0, out_m, g0, M, K, stride_dxm, GROUP, W_AS_A)
        if NSUB == 2:
            if g0 + 1 < n_groups:
                _fused_bwd_store(dx_ptr, acc1, out_m, g0 + 1, M, K, stride_dxm, GROUP, W_AS_A)

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


def _variant(variant: str) -> str:
    if variant not in VARIANTS:
        raise ValueError(f"unknown int4 GPU path {variant!r}; pick one of {', '.join(VARIANTS)}")
    return variant


def int4_matmul_fwd(x2d: torch.Tensor, qweight, scale, zero, group_size: int = GROUP_SIZE,
                    variant: str = "chunked", chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """GPU: x2d[M, K] @ W^T -> [M, N] in x2d's dtype ("chunked": at most chunk_bytes of W at once)."""
    variant = _variant(variant)
    _check(qweight, scale, zero, group_size)
    x2d = x2d.contiguous()
    M, N, K = _shapes(x2d, qweight, group_size, "fwd")
    y = torch.empty((M, N), device=x2d.device, dtype=x2d.dtype)
    if M == 0:
        return y
    if variant == "chunked":
        rows = max(64, (chunk_bytes // (2 * K)) // 64 * 64)
        buf = torch.empty((min(rows, N), K), device=x2d.device, dtype=x2d.dtype)
        for n0 in range(0, N, rows):
            n1 = min(N, n0 + rows)
            w = dequantize_slice(qweight, scale, zero, buf[: n1 - n0], row0=n0, group_size=group_size)
            torch.mm(x2d, w.t(), out=y[:, n0:n1])
        return y

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _fused_fwd_kernel[grid](x2d, qweight, scale, zero, y, M, N, K,
                            x2d.stride(0), y.stride(0), qweight.stride(0), scale.stride(0), GROUP=group_size)
    return y


def int4_matmul_bwd(dy2d: torch.Tensor, qweight, scale, zero, group_size: int = GROUP_SIZE,
                    variant: str = "chunked", chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """GPU: dy2d[M, N] @ W -> [M, K] in dy2d's dtype ("chunked": at most chunk_bytes of W at once)."""
    variant = _variant(variant)
    _check(qweight, scale, zero, group_size)
    dy2d = dy2d.contiguous()
    M, N, K = _shapes(dy2d, qweight, group_size, "bwd")
    dx = torch.empty((M, K), device=dy2d.device, dtype=dy2d.dtype)
    if M == 0:
        return dx
    if variant == "chunked":
        groups = max(1, chunk_bytes // (2 * N * group_size))
        buf = torch.empty((N, min(groups, K // group_size) * group_size), device=dy2d.device, dtype=dy2d.dtype)
        for g0 in range(0, K // group_size, groups):
            g1 = min(K // group_size, g0 + groups)
            w = dequantize_slice(qweight, scale, zero, buf[:, : (g1 - g0) * group_size], group0=g0,
                                 group_size=group_size)
            torch.mm(dy2d, w, out=dx[:, g0 * group_size: g1 * group_size])
        return dx

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(K, group_size * meta["NSUB"]),)

    _fused_bwd_kernel[grid](dy2d, qweight, scale, zero, dx, M, N, K,
                            dy2d.stride(0), dx.stride(0), qweight.stride(0), scale.stride(0), GROUP=group_size)
    return dx


def reference_matmul_fwd(x2d, qweight, scale, zero, group_size: int = GROUP_SIZE):
    """Plain PyTorch: dequantize to x's dtype, then x @ W^T (the oracle; runs on CPU)."""
    return x2d @ dequantize_weight(qweight, scale, zero, group_size, x2d.dtype).t()


def reference_matmul_bwd(dy2d, qweight, scale, zero, group_size: int = GROUP_SIZE):
    """Plain PyTorch: dy @ W."""
    return dy2d @ dequantize_weight(qweight, scale, zero, group_size, dy2d.dtype)

