"""Shared helpers of the bench scripts: the patched trainer's own code, loaded from a checkout.

Every figure in bench/RESULTS.md runs the patched trainer's code, not a copy of it:

  * the FLUX.2 model and its id helpers: extensions_built_in/diffusion_models/flux2/src/
    model.py (Flux2, Flux2Params) and sampling.py (batched_prc_img / batched_prc_txt);
  * the quantization path: toolkit/util/quantize.py (get_qtype, quantize_transformer_block,
    quantize_extras, quantize_model); qtype "uint4" = torchao UIntXWeightOnlyConfig(torch.uint4);
  * the streamed loader: toolkit/streamed_safetensors.py;
  * the quantized cache: toolkit/quantized_cache.py (write_cache, read_cache, rebuild_state,
    assign_state).

The trainer directory is either a full checkout of the series (this machine, with the trainer
venv) or the few files that bench/carry.py copies into .bench-carry/trainer for the GPU machine.

Two things are not the trainer's own:
  * toolkit.print pulls in diffusers through toolkit.accelerator; where that import fails (the GPU
    machine has no diffusers) a stand-in module with print_acc = print is registered instead.
    quantize.py only uses print_acc for messages.
  * the trainer's LoRA (toolkit/lora_special.py) needs diffusers, transformers and most of the
    toolkit. add_lora() below does what its LoRAModule does for a Linear (or, with qtype
    int4_fused, an Int4Linear: lora_special matches both by class name) in training: the
    module's forward is replaced by org_forward(x) + lora_up(lora_down(x)) * multiplier * alpha/rank,
    lora_down kaiming-uniform, lora_up zero, both in the train dtype; no dropout.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.nn as nn

GiB = 2**30
BLOCK_LISTS = ["double_blocks", "single_blocks"]  # Flux2Model.get_transformer_block_names()

# tiny shape for CPU dry runs: every code path, seconds per step
TINY_PARAMS = dict(
    hidden_size=128, num_heads=2, depth=2, depth_single_blocks=2, context_in_dim=256,
    axes_dim=[16, 16, 16, 16],
)

FLUX2_SRC = Path("extensions_built_in/diffusion_models/flux2/src")


class Trainer:
    """Modules of one trainer checkout, imported once."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        if not (self.root / FLUX2_SRC / "model.py").is_file():
            raise SystemExit(f"{self.root} is not a trainer checkout (no {FLUX2_SRC}/model.py)")
        self.stubs: List[str] = []
        if str(self.root) not in sys.path:
            sys.path.insert(0, str(self.root))
        # the flux2 src folder as its own package, so sampling.py's "from .model import" works
        # without importing extensions_built_in/__init__.py (which imports every model)
        pkg = types.ModuleType("bench_flux2_src")
        pkg.__path__ = [str(self.root / FLUX2_SRC)]
        sys.modules["bench_flux2_src"] = pkg
        self.model = importlib.import_module("bench_flux2_src.model")
        self.sampling = importlib.import_module("bench_flux2_src.sampling")
        self.streamed = importlib.import_module("toolkit.streamed_safetensors")
        self.qcache = importlib.import_module("toolkit.quantized_cache")
        self._quantize = None

    @property
    def quantize(self):
        """toolkit.util.quantize (needs torchao and optimum-quanto)."""
        if self._quantize is None:
            try:
                importlib.import_module("toolkit.print")
            except Exception as e:  # diffusers missing on the GPU machine
                stub = types.ModuleType("toolkit.print")
                stub.print_acc = print
                sys.modules["toolkit.print"] = stub
                self.stubs.append(f"toolkit.print -> print ({type(e).__name__}: {e})")
            self._quantize = importlib.import_module("toolkit.util.quantize")
        return self._quantize

    def params(self, tiny: bool = False, **over):
        kw = dict(TINY_PARAMS) if tiny else {}
        kw.update({k: v for k, v in over.items() if v is not None})
        return self.model.Flux2Params(**kw)

    def commit(self) -> str:
        """git HEAD of the checkout, or the COMMIT file bench/carry.py writes."""
        stamp = self.root / "COMMIT"
        if stamp.is_file():
            return stamp.read_text().strip()
        return self.qcache.fork_commit(self.root)


@dataclass
class ModelConfigStub:
    """The ModelConfig fields the quantize / streamed-load functions read."""

    qtype: str = "uint4"
    quantize: bool = True
    accuracy_recovery_adapter: Optional[str] = None
    low_vram: bool = True
    model_kwargs: Dict = field(default_factory=dict)


class BaseModelStub:
    """Stands in for Flux2Model(BaseModel) where the trainer's functions take `self`/base_model."""

    def __init__(self, device, dtype=torch.bfloat16, qtype="uint4", quantize=True, model_kwargs=None,
                 log=None):
        self.device_torch = torch.device(device)
        self.quantize_device = self.device_torch
        self.torch_dtype = dtype
        self.model_config = ModelConfigStub(qtype=qtype, quantize=quantize,
                                            model_kwargs=dict(model_kwargs or {}))
        self._log = log or (lambda msg: None)

    def print_and_status_update(self, msg):
        self._log(msg)

    def get_transformer_block_names(self):
        return list(BLOCK_LISTS)


def meta_model(tr: Trainer, params, dtype=torch.bfloat16):
    with torch.device("meta"):
        model = tr.model.Flux2(params)
    model.to(dtype)
    model.requires_grad_(False)
    return model


def init_random_(module: nn.Module, seed: int, std: float = 0.02):
    """Random weights: norm scales 1, everything else N(0, std); deterministic per seed."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name == "scale" or name.endswith(".scale"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)


def blocks_of(model) -> List[nn.Module]:
    return list(model.double_blocks) + list(model.single_blocks)


def extras_of(model) -> List[nn.Module]:
    return [c for n, c in model.named_children() if n not in BLOCK_LISTS]


def build_random(tr: Trainer, params, device, qtype: Optional[str], dtype=torch.bfloat16, log=print,
                 model_kwargs: Optional[Dict] = None):
    """Full model with random weights, block by block, straight into its final form.

    qtype None: bf16 blocks materialized on `device`. qtype "uint4" etc: each block is
    materialized on `device`, then the trainer's quantize_transformer_block quantizes it there and
    parks it on the CPU (what the streamed loader does with quantize_device: gpu); the non-block
    modules are filled on `device`, moved to the CPU and quantized there by the trainer's
    quantize_extras (what the streamed loader's on_rest does). The bf16 copy of the whole model
    never exists. qtype "int4_fused": quantize_transformer_block swaps the block Linears for
    Int4Linear modules (toolkit/int4_linear.py); the extras get torchao uint4 as with "uint4".
    `model_kwargs` are the stand-in base model's (its model_config.model_kwargs, which the
    trainer's functions read); the Int4Linears' kernel is set afterwards, from the same
    model_kwargs, by the trainer's set_int4_activations.
    """
    model = meta_model(tr, params, dtype)
    stub = BaseModelStub(device, dtype, qtype or "uint4", quantize=qtype is not None, model_kwargs=model_kwargs,
                         log=log)
    q = tr.quantize if qtype else None
    qt = q.get_qtype(qtype) if qtype else None
    blocks = blocks_of(model)
    for i, b in enumerate(blocks):
        b.to_empty(device=device)
        init_random_(b, seed=1000 + i)
        if qt is not None:
            prefix = f"double_blocks.{i}" if i < params.depth else f"single_blocks.{i - params.depth}"
            q.quantize_transformer_block(stub, b, qt, torch.device(device), name=prefix)
        if i % 8 == 0 or i == len(blocks) - 1:
            log(f"built block {i + 1}/{len(blocks)}")
    # random numbers are drawn on `device` (on the CPU the ~0.8 B extras took ~23 s of each run);
    # quantized models then get their extras on the CPU, where quantize_extras works on them
    for j, c in enumerate(extras_of(model)):
        c.to_empty(device=device)
        if any(True for _ in c.parameters()):
            init_random_(c, seed=j)
        if qt is not None:
            c.to("cpu")
    if qt is not None:
        q.quantize_extras(stub, model, qt)
    # pe_embedder etc. may hold buffers created on meta: rebuild any left on meta
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"left on meta: {left[:5]}")
    model.requires_grad_(False)
    return model


# ---------------------------------------------------------------- LoRA (see module docstring)


def is_linear(m) -> bool:
    """nn.Linear, or the trainer's Int4Linear (toolkit/int4_linear.py, qtype int4_fused), which
    replaces the block Linears; lora_special.LINEAR_MODULES matches it by class name too."""
    return isinstance(m, nn.Linear) or type(m).__name__ == "Int4Linear"


def add_lora(model, rank: int, alpha: float, device, dtype=torch.bfloat16, multiplier: float = 1.0,
             compute_dtype=None):
    """LoRA on every Linear (nn.Linear or Int4Linear) inside the transformer blocks; returns the
    LoRA parameters. `compute_dtype` (e.g. bf16 for an fp32 LoRA): its two matmuls run in that
    dtype, the weights cast per call, the parameters and their gradients staying in `dtype`."""
    params = []
    n = 0
    for blist in BLOCK_LISTS:
        for block in getattr(model, blist):
            for m in [m for m in block.modules() if is_linear(m)]:
                down = nn.Linear(m.in_features, rank, bias=False, device=device, dtype=dtype)
                up = nn.Linear(rank, m.out_features, bias=False, device=device, dtype=dtype)
                nn.init.kaiming_uniform_(down.weight, a=math.sqrt(5))
                nn.init.zeros_(up.weight)
                m.lora_down, m.lora_up = down, up  # registered submodules: follow .to()
                scale = multiplier * alpha / rank
                org_forward = m.forward

                def forward(x, _org=org_forward, _m=m, _s=scale):
                    out = _org(x)
                    if compute_dtype is None:
                        lx = x.to(_m.lora_down.weight.dtype)
                        return out + (_m.lora_up(_m.lora_down(lx)) * _s).to(out.dtype)
                    down_w, up_w = _m.lora_down.weight.to(compute_dtype), _m.lora_up.weight.to(compute_dtype)
                    lx = nn.functional.linear(nn.functional.linear(x.to(compute_dtype), down_w), up_w)
                    return out + (lx * _s).to(out.dtype)

                m.forward = forward
                params += [down.weight, up.weight]
                n += 1
    for p in params:
        p.requires_grad_(True)
    return params, n


# ---------------------------------------------------------------- inputs and FLOPs


def latent_hw(res: int) -> int:
    """FLUX.2 latent side at `res` px: VAE /8 then 2x2 packing into 128 channels."""
    return res // 16


def make_inputs(tr: Trainer, params, res: int, batch: int, n_txt: int, device, dtype=torch.bfloat16,
                seed: int = 0):
    """x, ids and ctx built the way Flux2Model.get_noise_prediction builds them."""
    g = torch.Generator().manual_seed(seed)
    hw = latent_hw(res)
    latent = torch.randn(batch, params.in_channels, hw, hw, generator=g)
    txt_emb = torch.randn(batch, n_txt, params.context_in_dim, generator=g)
    with torch.no_grad():
        txt, txt_ids = tr.sampling.batched_prc_txt(txt_emb)
        packed, img_ids = tr.sampling.batched_prc_img(latent)
    return dict(
        x=packed.to(device, dtype), x_ids=img_ids.to(device), ctx=txt.to(device, dtype),
        ctx_ids=txt_ids.to(device), timesteps=torch.full((batch,), 0.5, device=device, dtype=dtype),
        guidance=torch.full((batch,), 4.0, device=device, dtype=dtype),
    ), torch.randn(batch, hw * hw, params.in_channels, generator=g).to(device, dtype)


def step_flops(model, params, n_img: int, n_txt: int, batch: int, rank: int) -> Dict[str, float]:
    """Analytic FLOPs of one LoRA step with checkpointed blocks and a frozen base.

    Block Linears: forward + recompute + grad wrt input = 3 x 2*T*in*out (no weight grad).
    Attention (QK^T and PV, 2 x 2*L*L*hidden per layer forward): forward + recompute +
    backward (twice the forward) = 4x. LoRA: forward + recompute + both grads = 4x.
    Non-block Linears: forward + grad wrt input = 2x (counted on their token counts).
    """
    L = n_img + n_txt
    blocks = base_extra = lora = 0
    for name, m in model.named_modules():
        if not is_linear(m) or name.endswith((".lora_down", ".lora_up")):
            continue  # add_lora's own Linears are counted in `lora` below
        if name.startswith("double_blocks"):
            t = n_img if ".img_" in name else n_txt
        elif name.startswith("single_blocks"):
            t = L
        elif name == "img_in" or name.startswith("final_layer"):
            t = n_img
        elif name == "txt_in":
            t = n_txt
        else:
            t = 1
        f = 2.0 * batch * t * m.in_features * m.out_features
        if "blocks" in name:
            blocks += f
            lora += 2.0 * batch * t * rank * (m.in_features + m.out_features)
        else:
            base_extra += f
    layers = params.depth + params.depth_single_blocks
    attn = layers * 2 * (2.0 * batch * L * L * params.hidden_size)
    total = 3 * blocks + 4 * attn + 4 * lora + 2 * base_extra
    return {"total": total, "block_linear_fwd": blocks, "attn_fwd": attn, "lora_fwd": lora,
            "other_linear_fwd": base_extra}


# ---------------------------------------------------------------- host memory


def proc_status() -> Dict[str, int]:
    """VmRSS / VmHWM / RssAnon / RssFile in bytes (Linux); {} elsewhere."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def drop_file_cache(path) -> bool:
    """Ask the kernel to drop `path`'s clean pages from the page cache (cold reads)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
