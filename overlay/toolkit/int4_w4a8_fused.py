"""qtype int4_w4a8, gemm "fused": the 4-bit weight requantized to 8 bits inside the matmul.

toolkit/int4_w4a8.py's "triton" and "scaled_mm" paths requantize the packed 4-bit weight into an
8-bit buffer one slice at a time, then read that buffer back in an 8-bit GEMM: per call the
weight is read as 4 bits, written as 8 and read again. Here a pair of Triton kernels loads the
packed 4-bit tile with its group scale and zero point, dequantizes it and rounds it to the 8-bit
grid in registers, and feeds the tile to tl.dot beside the already-quantized activation tile:

  forward   y[m, n]  = sum_k xq[m, k]  * to_grid(W[n, k] * row_inv[n]) * xs[m]  * row[n]
  backward  dx[m, k] = sum_n dyq[m, n] * to_grid(W[n, k] * col_inv[k]) * dys[m] * col[k]

The rounding is the one of int4_w4a8's `_requantize_kernel` and `requantized_weight_reference`
(the same fp32 products, the same `_to_grid`), so the codes are identical to the sliced paths'
and the result differs from the reference only by the fp32 summation order (FP8; int8 sums in
int32, exactly). The activations are still quantized per row by int4_w4a8's `quantize_rows`;
no weight buffer of any size is written. Tiles are laid out as toolkit/int4_kernels.py's bf16
fused kernels lay them (one quantization group of 64 inputs per reduction step in the forward;
one or two groups of output columns per program in the input gradient), whose helpers are reused.

Tested: Triton's CPU interpreter (both orientations, FP8 and int8, partial tiles); compiled by
Triton 3.6 without a GPU for sm_90 (every config, on the wgmma path) and gfx1100 (int8). Not yet
run or timed on any GPU; ROCm gets its own small autotuning lists.
"""

from __future__ import annotations

import torch

from toolkit.int4_kernels import GROUP_SIZE, HAVE_TRITON, _check, _shapes
from toolkit.int4_w4a8 import FP8, K_ALIGN, QMAX, quantize_rows

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from toolkit.int4_kernels import _fused_bwd_store, _swizzle, _unpack_dequant
    from toolkit.int4_w4a8 import _autotune, _is_hip, _to_grid

    def _fwd_configs():
        if _is_hip():  # untested: RDNA3 (wave32 WMMA), small stage counts
            shapes = [(64, 64, 0, 4, 2), (128, 64, 0, 4, 2), (128, 128, 0, 8, 2), (64, 128, 1, 4, 2)]
        else:
            # each weight tile is requantized once per program: tall tiles (BLOCK_M 256) spread that
            # work over more tokens; BLOCK_M 64 for the short text-token matmuls
            shapes = [(128, 128, 0, 4, 4), (256, 128, 0, 8, 3), (128, 128, 1, 4, 4),
                      (256, 128, 1, 8, 3), (128, 256, 1, 8, 3), (64, 128, 1, 4, 4)]
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "W_AS_A": a, "GROUP_M": 8}, num_warps=w, num_stages=s)
                for bm, bn, a, w, s in shapes]

    def _bwd_configs():
        if _is_hip():
            shapes = [(64, 64, 1, 0, 4, 2), (128, 64, 1, 0, 4, 2), (128, 64, 2, 0, 8, 2), (64, 64, 2, 1, 4, 2)]
        else:
            shapes = [(128, 128, 2, 0, 8, 3), (256, 128, 2, 0, 8, 3), (128, 64, 2, 0, 8, 4),
                      (128, 128, 2, 1, 8, 3), (256, 64, 2, 1, 8, 3), (128, 128, 1, 0, 4, 4)]
        assert all(K_ALIGN % br == 0 for _, br, *_ in shapes)  # quantize_rows pads to K_ALIGN columns
        return [triton.Config({"BLOCK_M": bm, "BLOCK_R": br, "NSUB": ns, "W_AS_A": a, "GROUP_M": 8},
                              num_warps=w, num_stages=s)
                for bm, br, ns, a, w, s in shapes]

    @triton.jit
    def _requantized(b, s, z, inverse, PER_COLUMN: tl.constexpr, QMAX: tl.constexpr, FP8: tl.constexpr):
        # b [R, GROUP // 2] packed bytes, s / z [R] -> [R, GROUP] 8-bit codes; inverse [R] per row
        # of W (forward) or [GROUP] per column (input gradient): _requantize_kernel's arithmetic
        w = _unpack_dequant(b, s, z, tl.float32)
        if PER_COLUMN:
            w = w * inverse[None, :]
        else:
            w = w * inverse[:, None]
        return _to_grid(w, QMAX, FP8)

    @triton.jit
    def _dot8(a, b, acc, FP8: tl.constexpr):
        # one return: a helper whose branches return different types does not compile
        if FP8:
            acc = tl.dot(a, b, acc)
        else:
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        return acc

    @_autotune(configs=_fwd_configs(), key=["M", "N", "K"])
    @triton.jit
    def _fused_gemm_fwd_kernel(
        xq_ptr, xs_ptr, qw_ptr, s_ptr, z_ptr, inv_ptr, ws_ptr, y_ptr,
        M, N, K,
        stride_xm, stride_ym, stride_qn, stride_sn,
        QMAX: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, W_AS_A: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        # y[M, N] = xq[M, K] @ Wq[N, K]^T * xs[m] * ws[n], one quantization group per step
        pid_m, pid_n = _swizzle(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M  # wrap: loads need no row mask
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        offs_k = tl.arange(0, GROUP)
        rows_x = offs_m.to(tl.int64) * stride_xm
        rows_w = offs_n.to(tl.int64)
        w_ptrs = qw_ptr + (rows_w * stride_qn)[:, None] + tl.arange(0, GROUP // 2)[None, :]
        s_ptrs = s_ptr + rows_w * stride_sn
        z_ptrs = z_ptr + rows_w * stride_sn
        inverse = tl.load(inv_ptr + offs_n)
        acc_type = tl.float32 if FP8 else tl.int32
        if W_AS_A:
            x_ptrs = xq_ptr + rows_x[None, :] + offs_k[:, None]
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=acc_type)
        else:
            x_ptrs = xq_ptr + rows_x[:, None] + offs_k[None, :]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_type)
        for g in range(0, K // GROUP):
            xt = tl.load(x_ptrs)
            wq = _requantized(tl.load(w_ptrs), tl.load(s_ptrs + g), tl.load(z_ptrs + g), inverse, False, QMAX, FP8)
            if W_AS_A:
                acc = _dot8(wq, xt, acc, FP8)
            else:
                acc = _dot8(xt, tl.trans(wq), acc, FP8)
            x_ptrs += GROUP
            w_ptrs += GROUP // 2
        xs = tl.load(xs_ptr + offs_m)
        ws = tl.load(ws_ptr + offs_n)
        out_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        out_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if W_AS_A:
            out = acc.to(tl.float32) * xs[None, :] * ws[:, None]  # the sliced GEMM's order: the same bits
            y_ptrs = y_ptr + out_m.to(tl.int64)[None, :] * stride_ym + out_n[:, None]
            mask = (out_m[None, :] < M) & (out_n[:, None] < N)
        else:
            out = acc.to(tl.float32) * xs[:, None] * ws[None, :]
            y_ptrs = y_ptr + out_m.to(tl.int64)[:, None] * stride_ym + out_n[None, :]
            mask = (out_m[:, None] < M) & (out_n[None, :] < N)
        tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _bwd_epilogue(dx_ptr, acc, dys, ws_ptr, gi, out_m, M, K, stride_dxm,
                      GROUP: tl.constexpr, W_AS_A: tl.constexpr):
        ws = tl.load(ws_ptr + gi * GROUP + tl.arange(0, GROUP))
        if W_AS_A:
            out = acc.to(tl.float32) * dys[None, :] * ws[:, None]
        else:
            out = acc.to(tl.float32) * dys[:, None] * ws[None, :]
        _fused_bwd_store(dx_ptr, out, out_m, gi, M, K, stride_dxm, GROUP, W_AS_A)

    @triton.jit
    def _bwd_step(dyt, w_ptrs, s_ptrs, z_ptrs, inverse, acc, live, EVEN_R: tl.constexpr,
                  QMAX: tl.constexpr, FP8: tl.constexpr, W_AS_A: tl.constexpr):
        # one BLOCK_R x GROUP tile of W (rows past N masked to code 0) into acc
        if EVEN_R:
            wq = _requantized(tl.load(w_ptrs), tl.load(s_ptrs), tl.load(z_ptrs), inverse, True, QMAX, FP8)
        else:
            wq = _requantized(tl.load(w_ptrs, mask=live[:, None], other=0), tl.load(s_ptrs, mask=live, other=0.0),
                              tl.load(z_ptrs, mask=live, other=0), inverse, True, QMAX, FP8)
        if W_AS_A:
            acc = _dot8(tl.trans(wq), dyt, acc, FP8)
        else:
            acc = _dot8(dyt, wq, acc, FP8)
        return acc

    @_autotune(configs=_bwd_configs(), key=["M", "N", "K"])
    @triton.heuristics({"EVEN_R": lambda a: a["N"] % a["BLOCK_R"] == 0})
    @triton.jit
    def _fused_gemm_bwd_kernel(
        dyq_ptr, dys_ptr, qw_ptr, s_ptr, z_ptr, inv_ptr, ws_ptr, dx_ptr,
        M, N, K,
        stride_dym, stride_dxm, stride_qn, stride_sn,
        QMAX: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_R: tl.constexpr, NSUB: tl.constexpr, W_AS_A: tl.constexpr, GROUP_M: tl.constexpr,
        EVEN_R: tl.constexpr,
    ):
        # dx[M, K] = dyq[M, N] @ Wq[N, K] * dys[m] * ws[k]: each program owns NSUB (1 or 2)
        # quantization groups of output columns, so every W tile has one scale per row
        pid_m, pid_k = _swizzle(tl.program_id(0), M, K, BLOCK_M, GROUP * NSUB, GROUP_M)
        n_groups = K // GROUP
        g0 = pid_k * NSUB
        g1 = tl.minimum(g0 + 1, n_groups - 1)
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
        offs_r = tl.arange(0, BLOCK_R)
        offs_b = tl.arange(0, GROUP // 2)
        rows_dy = offs_m.to(tl.int64) * stride_dym
        acc_type = tl.float32 if FP8 else tl.int32
        if W_AS_A:
            dy_ptrs = dyq_ptr + rows_dy[None, :] + offs_r[:, None]
            acc0 = tl.zeros((GROUP, BLOCK_M), dtype=acc_type)
            acc1 = tl.zeros((GROUP, BLOCK_M), dtype=acc_type)
        else:
            dy_ptrs = dyq_ptr + rows_dy[:, None] + offs_r[None, :]
            acc0 = tl.zeros((BLOCK_M, GROUP), dtype=acc_type)
            acc1 = tl.zeros((BLOCK_M, GROUP), dtype=acc_type)
        inv0 = tl.load(inv_ptr + g0 * GROUP + tl.arange(0, GROUP))
        inv1 = tl.load(inv_ptr + g1 * GROUP + tl.arange(0, GROUP))
        w_rows = offs_r.to(tl.int64) * stride_qn
        s_rows = offs_r.to(tl.int64) * stride_sn
        w0_ptrs = qw_ptr + w_rows[:, None] + (g0 * (GROUP // 2) + offs_b)[None, :]
        w1_ptrs = qw_ptr + w_rows[:, None] + (g1 * (GROUP // 2) + offs_b)[None, :]
        for r0 in range(0, N, BLOCK_R):
            live = (r0 + offs_r) < N
            dyt = tl.load(dy_ptrs)  # in bounds, zero past N: dyq's columns are padded to a multiple of BLOCK_R
            rows_sz = s_rows + r0 * stride_sn
            acc0 = _bwd_step(dyt, w0_ptrs, s_ptr + rows_sz + g0, z_ptr + rows_sz + g0, inv0, acc0, live,
                             EVEN_R, QMAX, FP8, W_AS_A)
            if NSUB == 2:
                acc1 = _bwd_step(dyt, w1_ptrs, s_ptr + rows_sz + g1, z_ptr + rows_sz + g1, inv1, acc1, live,
                                 EVEN_R, QMAX, FP8, W_AS_A)
            dy_ptrs += BLOCK_R
            w0_ptrs += BLOCK_R * stride_qn
            w1_ptrs += BLOCK_R * stride_qn
        dys = tl.load(dys_ptr + offs_m)
        out_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        _bwd_epilogue(dx_ptr, acc0, dys, ws_ptr, g0, out_m, M, K, stride_dxm, GROUP, W_AS_A)
        if NSUB == 2:
            if g0 + 1 < n_groups:
                _bwd_epilogue(dx_ptr, acc1, dys, ws_ptr, g0 + 1, out_m, M, K, stride_dxm, GROUP, W_AS_A)


def fused_8bit_matmul(a2d, qweight, scale, zero, scales, fmt: str, group_size: int = GROUP_SIZE,
                      transposed: bool = False):
    """Triton: a2d @ W^T (forward) or a2d @ W (transposed: the input gradient) in a2d's dtype,
    a2d quantized per row, W requantized tile by tile in registers (`scales`: int4_w4a8's
    WeightScales of this weight and format)."""
    _check(qweight, scale, zero, group_size)
    a2d = a2d.contiguous()
    M, N, K = _shapes(a2d, qweight, group_size, "bwd" if transposed else "fwd")
    out = torch.empty((M, K if transposed else N), device=a2d.device, dtype=a2d.dtype)
    if M == 0:
        return out
    aq, a_scale = quantize_rows(a2d, fmt)
    common = dict(QMAX=QMAX[fmt], FP8=fmt == FP8, GROUP=group_size)
    if transposed:
        def grid(meta):
            return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(K, group_size * meta["NSUB"]),)

        _fused_gemm_bwd_kernel[grid](aq, a_scale, qweight, scale, zero, scales.col_inv, scales.col, out, M, N, K,
                                     aq.stride(0), out.stride(0), qweight.stride(0), scale.stride(0), **common)
        return out

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _fused_gemm_fwd_kernel[grid](aq, a_scale, qweight, scale, zero, scales.row_inv, scales.row, out, M, N, K,
                                 aq.stride(0), out.stride(0), qweight.stride(0), scale.stride(0), **common)
    return out
