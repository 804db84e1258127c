"""The LoRA's two matmuls in bf16 (model_kwargs lora_matmuls: bf16), its weights kept in float32.

ai-toolkit keeps a LoRA's weights in float32 and casts each input to float32, so every LoRA
matmul of a step runs in float32: on an H100 71-80 ms of a 0.45 s compiled FLUX.2 step at 512 px
(bench/RESULTS.md), and on an RDNA3 card, which has no TF32, at its plain float32 rate. With
`bf16` the two matmuls run under autocast: the input stays in its bf16, the weights are cast per
call, and the weights, their gradients and the optimizer's state stay in float32. Measured on an
H100 (the same LoRA trained 19 steps each way): the deltas' cosine against the float32 LoRA's is
0.988 on the 4-bit base, where the same float32 run repeated gives 0.989, and 0.999 on the bf16
base. `tf32` is `run`'s (PyTorch's TF32 override for the process), `fp32` the trainer's own.
"""

from __future__ import annotations

import torch

from flux2_contract.settings import read

_DTYPE = "_flux2_24gb_lora_matmuls"
COMPUTE_DTYPES = {"bf16": torch.bfloat16}
AUTOCAST_DEVICES = ("cuda", "cpu")  # ROCm's GPUs are "cuda" devices too


def compute_dtype(network):
    """The dtype the network's LoRA matmuls run in (None: its weights' own), read once from the base
    model's model_kwargs and kept on the network. Its first call is often traced by torch.compile (the
    first forward of a compiled block), so it asks nothing a trace cannot follow (a weak reference's
    truth value is one: a graph break)."""
    if not hasattr(network, _DTYPE):
        reference = getattr(network, "base_model_ref", None)
        base_model = reference() if reference is not None else None
        kwargs = getattr(getattr(base_model, "model_config", None), "model_kwargs", None) or {}
        setattr(network, _DTYPE, COMPUTE_DTYPES.get(read(kwargs, "lora_matmuls")))
    return getattr(network, _DTYPE)


def lora_forward(module, network, x):
    """module's LoRA path (its _call_forward) on input x, in the network's LoRA precision."""
    dtype = compute_dtype(network)
    if dtype is None or x.device.type not in AUTOCAST_DEVICES:
        return module._call_forward(x.to(module.lora_down.weight.dtype))
    with torch.autocast(x.device.type, dtype=dtype):
        return module._call_forward(x)
