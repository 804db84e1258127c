"""Frozen 4-bit Linear layers for training adapters on top of them (QLoRA-style).

The weight format and the GPU kernels are toolkit/int4_kernels.py's. An Int4Linear holds
how it multiplies (`kernel`, a flux2_contract/qtypes.py `Int4Kernel`, set once after loading by
`configure_linears` below): bf16 activations through the int4 kernels (qtype int4_fused), or
8-bit activations and 8-bit weight slices through toolkit/int4_w4a8.py (qtype int4_w4a8), same
stored weight. Without a GPU the plain-PyTorch reference runs. The base weight never gets a
gradient; only the input does.

Under torch.compile (toolkit/block_compile.py) the matmul is a PyTorch operator of its own
(`torch.ops.flux2_24gb.int4_matmul`, with `int4_matmul_input_grad` for the backward): one opaque
node of known output shape, so a block compiles as one graph around its 4-bit Linears while the
kernels inside (Triton, torch._scaled_mm, the sliced requantization) run as they do uncompiled.
Uncompiled, the same kernels run through a plain autograd.Function: the operator's dispatch costs
more host time per call, and a step makes over a thousand of them. A layer that holds its 8-bit
copies (a memory plan's, `hold_copy`) and multiplies FP8 through torch._scaled_mm needs neither
inside a compiled block: its matmul is plain PyTorch the graph traces (CopyMatmulFunction).
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
from toolkit import int4_w4a8
from flux2_contract.qtypes import BF16, IN_REGISTER, QTYPES, Int4Kernel, kernel_for

FORMAT = "int4_fused"
FORMAT_VERSION = 1


# --------------------------------------------------------------------------- autograd and the operator


def _multiply(a2d, qweight, scale, zero, copy, group_size, activations, gemm, chunk_bytes, use_kernel, transposed):
    """a2d @ W^T, or a2d @ W (transposed: the input gradient), the way the layer's kernel says;
    `copy` is the layer's 8-bit copy of W in this orientation (codes, column scales), or None."""
    if activations != BF16:
        kernel = Int4Kernel(activations, gemm, chunk_bytes, use_kernel)
        return int4_w4a8.w4a8_matmul(a2d, qweight, scale, zero, group_size, kernel, use_kernel, transposed, copy)
    if use_kernel:
        matmul = int4_matmul_bwd if transposed else int4_matmul_fwd
        return matmul(a2d, qweight, scale, zero, group_size, chunk_bytes)
    reference = reference_matmul_bwd if transposed else reference_matmul_fwd
    return reference(a2d, qweight, scale, zero, group_size)


@torch.library.custom_op("flux2_24gb::int4_matmul", mutates_args=())
def int4_matmul(x2d: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                copy: Optional[torch.Tensor], copy_scale: Optional[torch.Tensor],
                input_grad_copy: Optional[torch.Tensor], input_grad_scale: Optional[torch.Tensor], group_size: int,
                activations: str, gemm: str, chunk_bytes: int, use_kernel: bool) -> torch.Tensor:
    """x2d[M, K] @ W^T -> [M, N] in x2d's dtype, W the frozen 4-bit weight [N, K]; `copy` and
    `input_grad_copy` the codes of the layer's 8-bit copies of W (forward, input gradient) or None,
    each with its column scales."""
    return _multiply(x2d, qweight, scale, zero, held(copy, copy_scale), group_size, activations, gemm, chunk_bytes,
                     use_kernel, False)


@torch.library.custom_op("flux2_24gb::int4_matmul_input_grad", mutates_args=())
def int4_matmul_input_grad(dy2d: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                           copy: Optional[torch.Tensor], copy_scale: Optional[torch.Tensor], group_size: int,
                           activations: str, gemm: str, chunk_bytes: int, use_kernel: bool) -> torch.Tensor:
    """dy2d[M, N] @ W -> [M, K] in dy2d's dtype: the input gradient of int4_matmul."""
    return _multiply(dy2d, qweight, scale, zero, held(copy, copy_scale), group_size, activations, gemm, chunk_bytes,
                     use_kernel, True)


def held(codes, column_scale):
    """An 8-bit copy as the matmuls take it, (codes, column scales), or None where none is held."""
    return None if codes is None else (codes, column_scale)


@int4_matmul.register_fake
def _(x2d, qweight, scale, zero, copy, *settings):
    # the width from the copy where one is held: a layer holding both has freed its 4-bit weight
    return x2d.new_empty((x2d.shape[0], qweight.shape[0] if copy is None else copy.shape[0]))


@int4_matmul_input_grad.register_fake
def _(dy2d, qweight, scale, zero, copy, *settings):
    return dy2d.new_empty((dy2d.shape[0], qweight.shape[1] * 2 if copy is None else copy.shape[0]))


def _keep_for_backward(ctx, inputs, output):
    """Nothing but the packed weight (and the input gradient's copy, where held) is kept: no
    dequantized weight is ever stored."""
    _, qweight, scale, zero, _, _, input_grad_copy, input_grad_scale, *settings = inputs
    ctx.save_for_backward(qweight, scale, zero, input_grad_copy, input_grad_scale)
    ctx.settings = settings


def _backward(ctx, dy2d):
    dx = None
    if ctx.needs_input_grad[0]:
        dx = int4_matmul_input_grad(dy2d, *ctx.saved_tensors, *ctx.settings)
    return (dx,) + (None,) * 12


int4_matmul.register_autograd(_backward, setup_context=_keep_for_backward)


class Int4LinearFunction(torch.autograd.Function):
    """int4_matmul's autograd without the operator: what runs uncompiled."""

    @staticmethod
    def forward(ctx, x2d, qweight, scale, zero, copy, copy_scale, input_grad_copy, input_grad_scale, *settings):
        ctx.save_for_backward(qweight, scale, zero, input_grad_copy, input_grad_scale)
        ctx.settings = settings
        return _multiply(x2d, qweight, scale, zero, held(copy, copy_scale), *settings, False)

    @staticmethod
    def backward(ctx, dy2d):
        dx = None
        if ctx.needs_input_grad[0]:
            qweight, scale, zero, copy, copy_scale = ctx.saved_tensors
            dx = _multiply(dy2d, qweight, scale, zero, held(copy, copy_scale), *ctx.settings, True)
        return (dx,) + (None,) * 12


class CopyMatmulFunction(torch.autograd.Function):
    """A compiled block's FP8 matmul against the layer's held forward copy (toolkit/int4_w4a8
    traced_copy_matmul): plain PyTorch that the block's graph traces, so Inductor fuses the
    activation's quantization into the kernel before it. The input gradient traces the same way
    against the held input-gradient copy, or is int4_matmul_input_grad's operator without one."""

    @staticmethod
    def forward(ctx, x2d, copy, column_scale, input_grad_copy, input_grad_scale, qweight, scale, zero, *settings):
        ctx.save_for_backward(input_grad_copy, input_grad_scale, qweight, scale, zero)
        ctx.settings = settings
        return int4_w4a8.traced_copy_matmul(x2d, copy, column_scale, input_grad=False)

    @staticmethod
    def backward(ctx, dy2d):
        copy, column_scale, qweight, scale, zero = ctx.saved_tensors
        kernel = Int4Kernel(*ctx.settings[1:])
        if copy is not None and int4_w4a8.traceable_copy(dy2d, copy, kernel):
            dx = int4_w4a8.traced_copy_matmul(dy2d, copy, column_scale, input_grad=True)
        else:
            dx = int4_matmul_input_grad(dy2d, qweight, scale, zero, copy, column_scale, *ctx.settings)
        return (dx,) + (None,) * 12


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
        # how the matmuls run (flux2_contract/qtypes.py); not stored in the cache: the qtype decides it
        self.kernel = kernel or Int4Kernel()
        # 8-bit copies of the weight (hold_copy), (codes, output column scales) or None: plain
        # attributes, so no state dict, checkpoint or move carries them (used where the weight is)
        self.forward_copy = None
        self.input_grad_copy = None

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
        self._needs_4bit_weight("written")
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
        return self.dequantize()

    def dequantize(self, dtype=None) -> torch.Tensor:
        self._needs_4bit_weight("dequantized")
        return dequantize_weight(self.qweight, self.scale, self.zero, self.group_size, dtype)

    @property
    def freed(self) -> bool:
        """Whether the 4-bit weight was freed (hold_copy, once both 8-bit copies are held)."""
        return self.qweight.numel() == 0

    def _needs_4bit_weight(self, what: str) -> None:
        if self.freed:
            raise RuntimeError(f"this Int4Linear ({self.out_features}x{self.in_features}) cannot be {what}: its 4-bit "
                               "weight was freed once its two 8-bit copies were held (the memory plan's); they "
                               f"multiply on {self.forward_copy[0].device} only")

    def hold_copy(self, transposed: bool) -> int:
        """Hold the weight's 8-bit copy for the forward (or, transposed, the input gradient), so those
        matmuls skip requantizing the 4-bit weight (toolkit/int4_w4a8.eight_bit_copy); returns the
        bytes it added. Once both are held every matmul reads them alone, and the 4-bit weight (about
        half a copy's bytes) is freed; the memory plan counts it back."""
        name = "input_grad_copy" if transposed else "forward_copy"
        if getattr(self, name) is not None:
            return 0
        held = int4_w4a8.eight_bit_copy(self.qweight, self.scale, self.zero, self.group_size, self.kernel.activations,
                                        transposed)
        setattr(self, name, held)
        if self.forward_copy is not None and self.input_grad_copy is not None:
            for buffer in ("qweight", "scale", "zero"):
                setattr(self, buffer, getattr(self, buffer).new_empty(0))
        return held[0].numel() * held[0].element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel
        use_kernel = kernel_available(x) if kernel.use_kernel is None else kernel.use_kernel
        x2d = x.reshape(-1, x.shape[-1])
        settings = (self.group_size, kernel.activations, kernel.gemm, kernel.chunk_bytes, bool(use_kernel))
        copy, grad_copy = self._held(self.forward_copy, x), self._held(self.input_grad_copy, x)
        if self.freed and not (copy and grad_copy and use_kernel):
            self._needs_4bit_weight(f"multiplied on {x.device}")
        compiling = torch.compiler.is_compiling()
        if compiling and copy is not None and int4_w4a8.traceable_copy(x2d, copy[0], kernel):
            y = CopyMatmulFunction.apply(x2d, *copy, *(grad_copy or (None, None)), self.qweight, self.scale,
                                         self.zero, *settings)
        else:
            matmul = int4_matmul if compiling else Int4LinearFunction.apply
            y = matmul(x2d, self.qweight, self.scale, self.zero, *(copy or (None, None)), *(grad_copy or (None, None)),
                       *settings)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def _held(copy, x):
        """A held copy where x is (a model moved elsewhere multiplies without it), else None."""
        return copy if copy is not None and copy[0].device == x.device else None

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


def configure_linears(model: nn.Module, qtype: str, model_kwargs=None, device=None) -> int:
    """After loading (from the checkpoint or the quantized cache): every Int4Linear of `model`
    takes qtype's kernel (`qtypes.kernel_for`, from the run's model_kwargs), chosen once here.
    Returns how many multiply with 8-bit activations; a qtype outside the table has no
    Int4Linear and leaves the model alone."""
    if qtype not in QTYPES:
        return 0
    kernel = kernel_for(qtype, model_kwargs, device)
    linears = [module for module in model.modules() if isinstance(module, Int4Linear)]
    for module in linears:
        module.kernel = kernel
    return len(linears) if kernel.activations != BF16 else 0


def eight_bit_linears(module: nn.Module) -> list:
    """The Int4Linears of `module` that multiply with 8-bit activations through the GPU kernels:
    the ones an 8-bit copy of the weight (Int4Linear.hold_copy) can serve."""
    return [m for m in module.modules() if isinstance(m, Int4Linear) and m.kernel.activations != BF16
            and m.kernel.use_kernel is not False and kernel_available(m.scale)]


def hold_block_copies(block: nn.Module, copies: int) -> int:
    """A memory plan's 8-bit copies of one block (flux2_contract/memory_plan.py, which plans none for
    gemm in_register): with `copies` 1 its Linears' forward copies, with 2 their input gradient's
    too. Returns the bytes held."""
    return sum(m.hold_copy(transposed) for transposed in (False, True)[:copies] for m in eight_bit_linears(block))


def hold_8bit_weights(model: nn.Module, budget_bytes: int) -> int:
    """Where VRAM allows: keep the 8-bit copies of the weights of `model`'s Int4Linears that multiply
    with 8-bit activations on a GPU (Int4Linear.hold_copy), up to `budget_bytes` in all:
    first every layer's forward copy (the forward and its checkpointed recompute use it), then the
    input gradient's. Those matmuls then skip requantizing the 4-bit weight. Each copy costs twice
    its 4-bit weight; a layer holding both frees its 4-bit weight (hold_copy), so a full set of both
    takes four times the 4-bit model's bytes in place of it. A layer of gemm in_register holds no
    forward copy (its forward reads the 4-bit weight). Returns the bytes held."""
    linears = eight_bit_linears(model)
    held = 0
    for transposed in (False, True):
        for m in linears:
            if m.kernel.gemm == IN_REGISTER and not transposed:
                continue
            padded = int4_w4a8.padded
            cost = m.in_features * padded(m.out_features) if transposed else m.out_features * padded(m.in_features)
            if held + cost > budget_bytes:
                return held
            held += m.hold_copy(transposed)
    return held
