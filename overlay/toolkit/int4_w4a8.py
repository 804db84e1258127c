"""8-bit activations for the frozen 4-bit Linear (qtype int4_w4a8).

The weight stays exactly what toolkit/int4_linear.py stores (packed 4-bit codes, one
scale and zero point per group of 64 inputs, torchao-uint4 numerics, the same quantized
cache). What changes is the precision the matmuls run in: both operands are 8-bit, so
the GPU's 8-bit matrix units do the work (twice the bf16 rate on NVIDIA sm89+ and on
RDNA3's int8 WMMA path):

  forward   y  = x  @ W^T : x quantized per token (row), W requantized per output row
  backward  dx = dy @ W   : dy quantized per token,     W requantized per input column

  activations  per row r: amax_r = max |x[r, :]|, code = x / amax_r * QMAX
  weight       per row n (forward) or column k (backward): amax over the dequantized
               4-bit weight (computed once per layer), code = W / amax * QMAX
  8-bit type   FP8 e4m3 (QMAX 448, round to nearest even) where the GPU has FP8 matrix
               units (NVIDIA compute capability 8.9 and newer, AMD gfx12), int8 (QMAX 127, round
               half up) elsewhere (flux2_contract/qtypes.py decides once at load time; INT4_W4A8_ACT overrides).
  result       y[r, n] = sum_k code_x[r, k] * code_w[n, k] * (amax_r / QMAX) * (amax_n / QMAX),
               accumulated in int32 (int8) or fp32 (fp8; torch._scaled_mm's forward in the tensor
               cores' own accumulator: fast_accumulation), written in the input's dtype.

The 4-bit weight is requantized to 8 bits one slice at a time (the kernel's chunk_bytes,
256 MiB of 8-bit weight by default) by a Triton kernel, then multiplied by a Triton 8-bit GEMM with the two
scales applied in its epilogue (gemm "triton", the portable default) or, for FP8 on
NVIDIA, by torch._scaled_mm (cuBLASLt, gemm "scaled_mm"; fast accumulation in the forward only:
fast_accumulation); a weight that fits one slice is multiplied whole, into the GEMM's own output.
Nothing but the packed weight is kept between calls, unless the layer holds a whole 8-bit copy
(eight_bit_copy; where VRAM allows: twice the 4-bit weight per orientation; the requantization,
59 ms of a 0.41 s compiled 512 px step at 44 blocks on an H200 (bench/RESULTS.md), is then skipped;
held_copy_matmul). A layer holding both copies reads nothing else, and frees the packed weight.
In a compiled block, FP8 against a held copy through torch._scaled_mm is plain PyTorch
(traced_copy_matmul): Inductor fuses the activation quantization into the kernel that makes the
activation and calls cuBLASLt itself, with none of the operator's host work per call. LoRA adapters
and every trainable tensor stay in bf16 (this module only computes the frozen base's matmuls and the
input gradient through them).

gemm "in_register" (forward and recompute) writes no 8-bit weight at all: its Triton GEMM reads the
packed 4-bit tile and feeds the MMA the exact integers q - zero (-15..15, exact in int8 and e4m3:
unpack, subtract, convert; FP8 through fp16, 0x6400 | q being 1024 + q), one group of 64 inputs per
MMA step, and applies the group's scale on the accumulator (FP8: the accumulator is kept in units of the
current group's scale, so the MMA adds into it: one multiply per accumulator element and group, one
accumulator); the token scale in the epilogue:
  y[r, n] = (amax_r / QMAX) * sum_g scale[n, g] * sum_{k in g} code_x[r, k] * (q[n, k] - zero[n, g])
The weight is not rounded to 8 bits, so this is closer to the bf16-activation path than the sliced
paths (reference_fwd_in_register). Its input gradient reduces over W's rows, along which the group
scale varies, so the scale cannot be applied on the accumulator there (folding it into dy instead
would requantize dy once per group of 64 outputs, more conversions than the weight requantization
saves): the input gradient stays the sliced path's, through the Triton GEMM.

reference_fwd / reference_bwd compute the same quantization in plain PyTorch (fp32
matmuls of the 8-bit values): the CPU path, and the oracle the kernels are checked
against.

Quality (relative error against the bf16-activation path on the same 4-bit weight, whose own
error against the bf16 weight is ~0.09): fp8 ~0.037, int8 ~0.012 on N(0, 1) activations; with
a few 100x outlier channels, as transformer activations have, fp8 stays ~0.032 while int8
grows to 0.13-0.22 at FLUX.2 widths (one step per token is stretched by the outliers).
Tested: NVIDIA H200 (every path against the reference at the FLUX.2 block shapes; see
bench/RESULTS.md in the launcher repository) and Triton's CPU interpreter. Not tested on any
AMD GPU: the int8 path is written for RDNA3 (Triton's int8 tl.dot) but has never run there.
gemm in_register has run on Triton's CPU interpreter (against reference_fwd_in_register), been compiled
for every target (bench/kernel_isa.py), and run on an H100: within its gate (0.010 against its reference,
0.028 against bf16 activations), but its forward took 2.1x (512 px) and 2.7x (1024 px) the sliced one's
time, so `auto` keeps it only where a card's self-test finds it faster.
bench/kernel_isa.py compiles every kernel for RDNA3/4 and consumer NVIDIA on the CPU (int8 WMMA,
no spills, LDS within 64 KiB); `python -m launcher selftest` is how it gets checked on a user's card.
"""

from __future__ import annotations

import torch

from toolkit.int4_kernels import (GROUP_SIZE, HAVE_TRITON, config_family, dequantize_weight, tuning_arch,
                                  unpack_uint4)
from flux2_contract.qtypes import FP8, IN_REGISTER, INT8, Int4Kernel

QMAX = {FP8: 448.0, INT8: 127.0}
SLICE_ALIGN = 128  # rows / columns per requantized slice: a multiple of the GEMM tiles
K_ALIGN = 128  # the GEMM's reduction width is zero-padded to this (its largest BLOCK_K)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from toolkit.int4_kernels import _group_of_rows, _swizzle


# --------------------------------------------------------------------------- choices


def torch_dtype(fmt: str) -> torch.dtype:
    return torch.float8_e4m3fn if fmt == FP8 else torch.int8


# --------------------------------------------------------------------------- weight scales


def weight_absmax(qweight, scale, zero, group_size: int = GROUP_SIZE):
    """(max |W[n, :]| per row, max |W[:, k]| per column) of the dequantized weight, fp32.

    |(q - zero) * scale| is exact in fp32, so these are the exact maxima of the weight the
    kernels compute with. Rows are taken a few MiB at a time.
    """
    n_rows, k_cols = qweight.shape[0], qweight.shape[1] * 2
    groups = k_cols // group_size
    rows_at_once = max(1, 2**22 // k_cols)
    row_max = torch.empty(n_rows, dtype=torch.float32, device=qweight.device)
    col_max = torch.zeros(k_cols, dtype=torch.float32, device=qweight.device)
    for r0 in range(0, n_rows, rows_at_once):
        r1 = min(n_rows, r0 + rows_at_once)
        codes = unpack_uint4(qweight[r0:r1]).reshape(r1 - r0, groups, group_size).to(torch.int16)
        centred = (codes - zero[r0:r1].to(torch.int16)[..., None]).abs().to(torch.float32)
        w = centred * scale[r0:r1].to(torch.float32).abs()[..., None]
        row_max[r0:r1] = w.amax(dim=(1, 2))
        col_max = torch.maximum(col_max, w.reshape(r1 - r0, k_cols).amax(dim=0))
    return row_max, col_max


def scales_from_absmax(absmax: torch.Tensor, fmt: str):
    """(scale, inverse) with code = value * inverse and value ~= code * scale; 0 maps to 0."""
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    return (safe / QMAX[fmt]).contiguous(), (QMAX[fmt] / safe).contiguous()


class WeightScales:
    """The per-row and per-column 8-bit scales of one 4-bit weight, for one format."""

    def __init__(self, qweight, scale, zero, group_size: int, fmt: str):
        row_max, col_max = weight_absmax(qweight, scale, zero, group_size)
        self.row, self.row_inv = scales_from_absmax(row_max, fmt)
        self.col, self.col_inv = scales_from_absmax(col_max, fmt)


def weight_scales(qweight, scale, zero, group_size: int, fmt: str) -> WeightScales:
    """The weight's scales, computed on first use on its device and kept on the qweight tensor
    itself (the weight is frozen, and the 4-bit matmul operator sees tensors, not the module),
    with the address they were derived at: a tensor whose storage was swapped derives them again."""
    address = (qweight.data_ptr(), qweight.device)
    held = qweight.__dict__.get("_w4a8_scales")
    if held is None or held[0] != address:
        held = qweight.__dict__["_w4a8_scales"] = (address, {})
    scales = held[1].get(fmt)
    if scales is None or scales.row.device != qweight.device:
        scales = held[1][fmt] = WeightScales(qweight, scale, zero, group_size, fmt)
    return scales


def carry_scales(source: torch.Tensor, target: torch.Tensor) -> None:
    """`target` is another copy of `source`'s frozen weight (a streamed block's next device copy, or
    its host copy between turns): it takes the scales `source` holds (they stay on their device:
    two small vectors), so they are not derived again from the weight."""
    held = source.__dict__.get("_w4a8_scales")
    if held is not None:
        target.__dict__["_w4a8_scales"] = ((target.data_ptr(), target.device), held[1])


# --------------------------------------------------------------------------- reference (CPU, oracle)


def to_grid(values: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values already divided by their scale -> the 8-bit codes, as fp32."""
    values = values.clamp(-QMAX[fmt], QMAX[fmt])
    if fmt == INT8:
        return torch.floor(values + 0.5)
    return values.to(torch.float8_e4m3fn).to(torch.float32)


def quantize_rows_reference(x2d: torch.Tensor, fmt: str):
    """Per-row (per-token) 8-bit codes as fp32, and the row scales."""
    xf = x2d.to(torch.float32)
    scale, inverse = scales_from_absmax(xf.abs().amax(dim=1), fmt)
    return to_grid(xf * inverse[:, None], fmt), scale


def requantized_weight_reference(qweight, scale, zero, inverse, per_column: bool, fmt: str,
                                 group_size: int = GROUP_SIZE) -> torch.Tensor:
    """W[N, K] as 8-bit codes (fp32) with one inverse scale per row, or per column."""
    n_rows = qweight.shape[0]
    codes = unpack_uint4(qweight).reshape(n_rows, -1, group_size).to(torch.float32)
    w = ((codes - zero.to(torch.float32)[..., None]) * scale.to(torch.float32)[..., None]).reshape(n_rows, -1)
    return to_grid(w * (inverse[None, :] if per_column else inverse[:, None]), fmt)


def reference_fwd(x2d, qweight, scale, zero, scales: WeightScales, fmt: str, group_size: int = GROUP_SIZE):
    xq, x_scale = quantize_rows_reference(x2d, fmt)
    wq = requantized_weight_reference(qweight, scale, zero, scales.row_inv, False, fmt, group_size)
    y = (xq @ wq.t()) * x_scale[:, None] * scales.row[None, :]
    return y.to(x2d.dtype)


def reference_bwd(dy2d, qweight, scale, zero, scales: WeightScales, fmt: str, group_size: int = GROUP_SIZE):
    dyq, dy_scale = quantize_rows_reference(dy2d, fmt)
    wq = requantized_weight_reference(qweight, scale, zero, scales.col_inv, True, fmt, group_size)
    dx = (dyq @ wq) * dy_scale[:, None] * scales.col[None, :]
    return dx.to(dy2d.dtype)


def reference_fwd_in_register(x2d, qweight, scale, zero, fmt: str, group_size: int = GROUP_SIZE):
    """gemm "in_register"'s forward: x quantized per token as above, the 4-bit weight exact (no 8-bit
    rounding): (q - zero) * scale in fp32, which is exact."""
    xq, x_scale = quantize_rows_reference(x2d, fmt)
    w = dequantize_weight(qweight, scale.to(torch.float32), zero, group_size, torch.float32)
    return ((xq @ w.t()) * x_scale[:, None]).to(x2d.dtype)


# --------------------------------------------------------------------------- Triton kernels

if HAVE_TRITON:

    GEMM = {  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages (config_family; none spills: bench/kernel_isa.py)
        "amd": [(128, 128, 64, 4, 2), (64, 128, 64, 4, 2), (128, 64, 64, 4, 2), (64, 64, 64, 4, 2)],
        "nvidia": [(128, 128, 128, 8, 3), (128, 256, 128, 8, 3), (256, 128, 128, 8, 3),
                   (128, 128, 64, 4, 4), (64, 128, 128, 4, 4)],
    }
    GEMM["nvidia_99k"] = GEMM["nvidia"]  # fits the consumer parts: at most 96 KiB of shared memory, 254 registers

    def gemm_configs(arch: str):
        """The 8-bit GEMM's autotuning list on `arch` (bench/kernel_isa.py compiles each)."""
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
                for bm, bn, bk, w, s in GEMM[config_family(arch)]]

    def _quick_bench(fn, quantiles=None):
        # 5 ms warm-up / 25 ms of runs per config: tuning a first launch costs seconds, not minutes
        return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)

    def _autotune(**kwargs):
        """triton.autotune with on-disk results (cache_results) and short timings (do_bench) where
        this Triton knows them (3.3 and newer); TRITON_CACHE_AUTOTUNING=1, which `launcher run`
        and `selftest` set, keeps every kernel's results on disk too."""
        import inspect

        known = inspect.signature(triton.autotune).parameters
        if "cache_results" in known:
            kwargs["cache_results"] = True
        if "do_bench" in known:
            kwargs["do_bench"] = _quick_bench
        return triton.autotune(**kwargs)

    @triton.jit
    def _to_grid(v, QMAX: tl.constexpr, FP8: tl.constexpr):
        v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
        if FP8:
            codes = v.to(tl.float8e4nv)  # round to nearest even (Triton's default)
        else:
            codes = tl.floor(v + 0.5).to(tl.int8)
        return codes

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q,
                              QMAX: tl.constexpr, FP8: tl.constexpr, BLOCK: tl.constexpr):
        # one program per row: max |x| over the row, then codes = x * QMAX / max
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            live = k0 + offs < K
            v = tl.load(x_ptr + row * stride_x + k0 + offs, mask=live, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        top = tl.max(amax, axis=0)
        top = tl.where(top > 0, top, 1.0)
        inverse = QMAX / top
        for k0 in range(0, K, BLOCK):
            live = k0 + offs < K
            v = tl.load(x_ptr + row * stride_x + k0 + offs, mask=live, other=0.0).to(tl.float32)
            tl.store(q_ptr + row * stride_q + k0 + offs, _to_grid(v * inverse, QMAX, FP8), mask=live)
        tl.store(s_ptr + row, top / QMAX)

    @triton.jit
    def _requantize_kernel(qw_ptr, s_ptr, z_ptr, inv_ptr, out_ptr, N, g_first, stride_qn, stride_sn, stride_out,
                           QMAX: tl.constexpr, FP8: tl.constexpr, PER_COLUMN: tl.constexpr,
                           GROUP: tl.constexpr, BLOCK_R: tl.constexpr):
        # Group j of the slice (absolute group g_first + j) for BLOCK_R weight rows, as 8-bit codes.
        # Per row (forward): out[r, j*GROUP + i] = W[r, ...] * inv[r]           (out: [rows, slice])
        # Per column (backward): out[j*GROUP + i, r] = W[r, ...] * inv[col]    (out: [slice, rows])
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        j = tl.program_id(1)
        g = g_first + j
        live = rows < N
        rows64 = rows.to(tl.int64)
        w = _group_of_rows(qw_ptr, s_ptr, z_ptr, rows, g, N, stride_qn, stride_sn, tl.float32, GROUP)
        offs_c = j * GROUP + tl.arange(0, GROUP)
        if PER_COLUMN:
            inverse = tl.load(inv_ptr + g * GROUP + tl.arange(0, GROUP))
            codes = _to_grid(w * inverse[None, :], QMAX, FP8)
            ptrs = out_ptr + offs_c.to(tl.int64)[None, :] * stride_out + rows64[:, None]
        else:
            inverse = tl.load(inv_ptr + rows64, mask=live, other=0.0)
            codes = _to_grid(w * inverse[:, None], QMAX, FP8)
            ptrs = out_ptr + rows64[:, None] * stride_out + offs_c[None, :]
        tl.store(ptrs, codes, mask=live[:, None])

    @_autotune(configs=gemm_configs(tuning_arch()), key=["M", "N", "K"])
    @triton.jit
    def _scaled_gemm_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, M, N, K, stride_am, stride_bn, stride_cm,
                            FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        # c[m, n] = (sum_k a[m, k] * b[n, k]) * sa[m] * sb[n]; a and b 8-bit with contiguous rows,
        # K a multiple of K_ALIGN (the callers zero-pad both operands), so no load needs a mask
        pid_m, pid_n = _swizzle(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M  # wrap: loads need no row mask
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + (offs_m.to(tl.int64) * stride_am)[:, None] + offs_k[None, :]
        b_ptrs = b_ptr + (offs_n.to(tl.int64) * stride_bn)[None, :] + offs_k[:, None]
        if FP8:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for _ in range(0, K // BLOCK_K):
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
            if FP8:
                acc = tl.dot(a, b, acc)
            else:
                acc = tl.dot(a, b, acc, out_dtype=tl.int32)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        sa = tl.load(sa_ptr + offs_m)
        sb = tl.load(sb_ptr + offs_n)
        out = acc.to(tl.float32) * sa[:, None] * sb[None, :]
        out_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        out_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        c_ptrs = c_ptr + (out_m.to(tl.int64) * stride_cm)[:, None] + out_n[None, :]
        tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=(out_m[:, None] < M) & (out_n[None, :] < N))


    # ---- gemm "in_register": the 4-bit weight read by the GEMM itself, never written in 8 bits

    IN_REGISTER_TILES = {  # BLOCK_N (weight rows), BLOCK_M (tokens), num_warps, num_stages; BLOCK_K is the group (64)
        "amd": [(64, 128, 4, 2), (64, 128, 8, 2), (64, 256, 8, 2)],
        "nvidia": [(128, 128, 8, 4), (128, 256, 8, 3), (256, 128, 8, 3), (64, 128, 4, 4), (128, 64, 4, 4)],
        "nvidia_99k": [(128, 128, 8, 4), (64, 128, 4, 4), (128, 64, 4, 4)],
    }
    INT8_TILE_LIMIT = 128 * 128
    """int8 keeps a second accumulator (the group's int32 product) beside the fp32 one, so on NVIDIA its tiles
    stop at 128x128: the 256-wide ones spill there (sm_90: 712-920 B), while FP8's single accumulator holds
    them (203-222 registers). None of the tiles left spills (bench/kernel_isa.py)."""

    def _tiles_of_format(configs, named_args, **kwargs):
        # the autotuner's early prune: each 8-bit format times only its own tiles
        return [c for c in configs if kwargs["FP8"] or c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_M"] <= INT8_TILE_LIMIT]

    def in_register_configs(arch: str, fp8: bool = True):
        """The in-register GEMM's autotuning list on `arch` for one 8-bit format (bench/kernel_isa.py compiles
        each)."""
        configs = [triton.Config({"BLOCK_N": bn, "BLOCK_M": bm, "GROUP_M": 8}, num_warps=w, num_stages=s)
                   for bn, bm, w, s in IN_REGISTER_TILES[config_family(arch)]]
        return _tiles_of_format(configs, {}, FP8=fp8)

    @triton.jit
    def _centred_codes(b, z, FP8: tl.constexpr):
        # b [R, GROUP // 2] packed bytes, z [R] zero points -> [R, GROUP] the exact integers q - zero
        # (-15..15, exact in int8 and in e4m3). FP8: 0x6400 | q is the fp16 1024 + q, so one OR, one
        # subtract of 1024 + zero and one convert (two elements an instruction) make the e4m3 code
        q = tl.interleave(b & 0xF, b >> 4)
        if FP8:
            biased = (q.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
            codes = (biased - (z.to(tl.float16) + 1024.0)[:, None]).to(tl.float8e4nv)
        else:
            codes = q.to(tl.int8) - z.to(tl.int8)[:, None]
        return codes

    @_autotune(configs=in_register_configs(tuning_arch()), key=["M", "N", "K", "FP8"],
               prune_configs_by={"early_config_prune": _tiles_of_format})
    @triton.jit
    def _in_register_gemm_kernel(a_ptr, qw_ptr, s_ptr, z_ptr, c_ptr, sa_ptr, M, N, K, stride_am, stride_qn,
                                 stride_sn, stride_cm, FP8: tl.constexpr, GROUP: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
        # c[m, n] = sa[m] * sum_g s[n, g] * sum_{k in group g} a[m, k] * (q[n, k] - zero[n, g]): a holds the
        # per-token 8-bit codes, the weight enters the MMA as the exact integers q - zero, and each group's
        # partial product is scaled on the accumulator. The weight tile is the MMA's first operand (computed
        # as c^T, rows of W by tokens), where it may stay in registers; a is read K-major from shared memory.
        pid_n, pid_m = _swizzle(tl.program_id(0), N, M, BLOCK_N, BLOCK_M, GROUP_M)
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N  # wrap: loads need no mask
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
        rows64 = offs_n.to(tl.int64)
        a_ptrs = a_ptr + (offs_m.to(tl.int64) * stride_am)[None, :] + tl.arange(0, GROUP)[:, None]  # [GROUP, BLOCK_M]
        b_ptrs = qw_ptr + (rows64 * stride_qn)[:, None] + tl.arange(0, GROUP // 2)[None, :]
        s_ptrs = s_ptr + rows64 * stride_sn
        z_ptrs = z_ptr + rows64 * stride_sn
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        held = tl.full((BLOCK_N,), 1.0, dtype=tl.float32)  # FP8: the scale whose units acc is in
        for g in range(0, K // GROUP):
            w = _centred_codes(tl.load(b_ptrs), tl.load(z_ptrs + g), FP8)
            a = tl.load(a_ptrs)
            s = tl.maximum(tl.load(s_ptrs + g).to(tl.float32), 2e-30)  # the codes' scales are > 0; a 0 would divide
            if FP8:
                # acc in units of this group's scale, then the MMA adds into it: one accumulator (the tile
                # may be twice as large in the same registers) and one multiply per element and group
                acc = tl.dot(w, a, acc * (held / s)[:, None])
                held = s
            else:
                acc += tl.dot(w, a, out_dtype=tl.int32).to(tl.float32) * s[:, None]
            a_ptrs += GROUP
            b_ptrs += GROUP // 2
        out = acc * held[:, None] * tl.load(sa_ptr + offs_m)[None, :]
        out_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        out_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        c_ptrs = c_ptr + (out_m.to(tl.int64) * stride_cm)[None, :] + out_n[:, None]
        tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=(out_n[:, None] < N) & (out_m[None, :] < M))


def padded(width: int) -> int:
    return -(-width // K_ALIGN) * K_ALIGN


def quantize_rows(x2d: torch.Tensor, fmt: str):
    """Triton: per-row 8-bit codes of x2d (zero-padded to a multiple of K_ALIGN columns) and the
    fp32 row scales."""
    rows, cols = x2d.shape
    codes = torch.empty((rows, padded(cols)), device=x2d.device, dtype=torch_dtype(fmt))
    codes[:, cols:].zero_()
    row_scale = torch.empty(rows, device=x2d.device, dtype=torch.float32)
    if rows:
        _quantize_rows_kernel[(rows,)](x2d, codes, row_scale, cols, x2d.stride(0), codes.stride(0),
                                       QMAX=QMAX[fmt], FP8=fmt == FP8, BLOCK=1024, num_warps=4)
    return codes, row_scale


def requantize_slice(qweight, scale, zero, inverse, out, fmt: str, per_column: bool, start: int,
                     group_size: int = GROUP_SIZE):
    """Triton: 8-bit codes of W rows start.. (per row, out [rows, K]) or of W columns
    start.. (per column, transposed: out [columns, N]); out's padding columns are left alone."""
    if per_column:
        n_rows, groups = qweight.shape[0], out.shape[0] // group_size
        qw, sc, zr, g_first = qweight, scale, zero, start // group_size
    else:
        n_rows, groups = out.shape[0], qweight.shape[1] * 2 // group_size
        qw, sc, zr, g_first, inverse = qweight[start:], scale[start:], zero[start:], 0, inverse[start:]
    grid = (triton.cdiv(n_rows, 64), groups)
    _requantize_kernel[grid](qw, sc, zr, inverse, out, n_rows, g_first, qweight.stride(0), scale.stride(0),
                             out.stride(0), QMAX=QMAX[fmt], FP8=fmt == FP8, PER_COLUMN=per_column,
                             GROUP=group_size, BLOCK_R=64, num_warps=4)
    return out


def fast_accumulation(input_grad: bool) -> bool:
    """Whether torch._scaled_mm sums the FP8 products in the tensor cores' own accumulator, without
    cuBLASLt's periodic promotion to fp32: for the forward and the recompute, not for the input
    gradient. torchao's float8 training splits it the same way (Float8LinearConfig: the output GEMM
    fast, grad_input's not); the input gradient sums over the layer's output width (up to 55296 here),
    where that accumulator's error grows. At FLUX.2's block shapes it took 8-14 % off the forward
    GEMMs' time on an H100 (1024 and 512 px; 2 % on an H200) and moved their result by 0.25-0.43 % of
    its norm, against the 3.8 % the 8-bit activations move it (bench/RESULTS.md)."""
    return not input_grad


def cublaslt_takes(rows: int, columns: int) -> bool:
    """Whether torch._scaled_mm (cuBLASLt's FP8 GEMM) multiplies a result of this shape: multiples of 16."""
    return not (rows % 16 or columns % 16)


def fp8_product(a, b_rows, a_scale, b_scale, out_dtype, input_grad: bool) -> torch.Tensor:
    """(a[M, K] @ b_rows[N, K]^T) * a_scale[:, None] * b_scale[None, :] in out_dtype, both operands FP8:
    the one call of torch._scaled_mm (cuBLASLt), for the operator and for a compiled block's traced
    matmul alike, accumulating as fast_accumulation says for this product."""
    return torch._scaled_mm(a, b_rows.t(), scale_a=a_scale[:, None], scale_b=b_scale[None, :].contiguous(),
                            out_dtype=out_dtype, use_fast_accum=fast_accumulation(input_grad))


def scaled_gemm(a, a_scale, b_rows, b_scale, out, fmt: str, gemm: str, input_grad: bool, dtype=None):
    """out[M, N] = (a[M, K] @ b_rows[N, K]^T) * a_scale[:, None] * b_scale[None, :]; out may be a
    column slice of a larger tensor, or None: a new tensor of `dtype` (torch._scaled_mm's own
    result, no copy); K is a multiple of K_ALIGN. `input_grad`: this product is an input gradient
    (fast_accumulation)."""
    M, K = a.shape
    N = b_rows.shape[0]
    if gemm == "scaled_mm" and cublaslt_takes(M, N):
        product = fp8_product(a, b_rows, a_scale, b_scale, dtype if out is None else out.dtype, input_grad)
        return product if out is None else out.copy_(product)
    if out is None:
        out = torch.empty((M, N), device=a.device, dtype=dtype)

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _scaled_gemm_kernel[grid](a, b_rows, out, a_scale, b_scale, M, N, K, a.stride(0), b_rows.stride(0),
                              out.stride(0), FP8=fmt == FP8)
    return out


def in_register_matmul(a2d, qweight, scale, zero, fmt: str, group_size: int = GROUP_SIZE):
    """a2d[M, K] @ W^T -> [M, N] in a2d's dtype (gemm "in_register"): a2d quantized per token, the 4-bit
    weight read by the GEMM itself and multiplied as the exact integers q - zero, each group's scale
    applied to its partial product (no 8-bit copy of the weight is written)."""
    a2d = a2d.contiguous()
    M, K, N = a2d.shape[0], qweight.shape[1] * 2, qweight.shape[0]
    out = torch.empty((M, N), device=a2d.device, dtype=a2d.dtype)
    if M == 0:
        return out
    aq, a_scale = quantize_rows(a2d, fmt)

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _in_register_gemm_kernel[grid](aq, qweight, scale, zero, out, a_scale, M, N, K, aq.stride(0), qweight.stride(0),
                                   scale.stride(0), out.stride(0), FP8=fmt == FP8, GROUP=group_size)
    return out


def _slice_width(total: int, other: int, chunk_bytes: int) -> int:
    """Rows (or columns) per slice: at most chunk_bytes of 8-bit weight, split evenly."""
    pieces = max(1, -(-total * other // chunk_bytes))
    width = -(-total // pieces)
    return min(total, -(-width // SLICE_ALIGN) * SLICE_ALIGN)


def _orientation(qweight, scales: WeightScales, transposed: bool):
    """(output width, reduction width, inverse scales, output column scales) of one orientation."""
    N, K = qweight.shape[0], qweight.shape[1] * 2
    if transposed:
        return K, N, scales.col_inv, scales.col
    return N, K, scales.row_inv, scales.row


def _weight_buffer(width: int, inner: int, device, fmt: str) -> torch.Tensor:
    """[width, padded(inner)] 8-bit, its padding columns zero (the GEMM reads them against zeros)."""
    buf = torch.empty((width, padded(inner)), device=device, dtype=torch_dtype(fmt))
    buf[:, inner:].zero_()
    return buf


def _sliced_8bit_matmul(a2d, qweight, scale, zero, scales: WeightScales, kernel: Int4Kernel,
                        group_size: int, transposed: bool):
    """a2d @ W^T (forward) or a2d @ W (transposed: the input gradient) in a2d's dtype, through
    8-bit operands: a2d quantized per row once, the 4-bit weight requantized to 8 bits one slice of
    output columns at a time into one reused buffer. A weight that fits one slice is multiplied
    whole, into the GEMM's own output (no copy)."""
    fmt = kernel.activations
    a2d = a2d.contiguous()
    width, inner, inverse, column_scale = _orientation(qweight, scales, transposed)
    if a2d.shape[0] == 0:
        return torch.empty((0, width), device=a2d.device, dtype=a2d.dtype)
    aq, a_scale = quantize_rows(a2d, fmt)
    step = _slice_width(width, inner, kernel.chunk_bytes)
    if step >= width:
        whole = requantize_slice(qweight, scale, zero, inverse, _weight_buffer(width, inner, a2d.device, fmt),
                                 fmt, transposed, 0, group_size)
        return scaled_gemm(aq, a_scale, whole, column_scale, None, fmt, kernel.gemm, transposed, a2d.dtype)
    out = torch.empty((a2d.shape[0], width), device=a2d.device, dtype=a2d.dtype)
    buf = _weight_buffer(step, inner, a2d.device, fmt)
    for first in range(0, width, step):
        last = min(width, first + step)
        w8 = requantize_slice(qweight, scale, zero, inverse, buf[: last - first], fmt, transposed, first, group_size)
        scaled_gemm(aq, a_scale, w8, column_scale[first:last], out[:, first:last], fmt, kernel.gemm, transposed)
    return out


def held_copy_matmul(a2d, codes, column_scale, kernel: Int4Kernel, transposed: bool) -> torch.Tensor:
    """a2d @ W^T (or transposed, a2d @ W) in a2d's dtype against the layer's held 8-bit copy of that
    orientation (eight_bit_copy: its codes and output column scales): the 4-bit weight is not read,
    so a layer holding both copies needs none (Int4Linear.hold_copy frees it)."""
    a2d = a2d.contiguous()
    if a2d.shape[0] == 0:
        return torch.empty((0, codes.shape[0]), device=a2d.device, dtype=a2d.dtype)
    aq, a_scale = quantize_rows(a2d, kernel.activations)
    return scaled_gemm(aq, a_scale, codes, column_scale, None, kernel.activations, kernel.gemm, transposed, a2d.dtype)


def w4a8_matmul(a2d, qweight, scale, zero, group_size: int, kernel: Int4Kernel, use_kernel: bool,
                transposed: bool, copy=None):
    """a2d[M, K] @ W^T -> [M, N] (forward), or a2d[M, N] @ W -> [M, K] (transposed: the input
    gradient), in a2d's dtype through 8-bit operands: the GPU kernels (against `copy`, the layer's
    8-bit copy of this orientation as (codes, column scales), where it holds one), or the reference."""
    fmt = kernel.activations
    if copy is not None and use_kernel:
        return held_copy_matmul(a2d, *copy, kernel, transposed)
    if kernel.gemm == IN_REGISTER and not transposed:
        if use_kernel:
            return in_register_matmul(a2d, qweight, scale, zero, fmt, group_size)
        return reference_fwd_in_register(a2d, qweight, scale, zero, fmt, group_size)
    scales = weight_scales(qweight, scale, zero, group_size, fmt)
    if use_kernel:
        return _sliced_8bit_matmul(a2d, qweight, scale, zero, scales, kernel, group_size, transposed)
    reference = reference_bwd if transposed else reference_fwd
    return reference(a2d, qweight, scale, zero, scales, fmt, group_size)


# --------------------------------------------------------------------------- 8-bit copies


def eight_bit_copy(qweight, scale, zero, group_size: int, fmt: str, transposed: bool):
    """The whole weight requantized to 8 bits in one orientation, for a layer to hold beside its 4-bit
    weight (forward: codes [N, K] and the per-row scales; transposed, the input gradient's: [K, N] and
    the per-column scales): (codes, the scale of each output column). The codes are the ones each call
    would requantize; they cost 1 byte per weight (twice the 4-bit weight) for as long as they are held."""
    scales = weight_scales(qweight, scale, zero, group_size, fmt)
    width, inner, inverse, column_scale = _orientation(qweight, scales, transposed)
    buf = _weight_buffer(width, inner, qweight.device, fmt)
    return requantize_slice(qweight, scale, zero, inverse, buf, fmt, transposed, 0, group_size), column_scale


def traceable_copy(a2d: torch.Tensor, codes: torch.Tensor, kernel: Int4Kernel) -> bool:
    """Whether traced_copy_matmul multiplies a2d against `codes`: FP8 through torch._scaled_mm, no
    padding columns, and a result shape cuBLASLt's FP8 GEMM takes (scaled_gemm's rule)."""
    return (kernel.activations == FP8 and kernel.gemm == "scaled_mm" and codes.shape[1] == a2d.shape[1]
            and cublaslt_takes(a2d.shape[0], codes.shape[0]))


def traced_copy_matmul(a2d: torch.Tensor, codes: torch.Tensor, column_scale: torch.Tensor,
                       input_grad: bool) -> torch.Tensor:
    """a2d @ codes^T scaled, in a2d's dtype: what _sliced_8bit_matmul computes against a held FP8 copy
    (the forward's, or with `input_grad` the input gradient's), written as PyTorch operations for a
    compiled block to trace (the activation quantized as quantize_rows_reference does, which the
    Triton kernel matches code for code)."""
    values, a_scale = quantize_rows_reference(a2d, FP8)
    return fp8_product(values.to(torch_dtype(FP8)), codes, a_scale, column_scale, a2d.dtype, input_grad)
