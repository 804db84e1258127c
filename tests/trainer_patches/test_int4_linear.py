"""The 4-bit Linear (toolkit/int4_linear.py) on the CPU.

The plain-PyTorch reference path is the oracle: it must equal dequantize +
matmul, give the exact input gradient (float64 gradcheck) and never a weight
gradient. The Triton kernels themselves run under Triton's CPU interpreter
(fp16: the interpreter mishandles bf16) in a subprocess; the GPU comparison on
the full-size shapes lives in bench/int4_kernel.py.
"""

import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn

@pytest.fixture(scope="module")
def il(trainer_on_path):
    """The module: Int4Linear, its autograd function, quantize_linears."""
    return importlib.import_module("toolkit.int4_linear")


@pytest.fixture(scope="module")
def ik(trainer_on_path):
    """The weight format and the kernels."""
    return importlib.import_module("toolkit.int4_kernels")


def weight(out_f, in_f, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.02
    w[0, :64] = 0.0  # an all-zero group
    w[1, :64] = 0.01  # an all-positive constant group
    w[2, 64:128] = -0.03  # an all-negative constant group
    return w.to(dtype)


@pytest.mark.parametrize("shape", [(3, 2), (5, 128), (2, 3, 64)])
def test_pack_unpack_round_trip(shape, ik):
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, shape, generator=g, dtype=torch.uint8)
    packed = ik.pack_uint4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (*shape[:-1], shape[-1] // 2)
    assert torch.equal(ik.unpack_uint4(packed), codes)
    # layout the kernels rely on: even index in the low nibble
    assert int(packed.flatten()[0]) == int(codes.flatten()[0]) | (int(codes.flatten()[1]) << 4)


def test_pack_rejects_odd_width(ik):
    with pytest.raises(ValueError, match="even"):
        ik.pack_uint4(torch.zeros(2, 3, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_layout_and_error_bound(dtype, ik):
    w = weight(48, 256, dtype)
    q, s, z = ik.quantize_weight(w)
    assert q.shape == (48, 128) and q.dtype == torch.uint8
    assert s.shape == (48, 4) and s.dtype == dtype
    assert z.shape == (48, 4) and z.dtype == torch.uint8 and int(z.max()) <= 15
    deq = ik.dequantize_weight(q, s, z)
    assert deq.dtype == dtype
    err = (deq.float() - w.float()).abs().reshape(48, 4, 64)
    # half a step of rounding (a little more in bf16: like torchao, the codes are computed in the
    # weight's dtype, through a rounded reciprocal), plus one rounding of the result
    step = 0.5 if dtype == torch.float32 else 0.65
    bound = s.float()[..., None] * step + w.float().abs().reshape(48, 4, 64) * 2 ** -7 + 1e-6
    assert bool((err <= bound).all())
    assert torch.equal(deq[0, :64], torch.zeros(64, dtype=dtype))  # zero is exact


def test_quantize_matches_torchao_uint4(ik):
    quant_api = pytest.importorskip("torchao.quantization.quant_api")
    lin = nn.Linear(256, 40, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(weight(40, 256))
    ours = ik.dequantize_weight(*ik.quantize_weight(lin.weight))
    quant_api.quantize_(nn.Sequential(lin), quant_api.UIntXWeightOnlyConfig(torch.uint4))
    assert torch.equal(ours, lin.weight.dequantize())


def test_quantize_refuses_bad_width(ik):
    with pytest.raises(ValueError, match="multiple of the group size"):
        ik.quantize_weight(torch.zeros(4, 96))


@pytest.mark.parametrize("bias", [False, True])
def test_reference_path_is_dequantize_then_matmul(il, bias):
    lin = nn.Linear(128, 72, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(weight(72, 128))
    mod = il.Int4Linear.from_linear(lin)
    x = torch.randn(2, 7, 128).bfloat16()
    y = mod(x)
    expect = x @ mod.dequantize().t()
    if bias:
        expect = expect + lin.bias
    assert y.shape == (2, 7, 72) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y, expect, rtol=0, atol=0)


@pytest.mark.parametrize("path", ["uncompiled", "operator"])
def test_input_gradient_passes_gradcheck_in_float64(il, ik, path):
    w = weight(8, 128, torch.float64)
    q, s, z = ik.quantize_weight(w)
    x = torch.randn(4, 128, dtype=torch.float64, requires_grad=True)
    matmul = il.int4_matmul if path == "operator" else il.Int4LinearFunction.apply

    def f(inp):
        return matmul(inp, q, s, z, None, None, None, None, 64, "bf16", "chunked", 2**20, False)

    assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-7)


def test_weight_gets_no_gradient(il):
    lin = nn.Linear(128, 64, bias=True).to(torch.bfloat16)
    mod = il.Int4Linear.from_linear(lin)
    assert list(mod.parameters()) == []  # buffers: optimizers and requires_grad_ never see them
    mod.requires_grad_(True)
    x = torch.randn(4, 128, dtype=torch.bfloat16, requires_grad=True)
    mod(x).float().square().sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())
    for name, buf in mod.named_buffers():
        assert buf.grad is None and not buf.requires_grad, name
    # and the input gradient is dy @ W
    dy = 2 * mod(x.detach()).float()
    torch.testing.assert_close(x.grad.float(), (dy.bfloat16() @ mod.dequantize()).float(), rtol=2e-2, atol=1e-2)


def test_tensors_round_trip_with_json_meta(il, tmp_path):
    from safetensors.torch import load_file, save_file

    lin = nn.Linear(192, 40, bias=True).to(torch.bfloat16)
    mod = il.Int4Linear.from_linear(lin)
    tensors, meta = mod.to_tensors(prefix="blk.0.qkv.")
    assert set(tensors) == {"blk.0.qkv." + n for n in ("qweight", "scale", "zero", "bias")}
    text = json.dumps(meta)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "c.safetensors"),
              metadata={"blk.0.qkv": text})
    back = il.Int4Linear.from_tensors(load_file(str(tmp_path / "c.safetensors")), json.loads(text),
                                      prefix="blk.0.qkv.")
    x = torch.randn(3, 192).bfloat16()
    assert torch.equal(back(x), mod(x))
    bad = dict(json.loads(text), in_features=128)
    with pytest.raises(ValueError, match="shape"):
        il.Int4Linear.from_tensors(tensors, bad, prefix="blk.0.qkv.")
    with pytest.raises(ValueError, match="int4_fused"):
        il.Int4Linear.from_tensors(tensors, dict(meta, format="other"), prefix="blk.0.qkv.")


def test_tiny_flux2_trains_through_int4_block_linears(il, flux2_src, ik):
    params = flux2_src.Flux2Params(in_channels=64, context_in_dim=64, hidden_size=128, num_heads=2, depth=1,
                                   depth_single_blocks=1, axes_dim=[16, 16, 16, 16], mlp_ratio=3.0)
    torch.manual_seed(0)
    model = flux2_src.Flux2(params).to(torch.bfloat16)
    model.requires_grad_(False)
    replaced = il.quantize_linears(model, lambda name, m: "blocks." in name)
    assert len(replaced) == 8 + 2  # double block: 2 x (qkv, proj, mlp.0, mlp.2); single: linear1, linear2
    assert all(isinstance(model.get_submodule(n), il.Int4Linear) for n in replaced)
    # a trainable adapter on the output, like a LoRA would be
    adapter = nn.Parameter(torch.zeros(params.in_channels, dtype=torch.bfloat16))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 6, 64, generator=g).bfloat16()
    ctx = torch.randn(1, 5, 64, generator=g).bfloat16()
    x_ids = torch.randint(0, 4, (1, 6, 4), generator=g)
    ctx_ids = torch.randint(0, 4, (1, 5, 4), generator=g)
    t = torch.tensor([0.5]).bfloat16()
    x.requires_grad_(True)
    out = model(x=x, x_ids=x_ids, timesteps=t, ctx=ctx, ctx_ids=ctx_ids, guidance=t * 8) + adapter
    out.float().square().mean().backward()
    assert adapter.grad is not None and x.grad is not None and bool(torch.isfinite(x.grad).all())
    assert float(x.grad.abs().sum()) > 0
    assert all(p.grad is None for p in model.parameters())
    # same output as the model with the dequantized weights as plain Linears
    dense = flux2_src.Flux2(params).to(torch.bfloat16)
    state = dict(model.state_dict())
    for n in replaced:
        for buf in ("qweight", "scale", "zero"):
            del state[f"{n}.{buf}"]
        state[n + ".weight"] = model.get_submodule(n).dequantize()
    dense.load_state_dict(state)
    with torch.no_grad():
        expect = dense(x=x, x_ids=x_ids, timesteps=t, ctx=ctx, ctx_ids=ctx_ids, guidance=t * 8)
        got = model(x=x, x_ids=x_ids, timesteps=t, ctx=ctx, ctx_ids=ctx_ids, guidance=t * 8)
    assert torch.equal(got, expect)


INTERPRETED = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, sys.argv[1])
    from toolkit import int4_kernels as ik
    res = []
    # odd group count (192 = 3 groups), N not a multiple of the dequantize kernel's 64 rows
    for M, N, K in [(5, 100, 192), (130, 72, 64)]:
        g = torch.Generator().manual_seed(M)
        q, s, z = ik.quantize_weight((torch.randn(N, K, generator=g) * 0.02).half())
        x = torch.randn(M, K, generator=g).half()
        dy = torch.randn(M, N, generator=g).half()
        # chunk_bytes 1: one 64-row / one-group slice at a time, every chunk boundary is crossed
        y = ik.int4_matmul_fwd(x, q, s, z, chunk_bytes=1)
        dx = ik.int4_matmul_bwd(dy, q, s, z, chunk_bytes=1)
        yr = ik.reference_matmul_fwd(x.float(), q, s.float(), z)
        dxr = ik.reference_matmul_bwd(dy.float(), q, s.float(), z)
        res.append([M, N, K, float((y.float() - yr).abs().max()), float((dx.float() - dxr).abs().max())])
    print(json.dumps(res))
    """
)


def test_kernels_match_reference_under_triton_interpreter(trainer_checkout, tmp_path, ik):
    pytest.importorskip("triton")
    if not ik.HAVE_TRITON:
        pytest.skip("triton does not import here")
    script = tmp_path / "interp.py"
    script.write_text(INTERPRETED, encoding="utf-8")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, str(script), str(Path(trainer_checkout))], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(rows) == 2
    for M, N, K, err_y, err_dx in rows:
        assert err_y < 2e-3 and err_dx < 2e-3, (M, N, K, err_y, err_dx)


@pytest.mark.gpu
def test_gpu_kernels_match_reference(ik):
    """The Triton kernels on the GPU in bf16, against the fp32 reference on the same 4-bit weight:
    a tile-unaligned shape and a full-size FLUX.2 one (double block proj, 512 px tokens)."""
    for M, N, K in [(5, 100, 192), (1024, 6144, 6144)]:
        g = torch.Generator().manual_seed(M)
        q, s, z = (t.cuda() for t in ik.quantize_weight((torch.randn(N, K, generator=g) * 0.02).bfloat16()))
        x = torch.randn(M, K, generator=g).bfloat16().cuda()
        dy = torch.randn(M, N, generator=g).bfloat16().cuda()
        y = ik.int4_matmul_fwd(x, q, s, z)
        dx = ik.int4_matmul_bwd(dy, q, s, z)
        yr = ik.reference_matmul_fwd(x.float(), q, s.float(), z)
        dxr = ik.reference_matmul_bwd(dy.float(), q, s.float(), z)
        # bf16 inputs and output: ~3.6e-3 of the largest entry measured on an H200 (bench/RESULTS.md)
        assert float((y.float() - yr).abs().max()) < 1e-2 * float(yr.abs().max()), (M, N, K)
        assert float((dx.float() - dxr).abs().max()) < 1e-2 * float(dxr.abs().max()), (M, N, K)
