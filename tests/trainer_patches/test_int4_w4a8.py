"""8-bit activations for the 4-bit Linear (toolkit/int4_w4a8.py, qtype int4_w4a8), on the CPU.

The quality gate at layer level: the 8-bit path's output and input gradient against the
bf16-activation path (int4_fused) on the same 4-bit weight. Measured on N(0, 1) activations
and an N(0, 0.02) weight, relative Frobenius error: int8 0.010-0.012, fp8 0.031-0.038 (the
4-bit weight itself is 0.09 from the bf16 weight). The bounds below are twice those, far
below what a wrong scale, a transposed slice or a lost group would give (>= 0.3).
The reference path is checked for what it promises (codes on the grid, exact weight maxima,
no weight gradient), and the Triton kernels against it under Triton's CPU interpreter. The
training-level gate (same loss as int4_fused) is in test_int4_trainer.py.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

QUALITY_BOUND = {"int8": 0.025, "fp8": 0.075}


@pytest.fixture(scope="module")
def mods(trainer_on_path):
    import importlib

    return (importlib.import_module("toolkit.int4_linear"), importlib.import_module("toolkit.int4_w4a8"))


@pytest.fixture(scope="module")
def qtypes(trainer_on_path):
    import importlib

    return importlib.import_module("flux2_contract.qtypes")


def eight_bit(il, fmt):
    """int4_w4a8's kernel with this 8-bit type, passed explicitly (no environment)."""
    return il.Int4Kernel(fmt, "triton")


def layer(il, out_f, in_f, seed=0, fmt="int8"):
    """An Int4Linear of an N(0, 0.02) weight multiplying with `fmt` activations ("bf16": int4_fused)."""
    g = torch.Generator().manual_seed(seed)
    mod = il.Int4Linear.from_linear(torch.nn.Linear(in_f, out_f, bias=False).requires_grad_(False))
    q, s, z = il.quantize_weight((torch.randn(out_f, in_f, generator=g) * 0.02).bfloat16())
    mod.qweight, mod.scale, mod.zero = q, s, z
    mod.kernel = il.Int4Kernel() if fmt == "bf16" else eight_bit(il, fmt)
    return mod


def relative(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def run_both(il, mod, x, dy):
    """(y, dx) with the module's 8-bit kernel and with bf16 activations, reference path."""
    out = []
    held = mod.kernel
    for kernel in (held, il.Int4Kernel()):
        mod.kernel = kernel
        xr = x.clone().requires_grad_(True)
        y = mod(xr)
        y.backward(dy)
        out.append((y.detach(), xr.grad))
    mod.kernel = held
    return out


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("tokens, in_f, out_f", [(256, 512, 384), (128, 1536, 1536), (77, 640, 576)])
def test_quality_gate_per_layer_against_bf16_activations(mods, fmt, tokens, in_f, out_f):
    il, _ = mods
    mod = layer(il, out_f, in_f, seed=tokens, fmt=fmt)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, tokens // 2 + 1, in_f, generator=g).bfloat16()
    dy = torch.randn(2, tokens // 2 + 1, out_f, generator=g).bfloat16()
    (y8, dx8), (y, dx) = run_both(il, mod, x, dy)
    assert y8.shape == y.shape and y8.dtype == torch.bfloat16 and dx8.shape == x.shape
    err_y, err_dx = relative(y8, y), relative(dx8, dx)
    print(f"{fmt} {tokens}x{in_f}->{out_f}: y {err_y:.4f}, dx {err_dx:.4f}")
    assert 0 < err_y <= QUALITY_BOUND[fmt] and 0 < err_dx <= QUALITY_BOUND[fmt]


def test_outlier_channels_hurt_int8_not_fp8(mods):
    """Why FP8 is preferred where the GPU has it: a few 100x channels (as transformer
    activations have) stretch int8's one step per token; fp8 keeps its relative precision."""
    il, _ = mods
    mod = layer(il, 384, 512)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(256, 512, generator=g)
    x[:, :4] *= 100
    x = x.bfloat16()
    dy = torch.randn(256, 384, generator=g).bfloat16()
    errors = {}
    for fmt in ("int8", "fp8"):
        mod.kernel = eight_bit(il, fmt)
        (y8, _), (y, _) = run_both(il, mod, x, dy)
        errors[fmt] = relative(y8, y)
    assert errors["int8"] > 3 * 0.0125 and errors["fp8"] < 0.04, errors


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_row_codes_are_on_the_grid_and_within_half_a_step(mods, fmt):
    _, w = mods
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 256, generator=g) * torch.logspace(-3, 2, 9)[:, None]
    x[4] = 0.0  # an all-zero row stays zero (no division by zero)
    codes, scale = w.quantize_rows_reference(x, fmt)
    assert codes.abs().max() <= w.QMAX[fmt] and bool(torch.all(codes[4] == 0)) and bool(torch.isfinite(scale).all())
    assert torch.equal(codes.abs().amax(dim=1)[[0, 1, 2, 3, 5]], torch.full((5,), w.QMAX[fmt]))
    back = codes * scale[:, None]
    if fmt == "int8":
        assert torch.equal(codes, codes.round())
        assert bool(((back - x).abs() <= scale[:, None] / 2 + 1e-12).all())
    else:
        assert torch.equal(codes, codes.to(torch.float8_e4m3fn).float())
        assert bool(((back - x).abs() <= x.abs() / 16 + scale[:, None] * 2**-9).all())


def test_weight_maxima_are_exact(mods):
    il, w = mods
    mod = layer(il, 200, 192)
    dense = mod.dequantize(torch.float32)
    rows, cols = w.weight_absmax(mod.qweight, mod.scale, mod.zero)
    assert torch.equal(rows, dense.abs().amax(dim=1)) and torch.equal(cols, dense.abs().amax(dim=0))
    for fmt in ("int8", "fp8"):
        scales = w.weight_scales(mod.qweight, mod.scale, mod.zero, 64, fmt)
        per_row = w.requantized_weight_reference(mod.qweight, mod.scale, mod.zero, scales.row_inv, False, fmt)
        per_col = w.requantized_weight_reference(mod.qweight, mod.scale, mod.zero, scales.col_inv, True, fmt)
        assert torch.equal(per_row.abs().amax(dim=1), torch.full((200,), w.QMAX[fmt]))
        assert torch.equal(per_col.abs().amax(dim=0), torch.full((192,), w.QMAX[fmt]))
        assert w.weight_scales(mod.qweight, mod.scale, mod.zero, 64, fmt) is scales  # once per weight and format


def test_weight_gets_no_gradient_and_bias_is_added(mods):
    il, _ = mods
    lin = torch.nn.Linear(128, 64, bias=True).bfloat16()
    mod = il.Int4Linear.from_linear(lin, kernel=eight_bit(il, "int8"))
    mod.requires_grad_(True)
    x = torch.randn(3, 128, dtype=torch.bfloat16, requires_grad=True)
    y = mod(x)
    y.float().square().sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all()) and float(x.grad.abs().sum()) > 0
    assert all(b.grad is None and not b.requires_grad for b in mod.buffers())
    mod.bias.zero_()
    torch.testing.assert_close(y - mod(x.detach()), lin.bias.detach().expand(3, 64), rtol=0, atol=0.02)
    assert "activations=int8" in repr(mod)


def test_a_bad_kernel_setting_names_the_key(qtypes):
    for key, value in (("w4a8_activations", "int4"), ("w4a8_gemm", "cublas"), ("int4_chunk_mib", 0),
                       ("w4a8_gemm", "auto")):
        with pytest.raises(ValueError, match=f"model_kwargs {key}"):
            qtypes.kernel_for("int4_w4a8", {key: value})


def test_kernel_choice_from_the_model_kwargs_then_the_table(qtypes, monkeypatch):
    """The run's model_kwargs pick the kernel (the self-test passes its candidate's the same way); the
    environment plays no part."""
    kwargs = {"w4a8_activations": "fp8", "w4a8_gemm": "triton", "int4_chunk_mib": 2, "int4_kernel": False}
    monkeypatch.setenv("INT4_W4A8_ACT", "int8")
    assert qtypes.kernel_for("int4_w4a8", kwargs) == qtypes.Int4Kernel("fp8", "triton", 2 * 2**20, False)
    # no FP8 units on this machine: the table's default is int8
    assert qtypes.kernel_for("int4_w4a8") == qtypes.Int4Kernel("int8", "triton", 256 * 2**20)
    assert qtypes.kernel_for("int4_fused") == qtypes.Int4Kernel("bf16", "chunked", 64 * 2**20)
    with pytest.raises(ValueError, match="scaled_mm needs w4a8_activations: fp8"):
        qtypes.kernel_for("int4_w4a8", {"w4a8_activations": "int8", "w4a8_gemm": "scaled_mm"})
    assert qtypes.cache_qtype("int4_w4a8") == "int4_fused" and qtypes.cache_qtype("uint4") == "uint4"


def test_module_keeps_its_kernel_from_load_time(mods):
    """The model_kwargs are read when the model is configured, never per call."""
    il, _ = mods
    model = torch.nn.Sequential(layer(il, 64, 64, fmt="bf16"))
    kwargs = {"w4a8_activations": "fp8"}
    assert il.configure_linears(model, "int4_w4a8", kwargs) == 1
    kwargs["w4a8_activations"] = "int4"  # not a format: a per-call read would fail
    x = torch.randn(3, 64).bfloat16()
    assert model[0].kernel.activations == "fp8" and model(x).shape == (3, 64)


def test_qtype_shares_int4_fused_weights_and_cache(mods, trainer_on_path):
    import importlib

    il, _ = mods
    quantize = importlib.import_module("toolkit.util.quantize")
    qtype = quantize.get_qtype("int4_w4a8")
    assert isinstance(qtype, quantize.int4fusedtype) and qtype.name == "int4_w4a8"
    model = torch.nn.Sequential(layer(il, 64, 64, fmt="bf16"), torch.nn.Linear(64, 64),
                                layer(il, 64, 128, fmt="bf16"))
    assert il.configure_linears(model, "int4_w4a8", {}) == 2
    # the CPU has no FP8 units: the table's default for int4_w4a8 is int8
    assert [getattr(m, "kernel", None) and m.kernel.activations for m in model] == ["int8", None, "int8"]
    assert il.configure_linears(model, "int4_fused", {}) == 0
    assert [getattr(m, "kernel", None) and m.kernel.activations for m in model] == ["bf16", None, "bf16"]
    assert il.configure_linears(model, "uint4", {}) == 0


INTERPRETED = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, sys.argv[1])
    from toolkit import int4_kernels as il, int4_w4a8 as w
    from flux2_contract.qtypes import Int4Kernel
    w._scaled_gemm_kernel.configs = [c for c in w._scaled_gemm_kernel.configs if c.kwargs["BLOCK_K"] == 64][:1] \\
        or w._scaled_gemm_kernel.configs[:1]

    def exact_case(M, N, K, seed):
        # fp8 under the interpreter: its fp32 -> fp8 cast does not round to nearest even (a GPU does),
        # so the fp8 case uses data whose 8-bit codes are exact: every weight group has scale 2**-6,
        # zero 8 and |code - zero| <= 7 with 7 in each row and column (448 / 7 = 64), and every
        # activation row is fp8 values times a power of two with a row maximum of 448 times it
        g = torch.Generator().manual_seed(seed)
        codes = torch.randint(1, 16, (N, K), generator=g)
        codes[:, 0] = 1; codes[0, :] = 15
        q = il.pack_uint4(codes.to(torch.uint8))
        s = torch.full((N, K // 64), 2.0 ** -6, dtype=torch.float16)
        z = torch.full((N, K // 64), 8, dtype=torch.uint8)
        def rows(n, width):
            v = (torch.randn(n, width, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn).float()
            v[:, 0] = 448.0
            return (v * 2.0 ** -torch.randint(0, 6, (n, 1), generator=g)).half()
        return q, s, z, rows(M, K), rows(M, N)

    res = []
    for fmt in ("int8", "fp8"):
        for M, N, K in [(5, 200, 192), (130, 72, 64), (70, 384, 256)]:
            if fmt == "int8":
                g = torch.Generator().manual_seed(M)
                q, s, z = il.quantize_weight((torch.randn(N, K, generator=g) * 0.02).half())
                x, dy = torch.randn(M, K, generator=g).half(), torch.randn(M, N, generator=g).half()
            else:
                q, s, z, x, dy = exact_case(M, N, K, M)
            scales = w.WeightScales(q, s, z, 64, fmt)
            xq, xs = w.quantize_rows(x, fmt)
            xq_ref, xs_ref = w.quantize_rows_reference(x, fmt)
            # the same codes, except where x / scale lands within float rounding of a half step: the
            # kernel's product may round the other way than torch's (at most one step apart)
            step = (xq[:, :K].float() - xq_ref).abs()
            codes_equal = bool(torch.equal(xs, xs_ref)) and float(step.max()) <= 1 and float(step.mean()) < 1e-3
            codes_equal = codes_equal and (fmt == "int8" or float(step.max()) == 0)
            pads_zero = bool((xq[:, K:].float() == 0).all())
            # chunk_bytes 1: one 128-row / 128-column slice at a time, every slice boundary is crossed
            kernel = Int4Kernel(fmt, "triton", chunk_bytes=1)
            y = w.w4a8_matmul(x, q, s, z, 64, kernel, True, transposed=False)
            dx = w.w4a8_matmul(dy, q, s, z, 64, kernel, True, transposed=True)
            y_ref = w.reference_fwd(x, q, s, z, scales, fmt)
            dx_ref = w.reference_bwd(dy, q, s, z, scales, fmt)
            rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())
            # the weight whole in one slice (the default slice size here), into the GEMM's own output
            whole = Int4Kernel(fmt, "triton")
            y_whole = w.w4a8_matmul(x, q, s, z, 64, whole, True, transposed=False)
            dx_whole = w.w4a8_matmul(dy, q, s, z, 64, whole, True, transposed=True)
            # each 8-bit copy is the codes a call requantizes, with its orientation's column scales
            held_equal, copies = True, {}
            for transposed in (False, True):
                width, inner, inverse, column_scale = w._orientation(q, scales, transposed)
                codes = w.requantize_slice(q, s, z, inverse, w._weight_buffer(width, inner, "cpu", fmt), fmt,
                                           transposed, 0)
                copies[transposed] = w.eight_bit_copy(q, s, z, 64, fmt, transposed)
                held_equal &= torch.equal(copies[transposed][0].view(torch.uint8), codes.view(torch.uint8))
                held_equal &= torch.equal(copies[transposed][1], column_scale)
            y_held = w.w4a8_matmul(x, q, s, z, 64, kernel, True, False, copies[False])
            dx_held = w.w4a8_matmul(dy, q, s, z, 64, kernel, True, True, copies[True])
            res.append([fmt, M, N, K, codes_equal and held_equal, pads_zero, rel(y, y_ref), rel(dx, dx_ref),
                        rel(y_whole, y_ref), rel(dx_whole, dx_ref), rel(y_held, y_ref), rel(dx_held, dx_ref)])
    print(json.dumps(res))
    """
)


def interpreted(script_text: str, trainer_checkout, tmp_path, timeout: int, *args: str):
    """The last line of `script_text`'s output, as JSON, run in a fresh interpreter under Triton's
    CPU interpreter with the trainer checkout and `args` as its arguments."""
    script = tmp_path / "interpreted.py"
    script.write_text(script_text, encoding="utf-8")
    out = subprocess.run([sys.executable, str(script), str(Path(trainer_checkout)), *args],
                         env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_kernels_match_reference_under_triton_interpreter(mods, trainer_checkout, tmp_path):
    """The sliced kernels (requantize a slice, then the 8-bit GEMM) against the reference;
    partial tiles in every dimension; the weight in one slice, and held in 8 bits, the same."""
    il, _ = mods
    if not il.HAVE_TRITON:
        pytest.skip("triton does not import here")
    rows = interpreted(INTERPRETED, trainer_checkout, tmp_path, timeout=900)
    assert len(rows) == 6
    for fmt, M, N, K, codes_equal, pads_zero, *errors in rows:
        assert codes_equal and pads_zero, (fmt, M, N, K)
        # same codes and scales, sliced, whole or held: only the fp32 summation order and the fp16
        # output rounding differ
        assert max(errors) < 2e-3, (fmt, M, N, K, errors)


IN_REGISTER = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, sys.argv[1])
    from toolkit import int4_kernels as il, int4_w4a8 as w
    from flux2_contract.qtypes import Int4Kernel
    w._in_register_gemm_kernel.configs = w._in_register_gemm_kernel.configs[:1]
    w._scaled_gemm_kernel.configs = w._scaled_gemm_kernel.configs[:1]

    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())
    res = []
    for fmt in ("int8", "fp8"):
        for M, N, K in [(5, 200, 192), (130, 72, 64), (70, 136, 320)]:
            g = torch.Generator().manual_seed(M)
            q, s, z = il.quantize_weight((torch.randn(N, K, generator=g) * 0.02).half())
            s[0, 0] = 0.0  # a zero scale: the FP8 accumulator's rescaling must not divide by it
            x, dy = torch.randn(M, K, generator=g).half(), torch.randn(M, N, generator=g).half()
            if fmt == "fp8":
                # the interpreter's fp32 -> fp8 cast does not round to nearest even (a GPU does): activation
                # rows of fp8 values times a power of two with a row maximum of 448 times it have exact codes
                v = (torch.randn(M, K, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn).float()
                v[:, 0] = 448.0
                x = (v * 2.0 ** -torch.randint(0, 6, (M, 1), generator=g)).half()
            kernel = Int4Kernel(fmt, "in_register", chunk_bytes=1)
            y = w.w4a8_matmul(x, q, s, z, 64, kernel, True, transposed=False)
            y_ref = w.w4a8_matmul(x, q, s, z, 64, kernel, False, transposed=False)
            # the input gradient of gemm in_register is the sliced Triton path's, against its reference
            dx = w.w4a8_matmul(dy, q, s, z, 64, kernel, True, transposed=True)
            sliced = Int4Kernel(fmt, "triton", chunk_bytes=1)
            dx_sliced = w.w4a8_matmul(dy, q, s, z, 64, sliced, True, transposed=True)
            # (its FP8 requantization rounds on the interpreter as a GPU does not: that path's own test uses
            # weights whose 8-bit codes are exact; here the int8 one is checked against the reference)
            dx_ref = w.reference_bwd(dy, q, s, z, w.weight_scales(q, s, z, 64, fmt), fmt)
            err_dx = rel(dx, dx_ref) if fmt == "int8" else None
            res.append([fmt, M, N, K, rel(y, y_ref), err_dx, bool(torch.equal(dx, dx_sliced))])
    print(json.dumps(res))
    """
)


def test_in_register_gemm_matches_its_reference_under_triton_interpreter(mods, trainer_checkout, tmp_path):
    """gemm in_register: the GEMM that reads the 4-bit weight, against its reference (the exact weight
    against per-token 8-bit activations), int8 and FP8; partial tiles, a group of scale 0; its input
    gradient is the sliced Triton path's, exactly."""
    il, _ = mods
    if not il.HAVE_TRITON:
        pytest.skip("triton does not import here")
    rows = interpreted(IN_REGISTER, trainer_checkout, tmp_path, timeout=900)
    assert len(rows) == 6
    for fmt, M, N, K, err_y, err_dx, dx_is_sliced in rows:
        # the same codes and the same exact weight: only the fp32 summation order and fp16 rounding differ
        assert err_y < 2e-3 and (err_dx is None or err_dx < 2e-3) and dx_is_sliced, (fmt, M, N, K, err_y, err_dx)
    assert all(err_dx is not None for fmt, *_, err_dx, _ in rows if fmt == "int8")


def test_in_register_weight_is_exact_so_its_error_is_the_activations_alone(mods):
    """Its reference multiplies the exact 4-bit weight: against bf16 activations on the same weight it
    errs by the activation quantization alone, less than the sliced paths, which also round W to 8 bits."""
    il, w = mods
    mod = layer(il, 384, 512)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(256, 512, generator=g).bfloat16()
    exact = x.float() @ mod.dequantize(torch.float32).t()
    for fmt in ("int8", "fp8"):
        xq, x_scale = w.quantize_rows_reference(x, fmt)
        activations_alone = (xq * x_scale[:, None]) @ mod.dequantize(torch.float32).t()
        in_register = w.w4a8_matmul(x, mod.qweight, mod.scale, mod.zero, 64, il.Int4Kernel(fmt, "in_register"), False,
                                    False)
        sliced = w.w4a8_matmul(x, mod.qweight, mod.scale, mod.zero, 64, il.Int4Kernel(fmt, "triton"), False, False)
        assert relative(in_register, activations_alone) < 4e-3, fmt  # the bf16 output's rounding
        assert relative(in_register, exact) < 0.8 * relative(sliced, exact), fmt


HOLD = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, sys.argv[1])
    from toolkit import int4_linear as il, int4_w4a8 as w
    from flux2_contract.qtypes import Int4Kernel
    torch.manual_seed(0)
    layers = [il.Int4Linear.from_linear(torch.nn.Linear(k, n, bias=False).half()) for n, k in [(128, 64), (64, 192), (256, 128)]]
    for m in layers:
        m.kernel = Int4Kernel("int8", "triton")
    plain = il.Int4Linear.from_linear(torch.nn.Linear(64, 64, bias=False).half())  # bf16 activations: none held
    model = torch.nn.Sequential(*layers, plain)
    forward = sum(m.out_features * w.padded(m.in_features) for m in layers)
    first_gradient = layers[0].in_features * w.padded(layers[0].out_features)
    held = il.hold_8bit_weights(model, forward + first_gradient)
    where = [[c is not None for c in (m.forward_copy, m.input_grad_copy)] + [m.freed] for m in layers + [plain]]
    print(json.dumps({"held": held, "budget": forward + first_gradient, "where": where}))
    """
)


def test_hold_8bit_weights_forward_copies_first_within_the_budget(mods, trainer_checkout, tmp_path):
    """Where VRAM allows: every forward copy first (the forward and its recompute use it), then the
    input gradient's, never past the budget; a layer with bf16 activations holds none; one holding
    both has freed its 4-bit weight."""
    il, _ = mods
    if not il.HAVE_TRITON:
        pytest.skip("triton does not import here")
    result = interpreted(HOLD, trainer_checkout, tmp_path, timeout=600)
    assert result["held"] == result["budget"]
    assert result["where"] == [[True, True, True], [True, False, False], [True, False, False], [False, False, False]]


PLANNED_COPIES = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, sys.argv[1])
    from toolkit import int4_linear as il, int4_w4a8 as w, memory_budget
    from flux2_contract.memory_plan import BlockPlan, MemoryPlan
    from flux2_contract.qtypes import Int4Kernel
    torch.manual_seed(0)

    def block():
        layers = [il.Int4Linear.from_linear(torch.nn.Linear(64, 128, bias=False).half()) for _ in range(2)]
        for m in layers:
            m.kernel = Int4Kernel("int8", "triton")
        return torch.nn.Sequential(*layers)

    model = torch.nn.Module()
    model.double_blocks = torch.nn.ModuleList([block(), block()])
    model.single_blocks = torch.nn.ModuleList([block()])
    names = ["double_blocks.0", "double_blocks.1", "single_blocks.0"]
    counts = [int(c) for c in sys.argv[2].split(",")]
    plan = MemoryPlan(budget_bytes=0, blocks=[BlockPlan(n, "resident", "kept", 0, c) for n, c in zip(names, counts)],
                      copy_bytes=int(sys.argv[3]))
    lines = memory_budget.hold_copies(model, plan)
    where = {n: [[c is not None for c in (m.forward_copy, m.input_grad_copy)] + [m.freed] for m in model.get_submodule(n)]
             for n in names}
    print(json.dumps({"lines": lines, "where": where}))
    """
)


def test_the_plans_8bit_copies_are_held_per_block_and_orientation(mods, trainer_checkout, tmp_path):
    """memory_budget.hold_copies carries out a plan's copies: 2 (forward and input gradient, the 4-bit
    weight freed), 1 (forward) or none per block, and says how much it held, and where less than planned."""
    il, w = mods
    if not il.HAVE_TRITON:
        pytest.skip("triton does not import here")
    forward, gradient = 128 * w.padded(64), 64 * w.padded(128)  # a byte per weight, the inner width padded
    result = interpreted(PLANNED_COPIES, trainer_checkout, tmp_path, 600, "2,1,0", str(4 * forward + 2 * gradient))
    assert result["where"] == {"double_blocks.0": [[True, True, True]] * 2, "double_blocks.1": [[True, False, False]] * 2,
                               "single_blocks.0": [[False, False, False]] * 2}
    assert result["lines"] == [f"  8-bit weight copies held: {(4 * forward + 2 * gradient) / 1024:.1f} KiB"]
    short = interpreted(PLANNED_COPIES, trainer_checkout, tmp_path, 600, "0,1,0", str(4 * forward))
    assert short["lines"] == [f"  8-bit weight copies held: {2 * forward / 1024:.1f} KiB of the "
                              f"{4 * forward / 1024:.1f} KiB planned"]


def test_without_an_8bit_gpu_kernel_the_planned_copies_are_none_and_said(mods):
    il, _ = mods
    from flux2_contract.memory_plan import BlockPlan, MemoryPlan
    from flux2_contract.qtypes import Int4Kernel
    from toolkit import memory_budget

    layer = il.Int4Linear.from_linear(torch.nn.Linear(64, 128, bias=False).half())
    layer.kernel = Int4Kernel("int8", "triton")
    model = torch.nn.Module()
    model.double_blocks = torch.nn.ModuleList([torch.nn.Sequential(layer)])
    plan = MemoryPlan(budget_bytes=0, blocks=[BlockPlan("double_blocks.0", "resident", "kept", 0, 2)], copy_bytes=1)
    assert memory_budget.hold_copies(model, plan) == [
        "  8-bit weight copies: none held (no 8-bit GPU kernel runs here: the matmuls requantize)"]
    assert memory_budget.hold_copies(model, MemoryPlan(budget_bytes=0, blocks=[])) == []


def fp8_copies(w, q, s, z):
    """The layer's two FP8 copies as eight_bit_copy makes them, from the reference's codes (CPU)."""
    scales = w.WeightScales(q, s, z, 64, "fp8")
    forward = w.requantized_weight_reference(q, s, z, scales.row_inv, False, "fp8")
    input_grad = w.requantized_weight_reference(q, s, z, scales.col_inv, True, "fp8").t().contiguous()
    return (forward.to(torch.float8_e4m3fn), scales.row), (input_grad.to(torch.float8_e4m3fn), scales.col)


def scaled_mm_in_fp32(a, b, scale_a, scale_b, out_dtype, use_fast_accum=False):
    """torch._scaled_mm's row- and column-scaled product, which the CPU build does not have."""
    return ((a.float() @ b.float()) * scale_a * scale_b).to(out_dtype)


def rows_on_cpu(x2d, fmt):
    """quantize_rows' codes and scales without Triton (K a multiple of K_ALIGN)."""
    from toolkit import int4_w4a8 as w

    codes, scale = w.quantize_rows_reference(x2d, fmt)
    return codes.to(w.torch_dtype(fmt)), scale


def test_fp8_products_accumulate_fast_in_the_forward_only(mods, monkeypatch):
    """Through the operator (a held copy per orientation, so torch._scaled_mm multiplies it whole), the
    forward asks cuBLASLt for fast accumulation and the input gradient does not (fast_accumulation),
    and each still computes the reference's product."""
    il, w = mods
    asked = []

    def recording(a, b, scale_a, scale_b, out_dtype, use_fast_accum=False):
        asked.append(use_fast_accum)
        return scaled_mm_in_fp32(a, b, scale_a, scale_b, out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    monkeypatch.setattr(w, "quantize_rows", rows_on_cpu)
    g = torch.Generator().manual_seed(5)
    q, s, z = il.quantize_weight((torch.randn(128, 256, generator=g) * 0.02).bfloat16())
    x, dy = torch.randn(32, 256, generator=g).bfloat16(), torch.randn(32, 128, generator=g).bfloat16()
    forward, input_grad = fp8_copies(w, q, s, z)
    scales = w.WeightScales(q, s, z, 64, "fp8")
    kernel = il.Int4Kernel("fp8", "scaled_mm", use_kernel=True)
    y = w.w4a8_matmul(x, q, s, z, 64, kernel, True, False, forward)
    dx = w.w4a8_matmul(dy, q, s, z, 64, kernel, True, True, input_grad)
    assert asked == [True, False]
    torch.testing.assert_close(y, w.reference_fwd(x, q, s, z, scales, "fp8"), rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(dx, w.reference_bwd(dy, q, s, z, scales, "fp8"), rtol=1e-2, atol=1e-3)


def test_the_traced_copy_matmul_computes_what_the_sliced_path_does(mods, monkeypatch):
    """traced_copy_matmul, a compiled block's FP8 matmul against a held copy, gives the reference's
    forward and input gradient: the same codes, the same scales, each orientation the right way round."""
    _, w = mods
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm_in_fp32)
    g = torch.Generator().manual_seed(3)
    il, _ = mods
    q, s, z = il.quantize_weight((torch.randn(96, 256, generator=g) * 0.02).bfloat16())
    x, dy = torch.randn(32, 256, generator=g).bfloat16(), torch.randn(32, 96, generator=g).bfloat16()
    forward, input_grad = fp8_copies(w, q, s, z)
    scales = w.WeightScales(q, s, z, 64, "fp8")
    torch.testing.assert_close(w.traced_copy_matmul(x, *forward, input_grad=False),
                               w.reference_fwd(x, q, s, z, scales, "fp8"), rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(w.traced_copy_matmul(dy, *input_grad, input_grad=True),
                               w.reference_bwd(dy, q, s, z, scales, "fp8"), rtol=1e-2, atol=1e-3)


def compiled_graphs(module, x):
    """The forward and backward graphs a compiled `module` runs for x (meta tensors: nothing is
    computed), with no graph break allowed."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs = []

    def capture(graph, _):
        graphs.append(graph)
        return make_boxed_func(graph.forward)

    def backend(graph, inputs):
        return aot_module_simplified(graph, inputs, fw_compiler=capture, bw_compiler=capture)

    torch._dynamo.reset()
    torch.compile(module, backend=backend, fullgraph=True)(x).sum().backward()
    return graphs


@pytest.mark.parametrize("rows, held, forward_op, backward_op", [
    (32, "both", False, False),  # both traced: no operator left
    (32, "forward", False, True),  # the input gradient requantizes: its operator
    (32, "none", True, True),
    (24, "both", True, True),  # rows cuBLASLt's FP8 GEMM does not take: the operators, with the copies
])
def test_a_compiled_block_traces_the_fp8_matmul_against_its_copies(mods, rows, held, forward_op, backward_op):
    """In a compiled block, a layer holding its FP8 copies multiplies in plain PyTorch (quantization
    and torch._scaled_mm in the graph, no 4-bit operator) and without them through the operators."""
    il, _ = mods
    from flux2_contract.qtypes import Int4Kernel

    layer = il.Int4Linear(128, 64, device="meta")
    layer.kernel = Int4Kernel("fp8", "scaled_mm", use_kernel=True)
    fp8 = torch.float8_e4m3fn
    if held != "none":
        layer.forward_copy = (torch.empty(64, 128, dtype=fp8, device="meta"), torch.empty(64, device="meta"))
    if held == "both":
        layer.input_grad_copy = (torch.empty(128, 64, dtype=fp8, device="meta"), torch.empty(128, device="meta"))
    x = torch.empty(rows, 128, dtype=torch.bfloat16, device="meta", requires_grad=True)
    forward, backward = compiled_graphs(layer, x)
    assert ("flux2_24gb.int4_matmul.default" in forward.code) == forward_op
    assert ("flux2_24gb.int4_matmul_input_grad.default" in backward.code) == backward_op
    # each traced product asks for fast accumulation in the forward only (fast_accumulation)
    assert fast_accum_asked(forward) == ([] if forward_op else [True])
    assert fast_accum_asked(backward) == ([] if backward_op else [False])


def fast_accum_asked(graph) -> list:
    """use_fast_accum of each torch._scaled_mm call in a captured graph, as its schema reads it."""
    calls = [node for node in graph.graph.nodes if node.target is torch.ops.aten._scaled_mm.default]
    return [node.normalized_arguments(graph, normalize_to_only_use_kwargs=True).kwargs["use_fast_accum"]
            for node in calls]


def test_a_copy_left_on_another_device_is_not_used(mods):
    """A layer moved away from its copies (they are plain attributes, not buffers) multiplies
    without them, as one that never held any."""
    il, _ = mods
    layer_ = layer(il, 64, 128, fmt="fp8")
    layer_.kernel = il.Int4Kernel("fp8", "scaled_mm", use_kernel=False)
    x = torch.randn(16, 128).bfloat16()
    want = layer_(x)
    layer_.forward_copy = (torch.empty(64, 128, dtype=torch.float8_e4m3fn, device="meta"), torch.empty(64, device="meta"))
    layer_.input_grad_copy = (torch.empty(128, 64, dtype=torch.float8_e4m3fn, device="meta"),
                              torch.empty(128, device="meta"))
    assert torch.equal(layer_(x), want)
    assert torch.equal(torch.compile(layer_, backend="aot_eager", fullgraph=True)(x), want)


def test_a_layer_holding_both_copies_frees_its_4bit_weight_and_multiplies_as_before(mods, monkeypatch):
    """Once both 8-bit copies are held, the 4-bit weight is freed (hold_copy) and every route still
    multiplies, uncompiled, compiled and traced, and compiled through the operators (where
    traceable_copy says no): the same forward and input gradient as the reference, read from the
    copies alone. What needs the 4-bit weight says it was freed."""
    il, w = mods
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm_in_fp32)
    monkeypatch.setattr(w, "quantize_rows", rows_on_cpu)
    monkeypatch.setattr(w, "eight_bit_copy", lambda q, s, z, g, fmt, transposed: fp8_copies(w, q, s, z)[transposed])
    layer_ = layer(il, 128, 256, seed=7, fmt="fp8")
    layer_.kernel = il.Int4Kernel("fp8", "scaled_mm", use_kernel=True)
    q, s, z = layer_.qweight, layer_.scale, layer_.zero
    scales = w.WeightScales(q, s, z, 64, "fp8")
    layer_.hold_copy(False)
    assert not layer_.freed and layer_.qweight is q
    layer_.hold_copy(True)
    assert layer_.freed and [t.numel() for t in (layer_.qweight, layer_.scale, layer_.zero)] == [0, 0, 0]
    for compiled, traced in [(False, False), (True, True), (True, False)]:
        torch._dynamo.reset()
        monkeypatch.setattr(w, "traceable_copy", lambda *args, traced=traced: traced)
        g = torch.Generator().manual_seed(5)
        x = torch.randn(32, 256, generator=g).bfloat16().requires_grad_()
        dy = torch.randn(32, 128, generator=g).bfloat16()
        y = (torch.compile(layer_, backend="aot_eager", fullgraph=True) if compiled else layer_)(x)
        y.backward(dy)
        torch.testing.assert_close(y, w.reference_fwd(x.detach(), q, s, z, scales, "fp8"), rtol=1e-2, atol=1e-3)
        torch.testing.assert_close(x.grad, w.reference_bwd(dy, q, s, z, scales, "fp8"), rtol=1e-2, atol=1e-3)
    for needs_4bit in (layer_.to_tensors, layer_.dequantize, lambda: layer_(torch.randn(32, 256).bfloat16().to("meta"))):
        with pytest.raises(RuntimeError, match="4-bit weight was freed once its two 8-bit copies were held"):
            needs_4bit()
