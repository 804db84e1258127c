"""qtype int4_w4a8 with gemm "fused" (toolkit/int4_w4a8_fused.py): the 4-bit weight requantized
to 8 bits in registers inside the matmul, on the CPU.

The kernels against the reference, tile by tile, are in test_int4_w4a8.py (the interpreter test
runs the sliced and the fused paths on the same data). Here: the module end to end through
autograd under Triton's interpreter (output, input gradient, bias, 3-D input) with no 8-bit
weight buffer allocated, and both kernels compiled for a Hopper GPU by Triton's own compiler
without a GPU, which the interpreter cannot do (it runs the kernel as Python: a kernel that does
not compile passes there).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def run_script(source: str, trainer: Path, tmp_path: Path, env: dict) -> list:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source), encoding="utf-8")
    out = subprocess.run([sys.executable, str(script), str(trainer)], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


END_TO_END = """
    import json, sys, torch
    sys.path.insert(0, sys.argv[1])
    from toolkit import int4_linear as il, int4_w4a8 as w, int4_w4a8_fused as f
    from toolkit.qtypes import Int4Kernel
    w._scaled_gemm_kernel.configs = w._scaled_gemm_kernel.configs[-1:]  # no autotuning without a GPU
    f._fused_gemm_fwd_kernel.configs = f._fused_gemm_fwd_kernel.configs[:1]
    f._fused_gemm_bwd_kernel.configs = f._fused_gemm_bwd_kernel.configs[:1]

    eight_bit = []  # every 8-bit tensor allocated while the fused path runs
    empty = torch.empty
    def recording_empty(*size, dtype=None, **kw):
        t = empty(*size, dtype=dtype, **kw)
        if dtype in (torch.int8, torch.float8_e4m3fn):
            eight_bit.append(list(t.shape))
        return t

    def run(mod, kernel, x, dy):
        mod.kernel = kernel
        xr = x.clone().requires_grad_(True)
        y = mod(xr)
        y.backward(dy)
        return y.detach(), xr.grad

    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(320, 200, bias=True)
    with torch.no_grad():
        lin.weight.normal_(0, 0.02, generator=g)
        lin.bias.normal_(0, 1, generator=g)
    mod = il.Int4Linear.from_linear(lin.half())
    x = torch.randn(2, 37, 320, generator=g).half()
    dy = torch.randn(2, 37, 200, generator=g).half()
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())
    res = []
    for fmt in ("int8", "fp8"):
        reference = run(mod, Int4Kernel(fmt, "fused", use_kernel=False), x, dy)
        sliced = run(mod, Int4Kernel(fmt, "triton", use_kernel=True), x, dy)
        def no_slices(*a, **k):
            raise AssertionError("the fused path requantized a weight slice")
        w.requantize_slice, held = no_slices, w.requantize_slice
        torch.empty, eight_bit[:] = recording_empty, []
        y, dx = run(mod, Int4Kernel(fmt, "fused"), x, dy)  # use_kernel None: the interpreter counts as a GPU
        torch.empty, w.requantize_slice = empty, held
        res.append({"fmt": fmt, "shapes": [list(y.shape), list(dx.shape)], "eight_bit": eight_bit[:],
                    "buffers_without_grad": all(b.grad is None for b in mod.buffers()),
                    "vs_reference": [rel(y, reference[0]), rel(dx, reference[1])],
                    "vs_sliced": [rel(y, sliced[0]), rel(dx, sliced[1])]})
    print(json.dumps(res))
"""


def test_fused_linear_end_to_end_writes_no_weight_buffer(trainer_checkout, tmp_path):
    """An Int4Linear on gemm "fused": y and dx through autograd against the sliced kernels and the
    reference; the only 8-bit tensors allocated are the activation codes (74 tokens, padded to
    128 columns), never a weight or a weight slice."""
    rows = run_script(END_TO_END, Path(trainer_checkout), tmp_path, {"TRITON_INTERPRET": "1"})
    for row in rows:
        assert row["shapes"] == [[2, 37, 200], [2, 37, 320]] and row["buffers_without_grad"], row
        assert row["eight_bit"] == [[74, 384], [74, 256]], row  # x codes (320 -> 384), dy codes (200 -> 256)
        # the same codes as the sliced path (int8 sums exactly); the interpreter's fp32 -> fp8
        # cast does not round to nearest even, so fp8 is compared with the reference loosely
        assert max(row["vs_sliced"]) <= (0.0 if row["fmt"] == "int8" else 1e-3), row
        assert max(row["vs_reference"]) < (2e-3 if row["fmt"] == "int8" else 0.1), row


COMPILE = """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from toolkit import int4_w4a8_fused as f

    COMMON = {"qw_ptr": "*u8", "s_ptr": "*bf16", "z_ptr": "*u8", "inv_ptr": "*fp32", "ws_ptr": "*fp32",
              "M": "i32", "N": "i32", "K": "i32", "stride_qn": "i32", "stride_sn": "i32"}

    def compiled(kernel, pointers, fmt, config, **constants):
        fn = kernel.fn
        while not isinstance(fn, triton.runtime.jit.JITFunction):  # under autotune / heuristics
            fn = fn.fn
        constants.update(config.kwargs, QMAX=448.0 if fmt == "fp8" else 127.0, FP8=fmt == "fp8", GROUP=64)
        types = {**COMMON, **pointers, "xq_ptr": "*fp8e4nv" if fmt == "fp8" else "*i8"}
        types["dyq_ptr"] = types["xq_ptr"]
        signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in fn.arg_names}
        out = triton.compile(ASTSource(fn, signature, constexprs=constants), target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": config.num_warps, "num_stages": config.num_stages})
        return out.asm["ptx"].count("wgmma.mma_async")

    fwd = {c.kwargs["W_AS_A"]: c for c in f._fwd_configs()}
    bwd = {c.kwargs["W_AS_A"]: c for c in f._bwd_configs()}
    res = []
    for fmt, a in (("fp8", 0), ("int8", 1)):
        res.append(["fwd", fmt, compiled(f._fused_gemm_fwd_kernel, {"xs_ptr": "*fp32", "y_ptr": "*bf16"}, fmt, fwd[a])])
    for fmt, a, even in (("fp8", 1, True), ("int8", 0, False)):
        res.append(["bwd", fmt, compiled(f._fused_gemm_bwd_kernel, {"dys_ptr": "*fp32", "dx_ptr": "*bf16"}, fmt,
                                         bwd[a], EVEN_R=even)])
    print(json.dumps(res))
"""


def test_fused_kernels_compile_for_hopper_without_a_gpu(mods_have_triton, trainer_checkout, tmp_path):
    """Triton's compiler, down to a cubin (its bundled ptxas), for sm_90: FP8 and int8, both
    operand orders, an even and a partial reduction tile; every kernel on the tensor-core path."""
    rows = run_script(COMPILE, Path(trainer_checkout), tmp_path, {"TRITON_CACHE_DIR": str(tmp_path / "cache")})
    assert len(rows) == 4
    for orientation, fmt, wgmma in rows:
        assert wgmma > 0, (orientation, fmt)


@pytest.fixture(scope="module")
def mods_have_triton(trainer_on_path):
    import importlib

    if not importlib.import_module("toolkit.int4_kernels").HAVE_TRITON:
        pytest.fail("Triton does not import in the trainer venv; the 4-bit kernels need it")


def test_fused_is_an_int4_w4a8_gemm_in_both_formats(trainer_on_path):
    import importlib

    qtypes = importlib.import_module("toolkit.qtypes")
    assert "fused" in qtypes.W4A8_GEMMS
    for fmt in ("fp8", "int8"):
        kernel = qtypes.kernel_for("int4_w4a8", environ={"INT4_W4A8_ACT": fmt, "INT4_W4A8_GEMM": "fused"})
        assert (kernel.activations, kernel.gemm) == (fmt, "fused")
    assert qtypes.kernel_for("int4_w4a8", environ={}).gemm == "triton"  # the table's default is unchanged
