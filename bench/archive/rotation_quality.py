#!/usr/bin/env python3
"""Does a Hadamard rotation (ConvRot) bring 8- and 4-bit activations under the quality gate? (CPU)

On an RX 7900 XTX (RDNA3, gfx1100) int8 WMMA runs at the bf16 rate and only int4 x int4
(`v_wmma_i32_16x16x16_iu4`) at twice it. Two questions decide what such a card should run:

`quality`: the self-test's quality gate (`launcher/in_trainer/selftest/kernels.py`
QUALITY_TOLERANCE: a 6144 -> 384 layer, 256 tokens, an N(0, 0.02) bf16 weight stored by the
trainer's 4-bit quantizer, N(0, 1) activations and again with input channels 0-3 scaled 100x,
the same seeds) with the input dimension of both x and W rotated first: y = (x H)(W H)^T, H
block-diagonal Hadamard, the weight rotated BEFORE its 4-bit quantization (as folding H into the
stored weight does), dx computed in the rotated basis and rotated back. Rotations:

  none          the gate as it is
  regular64     ConvRot's regular Hadamard (R4 = [[1,1,1,-1],[1,1,-1,1],[1,-1,1,1],[-1,1,1,1]] / 2
                Kronecker-powered, arXiv 2512.03673, upstream ai-toolkit toolkit/util/convrot_quant.py),
                block 64
  sylvester128  the standard (Sylvester) Hadamard, block 128: a regular Hadamard matrix of order 128
                does not exist (regular ones need order 4 u^2), and ConvRot's rot_size is a power of 4
  regular256    ConvRot's default block, 256
  sylvester256  the standard Hadamard at 256, to compare with ConvRot's regular one

Activation schemes (each against the bf16-activation path on the SAME stored 4-bit weight, the
gate's measure; y and dx, the gate takes the larger):

  int8_token / fp8_token   the trainer's own int4_w4a8 reference path (toolkit/int4_w4a8.py
                           reference_fwd / reference_bwd: activations per token, the 4-bit weight
                           requantized per output row / input column), bf16 in and out as the gate
  int4_token / int4_group64 / int4_group16
                           W4A4, the math of bench/archive/w4a4_quality.py in fp32: symmetric int4 per token
                           (and per group of 64 or 16 channels); the forward multiplies the stored
                           4-bit weight as it is, the input gradient the weight requantized to
                           symmetric int4 per input column and group of 64 output rows

Outlier sets: the gate's (channels 0-3, adjacent: one rotation block) and `spread` (4 channels in 4
different rotation blocks). Widths: the gate's 6144 and 18432 (the MLP's second Linear), out 384.
The Hadamard construction is this script's own (upstream's file imports toolkit.print and
toolkit.util.ostris_quant, which the pinned trainer lacks); `--convrot FILE` (a copy of upstream's
file) loads upstream's `regular_hadamard` / `rotate` with those two imports stubbed and checks
they match this script's bit for bit.

`wmma`: what Triton compiles for gfx1100 (no GPU needed): a tl.dot on int8, on int8 holding int4
values, on uint8, with each input_precision, tl.dot_scaled on e2m1 (fp4, two per byte), and a
hand-edited TTIR whose tt.dot takes i4 operands (Triton's frontend has no int4 dtype); for each, the
v_wmma instructions in the AMDGCN assembly, or the error.

    python -m bench.archive.rotation_quality quality --trainer overlay --out rotation_quality.json [--convrot FILE]
    python -m bench.archive.rotation_quality wmma --out triton_wmma_gfx1100.json
"""

import argparse
import json
import re
import sys
import time
from pathlib import Path

INT4_MAX = 7.0
ROTATIONS = {"none": None, "regular64": ("regular", 64), "sylvester128": ("sylvester", 128),
             "regular256": ("regular", 256), "sylvester256": ("sylvester", 256)}
WIDTHS = (6144, 18432)
OUT_FEATURES, TOKENS = 384, 256


# --------------------------------------------------------------------------- rotation

def hadamard(torch, kind: str, size: int):
    """Orthonormal Hadamard matrix of order `size`: ConvRot's regular one (Kronecker powers of the
    4x4 regular Hadamard, `size` a power of 4) or Sylvester's (Kronecker powers of [[1, 1], [1, -1]])."""
    base = ([[1.0, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]] if kind == "regular" else [[1.0, 1], [1, -1]])
    seed = torch.tensor(base, dtype=torch.float32)
    h = seed.clone()
    while h.shape[0] < size:
        h = torch.kron(h, seed)
    if h.shape[0] != size:
        raise ValueError(f"no {kind} Hadamard of order {size} by Kronecker powers")
    return h / size ** 0.5


def rotate(torch, x, rotation):
    """x (fp32) rotated along its last dimension, one Hadamard block after another (symmetric and
    orthogonal, so the same call rotates back)."""
    if rotation is None:
        return x
    kind, size = rotation
    h = hadamard(torch, kind, size)
    return (x.reshape(-1, x.shape[-1] // size, size) @ h).reshape(x.shape)


def upstream_check(torch, path: Path) -> dict:
    """Load upstream's convrot_quant.py with its two trainer imports stubbed; compare its rotation."""
    import importlib.util
    import types

    stubs = {"toolkit.print": types.SimpleNamespace(print_acc=print),
             "toolkit.util.ostris_quant": types.SimpleNamespace(OstrisQuantizer=object)}
    held = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location("convrot_upstream", path)
        upstream = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(upstream)
    finally:
        for name, module in held.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 6144, generator=g)
    found = {}
    for size in (16, 64, 256):
        ours, theirs = hadamard(torch, "regular", size), upstream.regular_hadamard(size, "cpu", torch.float32)
        found[f"regular{size}"] = {"matrix_identical": bool(torch.equal(ours, theirs)),
                                   "rotate_identical": bool(torch.equal(rotate(torch, x, ("regular", size)),
                                                                        upstream.rotate(x, size)))}
    found["rot_size_for"] = {str(d): min(256, upstream.largest_pow4_divisor(d)) for d in (3072, 6144, 18432, 24576)}
    return found


# --------------------------------------------------------------------------- quality

def quality(args) -> None:
    sys.path.insert(0, str(args.trainer.resolve()))
    import torch
    from toolkit import int4_kernels as ik
    from toolkit import int4_w4a8 as w

    from launcher.in_trainer.selftest.kernels import QUALITY_TOLERANCE

    torch.set_num_threads(args.threads)

    def rel(a, b) -> float:
        a, b = a.float(), b.float()
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    def symmetric(x, qmax, group: int = 0):
        """x quantized per row (and per group of `group` columns) to a symmetric grid, dequantized."""
        rows, cols = x.shape
        xg = x.reshape(rows, cols // group if group else 1, group or cols)
        scale = xg.abs().amax(dim=2, keepdim=True).clamp_min(1e-30) / qmax
        return (torch.round(xg / scale).clamp(-qmax, qmax) * scale).reshape(rows, cols)

    result = {"torch": torch.__version__, "tokens": TOKENS, "out": OUT_FEATURES, "widths": list(WIDTHS),
              "rotations": {k: v and list(v) for k, v in ROTATIONS.items()}, "gate": QUALITY_TOLERANCE,
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "cases": []}
    if args.convrot:
        result["upstream_check"] = upstream_check(torch, args.convrot)
        print(json.dumps({"upstream_check": result["upstream_check"]}), flush=True)
    for in_f in WIDTHS:
        # the gate's layer and inputs (kernels.random_layer / check_quality): same seeds, dtypes, order
        g = torch.Generator().manual_seed(7)
        weight = torch.randn(OUT_FEATURES, in_f, generator=g, dtype=torch.bfloat16) * 0.02
        g = torch.Generator().manual_seed(8)
        x_plain = torch.randn(TOKENS, in_f, generator=g)
        dy = torch.randn(TOKENS, OUT_FEATURES, generator=g, dtype=torch.bfloat16)
        blocks = in_f // 256
        spread = [0] + [b * 256 + 17 * b for b in (blocks // 4, blocks // 2, 3 * blocks // 4)]
        inputs = {"plain": x_plain}
        for name, channels in (("outliers", [0, 1, 2, 3]), ("spread", spread)):
            x = x_plain.clone()
            x[:, channels] *= 100
            inputs[name] = x
        inputs = {k: v.to(torch.bfloat16) for k, v in inputs.items()}
        y_exact = {k: v.float() @ weight.float().t() for k, v in inputs.items()}
        dx_exact = dy.float() @ weight.float()
        for rot_name, rotation in ROTATIONS.items():
            # the weight rotated in fp32, back to the checkpoint's bf16, then stored in 4 bits
            q, s, z = ik.quantize_weight(rotate(torch, weight.float(), rotation).to(torch.bfloat16))
            w4 = ik.dequantize_weight(q, s, z, dtype=torch.float32)
            scales = {fmt: w.WeightScales(q, s, z, ik.GROUP_SIZE, fmt) for fmt in ("int8", "fp8")}
            w4_dx = symmetric(w4.t().contiguous(), INT4_MAX, 64)  # W^T [in, out]: per input column, 64 output rows
            dx16 = rotate(torch, ik.reference_matmul_bwd(dy, q, s, z).float(), rotation)
            for set_name, x in inputs.items():
                xr = rotate(torch, x.float(), rotation).to(torch.bfloat16)  # at run time: bf16 in, bf16 out
                y16 = ik.reference_matmul_fwd(xr, q, s, z)
                case = {"in": in_f, "rotation": rot_name, "inputs": set_name,
                        "bf16_activations_vs_exact": {"y": rel(y16, y_exact[set_name]), "dx": rel(dx16, dx_exact)}}
                for fmt in ("int8", "fp8"):
                    y8 = w.reference_fwd(xr, q, s, z, scales[fmt], fmt)
                    dx8 = rotate(torch, w.reference_bwd(dy, q, s, z, scales[fmt], fmt).float(), rotation)
                    case[f"{fmt}_token"] = {"y": rel(y8, y16), "dx": rel(dx8, dx16),
                                            "y_vs_exact": rel(y8, y_exact[set_name])}
                for scheme, group in (("int4_token", 0), ("int4_group64", 64), ("int4_group16", 16)):
                    y4 = symmetric(xr.float(), INT4_MAX, group) @ w4.t()
                    dx4 = rotate(torch, symmetric(dy.float(), INT4_MAX, group) @ w4_dx.t(), rotation)
                    case[scheme] = {"y": rel(y4, y16), "dx": rel(dx4, dx16), "y_vs_exact": rel(y4, y_exact[set_name])}
                result["cases"].append(case)
                print(json.dumps(case), flush=True)
    summary = {}
    for scheme in ("int8_token", "fp8_token", "int4_token", "int4_group64", "int4_group16"):
        for rot_name in ROTATIONS:
            rows = [c for c in result["cases"] if c["rotation"] == rot_name]
            summary[f"{scheme} {rot_name}"] = {
                set_name: max(max(c[scheme]["y"], c[scheme]["dx"]) for c in rows if c["inputs"] == set_name)
                for set_name in ("plain", "outliers", "spread")}
    result["worst"] = summary
    result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(summary, indent=1))


# --------------------------------------------------------------------------- Triton WMMA probe

def wmma(args) -> None:
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("hip", args.arch, 32)

    @triton.jit
    def dot_kernel(a_ptr, b_ptr, c_ptr, BLOCK: tl.constexpr, NIBBLES: tl.constexpr, PRECISION: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        a = tl.load(a_ptr + offs[:, None] * BLOCK + offs[None, :])
        b = tl.load(b_ptr + offs[:, None] * BLOCK + offs[None, :])
        if NIBBLES:  # the low 4 bits, sign-extended: int8 operands that hold int4 values
            a = (a << 4) >> 4
            b = (b << 4) >> 4
        c = tl.dot(a, b, out_dtype=tl.int32, input_precision=PRECISION)
        tl.store(c_ptr + offs[:, None] * BLOCK + offs[None, :], c)

    @triton.jit
    def dot_scaled_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, BLOCK: tl.constexpr, FORMAT: tl.constexpr):
        m = tl.arange(0, BLOCK)
        half = tl.arange(0, BLOCK // 2)  # e2m1: two values per byte along K
        a = tl.load(a_ptr + m[:, None] * (BLOCK // 2) + half[None, :])
        b = tl.load(b_ptr + half[:, None] * BLOCK + m[None, :])
        k_scales = tl.arange(0, BLOCK // 32)
        sa = tl.load(sa_ptr + m[:, None] * (BLOCK // 32) + k_scales[None, :])
        sb = tl.load(sb_ptr + m[:, None] * (BLOCK // 32) + k_scales[None, :])
        c = tl.dot_scaled(a, sa, FORMAT, b, sb, FORMAT)
        tl.store(c_ptr + m[:, None] * BLOCK + m[None, :], c)

    def emitted(compiled) -> dict:
        asm = compiled.asm["amdgcn"]
        found = {"wmma": sorted(set(re.findall(r"v_wmma_\w+", asm))), "wmma_count": asm.count("v_wmma_")}
        found["iu4"] = "v_wmma_i32_16x16x16_iu4" in asm
        return found

    def attempt(name: str, how: str, build) -> dict:
        row = {"name": name, "how": how}
        try:
            row.update(emitted(build()))
        except Exception as error:  # what does not compile is the finding
            lines = [line for line in str(error).splitlines() if line.strip()]
            row["error"] = f"{type(error).__name__}: {lines[-1] if lines else ''}"[:400]
        print(json.dumps(row), flush=True)
        return row

    def dot_source(dtype: str, nibbles: bool, precision):
        return triton.compiler.ASTSource(
            fn=dot_kernel, signature={"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "c_ptr": "*i32", "BLOCK": "constexpr",
                                      "NIBBLES": "constexpr", "PRECISION": "constexpr"},
            constexprs={"BLOCK": 64, "NIBBLES": nibbles, "PRECISION": precision})

    result = {"triton": triton.__version__, "target": f"hip {args.arch} warp 32",
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "attempts": []}
    for dtype, nibbles, precision in (("i8", False, None), ("i8", True, None), ("i8", False, "ieee"),
                                      ("i8", False, "bf16x3"), ("i8", False, "tf32"), ("u8", False, None)):
        how = (f"tl.dot of 64x64 {dtype} tiles, out_dtype int32, input_precision {precision}"
               + (", operands sign-extended from their low 4 bits" if nibbles else ""))
        result["attempts"].append(attempt(f"dot_{dtype}{'_nibbles' if nibbles else ''}_{precision or 'default'}", how,
                                          lambda d=dtype, n=nibbles, p=precision: triton.compile(dot_source(d, n, p),
                                                                                                 target=target)))
    def dot_scaled_e2m1():
        return triton.compile(triton.compiler.ASTSource(
            fn=dot_scaled_kernel, signature={"a_ptr": "*u8", "b_ptr": "*u8", "sa_ptr": "*u8", "sb_ptr": "*u8",
                                             "c_ptr": "*fp32", "BLOCK": "constexpr", "FORMAT": "constexpr"},
            constexprs={"BLOCK": 64, "FORMAT": "e2m1"}), target=target)
    result["attempts"].append(attempt("dot_scaled_e2m1", "tl.dot_scaled, both operands e2m1 (fp4, two per byte) with "
                                      "e8m0 scales per 32 (microscaling), 64x64", dot_scaled_e2m1))

    # Triton's frontend has no int4 dtype: take the TTIR of the int8 kernel and make its tt.dot take i4
    ttir = triton.compile(dot_source("i8", False, None), target=target).asm["ttir"]
    found = re.search(r"(\n\s*)(%\w+) = tt\.dot (%\w+), (%\w+), (%\w+)(?:, inputPrecision = \w+)? : "
                      r"tensor<64x64xi8> \* tensor<64x64xi8> -> tensor<64x64xi32>", ttir)
    row = {"name": "ttir_dot_i4", "how": "the int8 kernel's TTIR with arith.trunci of both operands to tensor<64x64xi4> "
           "and tt.dot on them, compiled with triton.compile(path)"}
    if found:
        pad, res, a, b, acc = found.groups()
        edited = ttir.replace(found.group(0), (
            f"{pad}%a_i4 = arith.trunci {a} : tensor<64x64xi8> to tensor<64x64xi4>"
            f"{pad}%b_i4 = arith.trunci {b} : tensor<64x64xi8> to tensor<64x64xi4>"
            f"{pad}{res} = tt.dot %a_i4, %b_i4, {acc} : tensor<64x64xi4> * tensor<64x64xi4> -> tensor<64x64xi32>"))
        path = args.out.with_suffix(".i4.ttir")
        path.write_text(edited)
        try:
            compiled = triton.compile(str(path), target=target)
            row.update(emitted(compiled))
            row["ttgir_dot"] = [line.strip()[:300] for line in compiled.asm["ttgir"].splitlines()
                                if re.search(r"tt\.dot |arith\.ext[su]i .*xi4", line)]
        except Exception as error:
            lines = [line for line in str(error).splitlines() if line.strip()]
            row["error"] = f"{type(error).__name__}: {lines[-1] if lines else ''}"[:400]
        finally:
            path.unlink()
    else:
        row["error"] = "the int8 kernel's tt.dot line was not found in its TTIR"
    print(json.dumps(row), flush=True)
    result["attempts"].append(row)

    library = Path(triton.__file__).parent / "_C" / "libtriton.so"
    data = library.read_bytes()
    result["libtriton_mentions"] = {s: s.encode() in data for s in (
        "llvm.amdgcn.wmma.i32.16x16x16.iu4", "llvm.amdgcn.wmma.i32.16x16x16.iu8", "wmma_i32_16x16x16_iu4")}
    result["iu4_emitted_by_any"] = any(r.get("iu4") for r in result["attempts"])
    result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("libtriton_mentions", "iu4_emitted_by_any")}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quality", help="the quality gate with and without a Hadamard rotation (CPU)")
    q.add_argument("--trainer", required=True, type=Path, help="a folder holding toolkit/ (a trainer checkout, or overlay)")
    q.add_argument("--out", required=True, type=Path)
    q.add_argument("--convrot", type=Path, help="a copy of upstream's toolkit/util/convrot_quant.py, to check the rotation")
    q.add_argument("--threads", type=int, default=2)
    m = sub.add_parser("wmma", help="which WMMA instructions Triton emits for int8 / int4 / fp4 dots on gfx1100")
    m.add_argument("--out", required=True, type=Path)
    m.add_argument("--arch", default="gfx1100")
    args = p.parse_args()
    quality(args) if args.command == "quality" else wmma(args)


if __name__ == "__main__":
    main()
