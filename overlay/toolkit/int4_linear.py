"""Frozen 4-bit Linear layers for training adapters on top of them (QLoRA-style).

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

Ways to run the matmuls, chosen per call:
  * on a GPU (CUDA or ROCm, bf16/fp16 activations, fp32 accumulation), one of
    - "chunked" (default): a Triton kernel dequantizes W a slice at a time into
      a small buffer (INT4_LINEAR_CHUNK_MIB, 64 MiB) and cuBLAS/rocBLAS multiplies
      each slice. Not fused, but the bf16 weight never exists whole (torchao's
      uint4 path builds it whole, through int32 temporaries, per call) and the
      vendor GEMM does the heavy part: on an H200, summed over one training
      step's FLUX.2 block Linears, 1.17-1.29x the time of bf16 weights, against
      1.75-3.35x for torchao;
    - "fused": a pair of Triton kernels, y = x @ W^T and dx = dy @ W, which
      unpack and dequantize W in registers tile by tile and never write it to
      memory (no temporary at all); 1.9-2.2x bf16 on an H200;
    - "fused1": the first fused attempt (byte-gather loads), slower; kept for
      comparison.
    INT4_LINEAR_VARIANT picks one; INT4_LINEAR_KERNEL=0 forces the reference.
  * a plain PyTorch reference (dequantize, then matmul) that runs anywhere,
    including the CPU, and is the correctness oracle for the kernels.
An Int4Linear whose `activations` is "8bit" (qtype int4_w4a8) hands its matmuls to
toolkit/int4_w4a8.py instead: 8-bit activations and 8-bit weight slices, same stored weight.
The base weight never gets a gradient; only the input does.

The kernels use Triton's portable language only (no inline assembly, no
vendor intrinsics, nothing Hopper-specific requested), so the same source is
meant to run on ROCm (RDNA3 gfx1100) as on CUDA; ROCm gets its own small
autotuning lists (num_stages 2). Tested: NVIDIA H200 (CUDA 13, Triton 3.6) and
Triton's CPU interpreter (fp16). Not tested: any AMD GPU, bf16 under the
interpreter (the interpreter itself mishandles bf16).
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

GROUP_SIZE = 64
FORMAT = "int4_fused"
FORMAT_VERSION = 1
QMAX = 15  # unsigned 4-bit codes 0..15
ACTIVATIONS_BF16 = "bf16"
ACTIVATIONS_8BIT = "8bit"

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

if HAVE_TRITON:

    def _is_hip() -> bool:
        return getattr(torch.version, "hip", None) is not None

    def _fwd_configs():
        if _is_hip():  # untested: small stage counts suit AMD's stream pipeliner
            return [
                triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "W_AS_A": 0, "GROUP_M": 8}, num_warps=w, num_stages=s)
                for bm, bn, w, s in [(64, 64, 4, 2), (128, 64, 4, 2), (64, 128, 4, 2), (128, 128, 8, 2)]
            ]
        cfgs = []
        for bm, bn, w, s in [(128, 128, 8, 3), (128, 256, 8, 3), (64, 128, 4, 4), (128, 128, 4, 4), (256, 128, 8, 3)]:
            cfgs.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "W_AS_A": 0, "GROUP_M": 8},
                                      num_warps=w, num_stages=s))
        for bm, bn, w, s in [(128, 128, 8, 3), (128, 256, 8, 3), (64, 128, 4, 4)]:
            cfgs.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "W_AS_A": 1, "GROUP_M": 8},
                                      num_warps=w, num_stages=s))
        return cfgs

    def _bwd_configs():
        if _is_hip():
            return [
                triton.Config({"BLOCK_M": bm, "BLOCK_K": bk, "BLOCK_R": br, "W_AS_A": 0, "GROUP_M": 8},
                              num_warps=w, num_stages=s)
                for bm, bk, br, w, s in [(64, 64, 64, 4, 2), (128, 64, 64, 4, 2), (64, 128, 64, 4, 2),
                                         (128, 128, 32, 8, 2)]
            ]
        cfgs = []
        for bm, bk, br, w, s in [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4),
                                 (128, 128, 64, 4, 4), (256, 128, 64, 8, 3)]:
            cfgs.append(triton.Config({"BLOCK_M": bm, "BLOCK_K": bk, "BLOCK_R": br, "W_AS_A": 0, "GROUP_M": 8},
                                      num_warps=w, num_stages=s))
        for bm, bk, br, w, s in [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4)]:
            cfgs.append(triton.Config({"BLOCK_M": bm, "BLOCK_K": bk, "BLOCK_R": br, "W_AS_A": 1, "GROUP_M": 8},
                                      num_warps=w, num_stages=s))
        return cfgs

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

    @triton.autotune(configs=_fwd_configs(), key=["M", "N", "K"])
    @triton.jit
    def _int4_fwd_kernel(
        x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr,
        M, N, K,
        stride_xm, stride_ym, stride_qn, stride_sn,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        W_AS_A: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        # y[M, N] = x[M, K] @ W[N, K]^T; one K step = one quantization group.
        pid_m, pid_n = _swizzle(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M  # wrap: loads need no mask
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        offs_k = tl.arange(0, GROUP)
        rows_x = offs_m.to(tl.int64) * stride_xm
        rows_w = offs_n.to(tl.int64) * stride_qn
        rows_s = offs_n.to(tl.int64) * stride_sn
        if W_AS_A:
            # acc^T[N, M] = W[N, K] @ x^T[K, M]: the dequantized tile is the register operand
            x_ptrs = x_ptr + rows_x[None, :] + offs_k[:, None]
            w_ptrs = qw_ptr + rows_w[:, None] + (offs_k // 2)[None, :]
            shift = ((offs_k % 2) * 4)[None, :]
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            x_ptrs = x_ptr + rows_x[:, None] + offs_k[None, :]
            w_ptrs = qw_ptr + rows_w[None, :] + (offs_k // 2)[:, None]
            shift = ((offs_k % 2) * 4)[:, None]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        s_ptrs = s_ptr + rows_s
        z_ptrs = z_ptr + rows_s
        for g in range(0, K // GROUP):
            xt = tl.load(x_ptrs)
            b = tl.load(w_ptrs).to(tl.int32)
            s = tl.load(s_ptrs + g).to(tl.float32)
            z = tl.load(z_ptrs + g).to(tl.float32)
            q = ((b >> shift) & 0xF).to(tl.float32)
            if W_AS_A:
                w = ((q - z[:, None]) * s[:, None]).to(xt.dtype)
                acc = tl.dot(w, xt, acc)
            else:
                w = ((q - z[None, :]) * s[None, :]).to(xt.dtype)
                acc = tl.dot(xt, w, acc)
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

    @triton.autotune(configs=_bwd_configs(), key=["M", "N", "K"])
    @triton.heuristics({"EVEN_R": lambda a: a["N"] % a["BLOCK_R"] == 0})
    @triton.jit
    def _int4_bwd_kernel(
        dy_ptr, qw_ptr, s_ptr, z_ptr, dx_ptr,
        M, N, K,
        stride_dym, stride_dxm, stride_qn, stride_sn,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
        W_AS_A: tl.constexpr, GROUP_M: tl.constexpr, EVEN_R: tl.constexpr,
    ):
        # dx[M, K] = dy[M, N] @ W[N, K]; the reduction runs over N (BLOCK_R rows of W at a time).
        pid_m, pid_k = _swizzle(tl.program_id(0), M, K, BLOCK_M, BLOCK_K, GROUP_M)
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
        offs_k = (pid_k * BLOCK_K + tl.arange(0, BLOCK_K)) % K
        offs_r = tl.arange(0, BLOCK_R)
        rows_dy = offs_m.to(tl.int64) * stride_dym
        if W_AS_A:
            # acc^T[K, M] = W^T[K, N] @ dy^T[N, M]
            dy_ptrs = dy_ptr + rows_dy[None, :] + offs_r[:, None]
            w_ptrs = qw_ptr + offs_r[None, :] * stride_qn + (offs_k // 2)[:, None]
            s_ptrs = s_ptr + offs_r[None, :] * stride_sn + (offs_k // GROUP)[:, None]
            z_ptrs = z_ptr + offs_r[None, :] * stride_sn + (offs_k // GROUP)[:, None]
            shift = ((offs_k % 2) * 4)[:, None]
            acc = tl.zeros((BLOCK_K, BLOCK_M), dtype=tl.float32)
        else:
            dy_ptrs = dy_ptr + rows_dy[:, None] + offs_r[None, :]
            w_ptrs = qw_ptr + offs_r[:, None] * stride_qn + (offs_k // 2)[None, :]
            s_ptrs = s_ptr + offs_r[:, None] * stride_sn + (offs_k // GROUP)[None, :]
            z_ptrs = z_ptr + offs_r[:, None] * stride_sn + (offs_k // GROUP)[None, :]
            shift = ((offs_k % 2) * 4)[None, :]
            acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for r0 in range(0, N, BLOCK_R):
            if EVEN_R:
                dyt = tl.load(dy_ptrs)
                b = tl.load(w_ptrs).to(tl.int32)
                s = tl.load(s_ptrs).to(tl.float32)
                z = tl.load(z_ptrs).to(tl.float32)
            else:
                live = (r0 + offs_r) < N
                if W_AS_A:
                    rmask = live[None, :]
                    dymask = live[:, None]
                else:
                    rmask = live[:, None]
                    dymask = live[None, :]
                dyt = tl.load(dy_ptrs, mask=dymask, other=0.0)
                b = tl.load(w_ptrs, mask=rmask, other=0).to(tl.int32)
                s = tl.load(s_ptrs, mask=rmask, other=0.0).to(tl.float32)
                z = tl.load(z_ptrs, mask=rmask, other=0).to(tl.float32)
            q = ((b >> shift) & 0xF).to(tl.float32)
            w = ((q - z) * s).to(dyt.dtype)
            if W_AS_A:
                acc = tl.dot(w, dyt, acc)
            else:
                acc = tl.dot(dyt, w, acc)
            dy_ptrs += BLOCK_R
            w_ptrs += BLOCK_R * stride_qn
            s_ptrs += BLOCK_R * stride_sn
            z_ptrs += BLOCK_R * stride_sn
        out_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        out_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        if W_AS_A:
            dx_ptrs = dx_ptr + out_m.to(tl.int64)[None, :] * stride_dxm + out_k[:, None]
            mask = (out_m[None, :] < M) & (out_k[:, None] < K)
        else:
            dx_ptrs = dx_ptr + out_m.to(tl.int64)[:, None] * stride_dxm + out_k[None, :]
            mask = (out_m[:, None] < M) & (out_k[None, :] < K)
        tl.store(dx_ptrs, acc.to(dx_ptr.dtype.element_ty), mask=mask)


    # ---- v2: packed bytes loaded contiguously (vectorised, pipelined), unpacked with tl.interleave

    def _fwd2_configs():
        if _is_hip():
            return [
                triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "W_AS_A": a, "GROUP_M": 8}, num_warps=w, num_stages=s)
                for bm, bn, a, w, s in [(64, 64, 0, 4, 2), (128, 64, 0, 4, 2), (128, 128, 0, 8, 2), (64, 128, 1, 4, 2)]
            ]
        return [
            triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "W_AS_A": a, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for bm, bn, a, w, s in [(128, 128, 0, 4, 4), (128, 256, 0, 8, 3), (256, 128, 0, 8, 3), (128, 128, 0, 8, 4),
                                    (128, 128, 1, 4, 4), (128, 256, 1, 8, 3), (256, 128, 1, 8, 3), (64, 128, 1, 4, 4)]
        ]

    def _bwd2_configs():
        if _is_hip():
            return [
                triton.Config({"BLOCK_M": bm, "BLOCK_R": br, "NSUB": ns, "W_AS_A": a, "GROUP_M": 8},
                              num_warps=w, num_stages=s)
                for bm, br, ns, a, w, s in [(64, 64, 1, 0, 4, 2), (128, 64, 1, 0, 4, 2), (128, 64, 2, 0, 8, 2),
                                            (64, 64, 2, 1, 4, 2)]
            ]
        return [
            triton.Config({"BLOCK_M": bm, "BLOCK_R": br, "NSUB": ns, "W_AS_A": a, "GROUP_M": 8},
                          num_warps=w, num_stages=s)
            for bm, br, ns, a, w, s in [(128, 64, 2, 0, 8, 3), (256, 64, 2, 0, 8, 3), (128, 64, 1, 0, 4, 4),
                                        (256, 64, 1, 0, 8, 3), (128, 64, 2, 1, 8, 3), (256, 64, 2, 1, 8, 3),
                                        (128, 64, 1, 1, 4, 4), (128, 128, 2, 1, 8, 3)]
        ]

    @triton.jit
    def _unpack_dequant(b, s, z, dtype: tl.constexpr):
        # b: [R, GROUP // 2] packed bytes of one group per row; s, z: [R] -> [R, GROUP] in dtype
        q = tl.interleave(b & 0xF, b >> 4).to(tl.float32)
        return ((q - z.to(tl.float32)[:, None]) * s.to(tl.float32)[:, None]).to(dtype)

    @triton.autotune(configs=_fwd2_configs(), key=["M", "N", "K"])
    @triton.jit
    def _int4_fwd2_kernel(
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
    def _bwd2_store(dx_ptr, acc, out_m, gi, M, K, stride_dxm, GROUP: tl.constexpr, W_AS_A: tl.constexpr):
        out_k = gi * GROUP + tl.arange(0, GROUP)
        if W_AS_A:
            ptrs = dx_ptr + out_m.to(tl.int64)[None, :] * stride_dxm + out_k[:, None]
            mask = (out_m[None, :] < M) & (out_k[:, None] < K)
        else:
            ptrs = dx_ptr + out_m.to(tl.int64)[:, None] * stride_dxm + out_k[None, :]
            mask = (out_m[:, None] < M) & (out_k[None, :] < K)
        tl.store(ptrs, acc.to(dx_ptr.dtype.element_ty), mask=mask)

    @triton.autotune(configs=_bwd2_configs(), key=["M", "N", "K"])
    @triton.heuristics({"EVEN_R": lambda a: a["N"] % a["BLOCK_R"] == 0})
    @triton.jit
    def _int4_bwd2_kernel(
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
        _bwd2_store(dx_ptr, acc0, out_m, g0, M, K, stride_dxm, GROUP, W_AS_A)
        if NSUB == 2:
            if g0 + 1 < n_groups:
                _bwd2_store(dx_ptr, acc1, out_m, g0 + 1, M, K, stride_dxm, GROUP, W_AS_A)

    @triton.jit
    def _dequant_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, g_first, stride_qn, stride_sn, stride_on,
                        GROUP: tl.constexpr, BLOCK_R: tl.constexpr):
        # out[r, j*GROUP:(j+1)*GROUP] = W[r, (g_first+j)*GROUP : ...] for BLOCK_R rows, group j
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        j = tl.program_id(1)
        g = g_first + j
        live = rows < N
        rows64 = rows.to(tl.int64)
        offs_b = tl.arange(0, GROUP // 2)
        b = tl.load(qw_ptr + (rows64 * stride_qn)[:, None] + (g * (GROUP // 2) + offs_b)[None, :],
                    mask=live[:, None], other=0)
        s = tl.load(s_ptr + rows64 * stride_sn + g, mask=live, other=0.0)
        z = tl.load(z_ptr + rows64 * stride_sn + g, mask=live, other=0)
        w = _unpack_dequant(b, s, z, out_ptr.dtype.element_ty)
        offs_k = j * GROUP + tl.arange(0, GROUP)
        tl.store(out_ptr + (rows64 * stride_on)[:, None] + offs_k[None, :], w, mask=live[:, None])


KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def kernel_available(x: torch.Tensor) -> bool:
    """True when the Triton kernels can run this input (GPU tensor, bf16/fp16, Triton present)."""
    if not HAVE_TRITON or os.environ.get("INT4_LINEAR_KERNEL", "1") == "0":
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


# Which GPU implementation int4_matmul_fwd/bwd use:
#   chunked - a Triton dequantize kernel writes W a slice at a time (at most CHUNK_BYTES) and
#             cuBLAS/rocBLAS multiplies each slice: not fused, but the temporary stays small (default:
#             fastest on the H200, see bench/RESULTS-int4.md in the launcher repository)
#   fused   - v2 kernels: W unpacked and dequantized in registers, never written out
#   fused1  - v1 kernels (first attempt: byte-gather loads; kept for comparison)
VARIANTS = ("chunked", "fused", "fused1")
DEFAULT_VARIANT = os.environ.get("INT4_LINEAR_VARIANT", "chunked")
CHUNK_BYTES = int(os.environ.get("INT4_LINEAR_CHUNK_MIB", "64")) * 2 ** 20


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


def _variant(variant):
    variant = variant or DEFAULT_VARIANT
    if variant not in VARIANTS:
        raise ValueError(f"unknown int4_linear variant {variant!r}; pick one of {', '.join(VARIANTS)}")
    return variant


def int4_matmul_fwd(x2d: torch.Tensor, qweight, scale, zero, group_size: int = GROUP_SIZE,
                    variant: Optional[str] = None) -> torch.Tensor:
    """GPU: x2d[M, K] @ W^T -> [M, N] in x2d's dtype."""
    variant = _variant(variant)
    _check(qweight, scale, zero, group_size)
    x2d = x2d.contiguous()
    M, N, K = _shapes(x2d, qweight, group_size, "fwd")
    y = torch.empty((M, N), device=x2d.device, dtype=x2d.dtype)
    if M == 0:
        return y
    if variant == "chunked":
        rows = max(64, (CHUNK_BYTES // (2 * K)) // 64 * 64)
        buf = torch.empty((min(rows, N), K), device=x2d.device, dtype=x2d.dtype)
        for n0 in range(0, N, rows):
            n1 = min(N, n0 + rows)
            w = dequantize_slice(qweight, scale, zero, buf[: n1 - n0], row0=n0, group_size=group_size)
            torch.mm(x2d, w.t(), out=y[:, n0:n1])
        return y
    kernel = {"fused": _int4_fwd2_kernel, "fused1": _int4_fwd_kernel}[variant]

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    kernel[grid](x2d, qweight, scale, zero, y, M, N, K,
                 x2d.stride(0), y.stride(0), qweight.stride(0), scale.stride(0), GROUP=group_size)
    return y


def int4_matmul_bwd(dy2d: torch.Tensor, qweight, scale, zero, group_size: int = GROUP_SIZE,
                    variant: Optional[str] = None) -> torch.Tensor:
    """GPU: dy2d[M, N] @ W -> [M, K] in dy2d's dtype."""
    variant = _variant(variant)
    _check(qweight, scale, zero, group_size)
    dy2d = dy2d.contiguous()
    M, N, K = _shapes(dy2d, qweight, group_size, "bwd")
    dx = torch.empty((M, K), device=dy2d.device, dtype=dy2d.dtype)
    if M == 0:
        return dx
    if variant == "chunked":
        groups = max(1, CHUNK_BYTES // (2 * N * group_size))
        buf = torch.empty((N, min(groups, K // group_size) * group_size), device=dy2d.device, dtype=dy2d.dtype)
        for g0 in range(0, K // group_size, groups):
            g1 = min(K // group_size, g0 + groups)
            w = dequantize_slice(qweight, scale, zero, buf[:, : (g1 - g0) * group_size], group0=g0,
                                 group_size=group_size)
            torch.mm(dy2d, w, out=dx[:, g0 * group_size: g1 * group_size])
        return dx
    if variant == "fused":
        def grid(meta):
            return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(K, group_size * meta["NSUB"]),)

        _int4_bwd2_kernel[grid](dy2d, qweight, scale, zero, dx, M, N, K,
                                dy2d.stride(0), dx.stride(0), qweight.stride(0), scale.stride(0), GROUP=group_size)
        return dx

    def grid1(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(K, meta["BLOCK_K"]),)

    _int4_bwd_kernel[grid1](dy2d, qweight, scale, zero, dx, M, N, K,
                            dy2d.stride(0), dx.stride(0), qweight.stride(0), scale.stride(0), GROUP=group_size)
    return dx


def reference_matmul_fwd(x2d, qweight, scale, zero, group_size: int = GROUP_SIZE):
    """Plain PyTorch: dequantize to x's dtype, then x @ W^T (the oracle; runs on CPU)."""
    return x2d @ dequantize_weight(qweight, scale, zero, group_size, x2d.dtype).t()


def reference_matmul_bwd(dy2d, qweight, scale, zero, group_size: int = GROUP_SIZE):
    """Plain PyTorch: dy @ W."""
    return dy2d @ dequantize_weight(qweight, scale, zero, group_size, dy2d.dtype)


class Int4LinearFunction(torch.autograd.Function):
    """y = x @ W^T (+ bias) with W frozen 4-bit; the gradient flows to x only.

    Nothing but the packed weight is kept for backward: the dequantized weight
    is never stored (kernel path) or rebuilt per call (reference path).
    """

    @staticmethod
    def forward(ctx, x, qweight, scale, zero, bias, group_size, use_kernel):
        shape = x.shape
        x2d = x.reshape(-1, shape[-1])
        if use_kernel:
            y = int4_matmul_fwd(x2d, qweight, scale, zero, group_size)
        else:
            y = reference_matmul_fwd(x2d, qweight, scale, zero, group_size)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(qweight, scale, zero)
        ctx.group_size = group_size
        ctx.use_kernel = use_kernel
        ctx.in_shape = shape
        return y.reshape(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        dx = None
        if ctx.needs_input_grad[0]:
            qweight, scale, zero = ctx.saved_tensors
            dy2d = dy.reshape(-1, dy.shape[-1])
            if ctx.use_kernel:
                dx = int4_matmul_bwd(dy2d, qweight, scale, zero, ctx.group_size)
            else:
                dx = reference_matmul_bwd(dy2d, qweight, scale, zero, ctx.group_size)
            dx = dx.reshape(ctx.in_shape)
        return dx, None, None, None, None, None, None


def int4_linear(x, qweight, scale, zero, bias=None, group_size: int = GROUP_SIZE, use_kernel: Optional[bool] = None):
    if use_kernel is None:
        use_kernel = kernel_available(x)
    return Int4LinearFunction.apply(x, qweight, scale, zero, bias, group_size, bool(use_kernel))


# --------------------------------------------------------------------------- module


class Int4Linear(nn.Module):
    """Drop-in, frozen replacement for nn.Linear with a 4-bit weight.

    Buffers (not parameters, so optimizers and requires_grad_ never touch them):
    qweight, scale, zero and an optional bias. ``weight`` returns the
    dequantized weight for code that inspects it (dtype/device/shape); it
    allocates a full copy, so hot paths must not use it.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 group_size: int = GROUP_SIZE, dtype=torch.bfloat16, device=None):
        super().__init__()
        if in_features % group_size:
            raise ValueError(f"in_features={in_features} is not a multiple of the group size {group_size}")
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scale", torch.ones(out_features, in_features // group_size, dtype=dtype, device=device))
        self.register_buffer("zero", torch.zeros(out_features, in_features // group_size, dtype=torch.uint8,
                                                 device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = None
        self.use_kernel: Optional[bool] = None  # None: kernel when available, else reference
        # "bf16": matmuls in the activations' dtype (qtype int4_fused); "8bit": 8-bit activations
        # and weight slices, toolkit/int4_w4a8.py (qtype int4_w4a8). Not stored in the cache.
        self.activations = ACTIVATIONS_BF16

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = GROUP_SIZE, dtype=None) -> "Int4Linear":
        """Quantize an nn.Linear (its weight cast to ``dtype`` first, default: its own dtype)."""
        w = linear.weight.detach()
        if dtype is not None:
            w = w.to(dtype)
        mod = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  group_size=group_size, dtype=w.dtype, device=w.device)
        q, s, z = quantize_weight(w, group_size)
        mod.qweight.copy_(q)
        mod.scale.copy_(s)
        mod.zero.copy_(z)
        if linear.bias is not None:
            mod.bias.copy_(linear.bias.detach().to(w.dtype))
        return mod

    # ---- the quantized-cache format: a flat dict of tensors + JSON-able meta
    def to_tensors(self, prefix: str = "") -> tuple[dict, dict]:
        tensors = {prefix + "qweight": self.qweight, prefix + "scale": self.scale, prefix + "zero": self.zero}
        if self.bias is not None:
            tensors[prefix + "bias"] = self.bias
        meta = {
            "format": FORMAT, "version": FORMAT_VERSION, "group_size": self.group_size,
            "in_features": self.in_features, "out_features": self.out_features,
            "dtype": str(self.scale.dtype).replace("torch.", ""), "bias": self.bias is not None,
            "layout": "qweight u8[out,in/2] lo=even; scale[out,in/g]; zero u8[out,in/g]; w=(q-zero)*scale",
        }
        return tensors, meta

    @classmethod
    def from_tensors(cls, tensors: dict, meta: dict, prefix: str = "") -> "Int4Linear":
        if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
            raise ValueError(f"not an {FORMAT} v{FORMAT_VERSION} layer: {json.dumps(meta)[:200]}")
        q = tensors[prefix + "qweight"]
        s = tensors[prefix + "scale"]
        z = tensors[prefix + "zero"]
        in_f, out_f, g = meta["in_features"], meta["out_features"], meta["group_size"]
        expect = {"qweight": (out_f, in_f // 2), "scale": (out_f, in_f // g), "zero": (out_f, in_f // g)}
        for name, t in (("qweight", q), ("scale", s), ("zero", z)):
            if tuple(t.shape) != expect[name]:
                raise ValueError(f"{prefix}{name} has shape {tuple(t.shape)}, expected {expect[name]}")
        if q.dtype != torch.uint8 or z.dtype != torch.uint8:
            raise ValueError(f"{prefix}qweight/zero must be uint8")
        mod = cls(in_f, out_f, bias=meta.get("bias", False), group_size=g, dtype=s.dtype, device=q.device)
        mod.qweight = q.contiguous()
        mod.scale = s.contiguous()
        mod.zero = z.contiguous()
        if meta.get("bias"):
            mod.bias = tensors[prefix + "bias"].contiguous()
        return mod

    @property
    def weight(self) -> torch.Tensor:
        return dequantize_weight(self.qweight, self.scale, self.zero, self.group_size)

    def dequantize(self, dtype=None) -> torch.Tensor:
        return dequantize_weight(self.qweight, self.scale, self.zero, self.group_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations == ACTIVATIONS_8BIT:
            from toolkit.int4_w4a8 import w4a8_linear

            return w4a8_linear(self, x, self.use_kernel)
        use_kernel = self.use_kernel
        if use_kernel is None:
            use_kernel = kernel_available(x)
        return Int4LinearFunction.apply(x, self.qweight, self.scale, self.zero, self.bias,
                                        self.group_size, bool(use_kernel))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, group_size={self.group_size}, 4-bit, "
                f"activations={self.activations}")


def quantize_linears(module: nn.Module, filter_fn=None, group_size: int = GROUP_SIZE, dtype=None) -> list[str]:
    """Replace every nn.Linear under ``module`` (where filter_fn(name, linear) is true) by Int4Linear.

    Returns the names replaced. Layers whose in_features is not a multiple of
    the group size are left alone only if filter_fn excludes them; otherwise
    ValueError says which layer.
    """
    done = []
    for name, child in list(module.named_modules()):
        for cname, sub in list(child.named_children()):
            full = f"{name}.{cname}" if name else cname
            if type(sub) is nn.Linear and (filter_fn is None or filter_fn(full, sub)):
                setattr(child, cname, Int4Linear.from_linear(sub, group_size, dtype))
                done.append(full)
    return done
