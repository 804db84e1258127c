"""Frozen 4-bit Linear layers for training adapters on top of them (QLoRA-style).

The weight format and the GPU kernels are toolkit/int4_kernels.py's. An Int4Linear holds
how it multiplies (`kernel`, a toolkit/qtypes.py `Int4Kernel`, set once after loading by
`qtypes.configure_linears`): bf16 activations through the int4 kernels (qtype int4_fused), or
8-bit activations and 8-bit weight slices through toolkit/int4_w4a8.py (qtype int4_w4a8), same
stored weight. Without a GPU the plain-PyTorch reference runs. The base weight never gets a
gradient; only the input does.
"""

from __future__ import annotations

import json
from typing import Optional

import torch
import torch.nn as nn

from toolkit.int4_kernels import (  # noqa: F401  (GROUP_SIZE, quantize_weight: the patches' names)
    GROUP_SIZE,
    HAVE_TRITON,
    dequantize_weight,
    int4_matmul_bwd,
    int4_matmul_fwd,
    kernel_available,
    quantize_weight,
    reference_matmul_bwd,
    reference_matmul_fwd,
)
from toolkit.qtypes import BF16, Int4Kernel

FORMAT = "int4_fused"
FORMAT_VERSION = 1


# --------------------------------------------------------------------------- autograd


class Int4LinearFunction(torch.autograd.Function):
    """y = x @ W^T (+ bias) with W frozen 4-bit; the gradient flows to x only.

    Nothing but the packed weight is kept for backward: the dequantized weight
    is never stored (kernel path) or rebuilt per call (reference path).
    """

    @staticmethod
    def forward(ctx, x, qweight, scale, zero, bias, group_size, kernel, use_kernel):
        shape = x.shape
        x2d = x.reshape(-1, shape[-1])
        if use_kernel:
            y = int4_matmul_fwd(x2d, qweight, scale, zero, group_size, kernel.gemm, kernel.chunk_bytes)
        else:
            y = reference_matmul_fwd(x2d, qweight, scale, zero, group_size)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(qweight, scale, zero)
        ctx.group_size = group_size
        ctx.kernel = kernel
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
                dx = int4_matmul_bwd(dy2d, qweight, scale, zero, ctx.group_size, ctx.kernel.gemm,
                                     ctx.kernel.chunk_bytes)
            else:
                dx = reference_matmul_bwd(dy2d, qweight, scale, zero, ctx.group_size)
            dx = dx.reshape(ctx.in_shape)
        return dx, None, None, None, None, None, None, None


# --------------------------------------------------------------------------- module


class Int4Linear(nn.Module):
    """Drop-in, frozen replacement for nn.Linear with a 4-bit weight.

    Buffers (not parameters, so optimizers and requires_grad_ never touch them):
    qweight, scale, zero and an optional bias. ``weight`` returns the
    dequantized weight for code that inspects it (dtype/device/shape); it
    allocates a full copy, so hot paths must not use it.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 group_size: int = GROUP_SIZE, dtype=torch.bfloat16, device=None,
                 kernel: Optional[Int4Kernel] = None):
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
        # how the matmuls run (toolkit/qtypes.py); not stored in the cache: the qtype decides it
        self.kernel = kernel or Int4Kernel()

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = GROUP_SIZE, dtype=None,
                    kernel: Optional[Int4Kernel] = None) -> "Int4Linear":
        """Quantize an nn.Linear (its weight cast to ``dtype`` first, default: its own dtype)."""
        w = linear.weight.detach()
        if dtype is not None:
            w = w.to(dtype)
        mod = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  group_size=group_size, dtype=w.dtype, device=w.device, kernel=kernel)
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

    # never traced by torch.compile (toolkit/block_compile.py): its Triton kernels, torch._scaled_mm
    # and the per-layer scale cache run as they are, between the compiled parts of a block
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel
        use_kernel = kernel_available(x) if kernel.use_kernel is None else kernel.use_kernel
        if kernel.activations != BF16:
            from toolkit.int4_w4a8 import w4a8_linear

            return w4a8_linear(self, x, use_kernel)
        return Int4LinearFunction.apply(x, self.qweight, self.scale, self.zero, self.bias,
                                        self.group_size, kernel, bool(use_kernel))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, group_size={self.group_size}, 4-bit, "
                f"activations={self.kernel.activations}, gemm={self.kernel.gemm}")


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
