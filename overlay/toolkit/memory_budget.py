"""The memory plan of one trainer run: its settings (model_kwargs), the VRAM budget, the cap that
makes a large GPU behave as the small card, and the plan applied to the loaded transformer.

model_kwargs (flux2_contract/settings.py): memory_plan, stream_mode, vram_budget_gib (the budget: the
trainer's allocator is capped there too, with set_per_process_memory_fraction, where CUDA/HIP
exists), vram_margin_gib, and launch_plan: the plan `run` made for a preset's budget.

Before the transformer loads, the plan from its shapes decides where each block goes as it is built
(LoadPlacement): `run`'s plan where the budget bytes and run shape found here are the ones it
planned for, else a plan made here (saying why). Once loaded, the plan is made again from the bytes
of each loaded block only where they differ from the ones it assumed (saying so). That plan is
printed, carried out and recorded. A plan for compiled blocks counts what their kept activations
hold compiled; once blocks run uncompiled (toolkit/block_compile.py when_uncompiled), the kept
blocks past its fallback_kept recompute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolkit import block_compile, block_streaming, trainer_telemetry
from flux2_contract.qtypes import STREAMABLE
from flux2_contract.settings import read
from flux2_contract.memory_plan import (GIB, Flux2Shape, PlanError, ask_differences, compact, flux2_inputs, handed,
                                        holds_8bit_copies, make_plan, plan_ask, size)

def run_shape(process) -> dict:
    """Resolution (the largest of the datasets), batch and LoRA rank of a training process."""
    resolutions = [int(d.resolution) for d in (process.datasets or []) if isinstance(d.resolution, int)]
    rank = getattr(process.network_config, "linear", None) if process.network_config else None
    return {"resolution": max(resolutions, default=1024), "batch": int(process.train_config.batch_size),
            "lora_rank": int(rank or 32)}


def enabled(model_kwargs: dict) -> bool:
    return read(model_kwargs, "memory_plan") == "auto"


def stream_mode(model_kwargs: dict) -> str:
    return read(model_kwargs, "stream_mode")


def budget_bytes(model_kwargs: dict, device) -> int | None:
    """The bytes the plan may use on `device`, after capping the allocator at the preset's budget.
    None on a device without memory figures and no preset budget (no plan)."""
    margin = int(float(read(model_kwargs, "vram_margin_gib")) * GIB)
    preset = read(model_kwargs, "vram_budget_gib")
    cap = int(float(preset) * GIB) if preset is not None else None
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None if cap is None else cap - margin
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    # what the allocator caches but no tensor uses (the text phase's encoder layers and activations
    # on a first launch) is this process's to plan with: counted as reserved, it made a first
    # launch stream blocks that a relaunch, with no text phase, keeps resident
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if fraction is not None:  # a cap set on this process before (a benchmark's) is free VRAM too
        free = min(free, int(fraction(device) * total) - reserved)
    if cap is None:
        return free - margin
    if cap < total:
        torch.cuda.set_per_process_memory_fraction(cap / total, device)
    room = cap - reserved
    if free < room:
        print(f"memory plan: the card has {free / GIB:.2f} GiB free, less than the {room / GIB:.2f} GiB the "
              f"preset's vram_budget_gib {float(preset):g} leaves: planning for {free / GIB:.2f} GiB", flush=True)
        room = free
    return room - margin


def in_flight(model_kwargs: dict) -> int:
    return 2 if stream_mode(model_kwargs) == block_streaming.OVERLAPPED else 1


def math_attention(model_kwargs: dict) -> bool:
    """Only PyTorch's math attention runs on this GPU (the self-test's verdict): the plan holds its matrices."""
    return read(model_kwargs, "sdpa_kernels") == "math"


def shape_of(params) -> Flux2Shape:
    return Flux2Shape(params.hidden_size, params.num_heads, params.depth, params.depth_single_blocks,
                      params.mlp_ratio, params.context_in_dim, params.in_channels)


def plan_for(model_kwargs: dict, params, run: dict, budget: int, weight_bytes=None, nonblock_bytes=None):
    inputs = flux2_inputs(shape_of(params), budget, run["resolution"], run["batch"], run["lora_rank"],
                          weight_bytes=weight_bytes, nonblock_bytes=nonblock_bytes, in_flight=in_flight(model_kwargs),
                          math_attention=math_attention(model_kwargs), copies=run["copies"], compiled=run["compiled"])
    try:
        return make_plan(inputs)
    except PlanError as error:
        raise PlanError(f"{error} (model_kwargs in the preset; memory_plan: off turns the plan off)") from None


def storage_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor really holds: a quantized tensor subclass (torchao) by its inner tensors."""
    if type(tensor.data) is torch.Tensor or not hasattr(tensor, "__tensor_flatten__"):
        return tensor.numel() * tensor.element_size()
    names, _ = tensor.__tensor_flatten__()
    return sum(storage_bytes(getattr(tensor, name)) for name in names)


def tensor_bytes(module: torch.nn.Module, frozen_only: bool) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(storage_bytes(t) for t in tensors if not (frozen_only and t.requires_grad))


def measured(transformer, plan) -> tuple[dict, int]:
    """Each block's frozen bytes as loaded (what streaming moves), and every other byte: the weights
    outside the blocks, and block tensors that still require grad, which stay on the device (at load
    no LoRA is attached: an unquantized base's weights, which the trainer freezes later)."""
    blocks = {b.name: tensor_bytes(transformer.get_submodule(b.name), frozen_only=True) for b in plan.blocks}
    return blocks, tensor_bytes(transformer, frozen_only=False) - sum(blocks.values())


HOST = torch.device("cpu")


def block_of(name: str) -> str:
    """The plan's name of the block a module or tensor belongs to: `single_blocks.3` for
    `single_blocks.3.linear1.qweight` (the first two parts of any name: no block's for the rest)."""
    return ".".join(name.split(".")[:2])


@dataclass(frozen=True)
class LoadPlacement:
    """Where each part of the transformer goes as soon as it is quantized or read from the cache.

    The blocks a memory plan streams go to the host (block_streaming pins them once the plan is
    carried out); the other blocks and everything outside the blocks go straight to `device`, so
    the host never holds the whole 4-bit model (walls 1-2). With no plan, or with model_kwargs
    blocks_to_device: false (`device` is then the CPU), everything goes to `device`.
    """

    device: torch.device
    streamed: frozenset = frozenset()

    def __call__(self, name: str) -> torch.device:
        """The device of a block, or of a module or tensor of the model, by its name."""
        return HOST if block_of(name) in self.streamed else self.device

    def move_rest(self, model: torch.nn.Module) -> None:
        """`model.to(device)`, the streamed blocks left on the host: what the loader calls once
        every block is placed (`model.to` would pull the streamed ones onto the device)."""
        if not self.streamed:
            model.to(self.device)
            return
        self._move_outside_streamed(model, "")

    def _move_outside_streamed(self, module: torch.nn.Module, path: str) -> None:
        module._apply(lambda tensor: tensor.to(self.device), recurse=False)
        for name, child in module.named_children():
            child_path = path + name
            if child_path in self.streamed:
                continue
            if any(block.startswith(child_path + ".") for block in self.streamed):
                self._move_outside_streamed(child, child_path + ".")
            else:
                child.to(self.device)

    def __str__(self) -> str:
        if not self.streamed:
            return str(self.device)
        return f"{self.device}, the {len(self.streamed)} streamed blocks on the host"


def load_placement(plan, place) -> LoadPlacement:
    """The placement of a load onto `place` (flux2_hooks.quantized_block_device) under `plan` (None:
    no memory plan)."""
    return LoadPlacement(torch.device(place), frozenset(plan.streamed()) if plan is not None else frozenset())


def before_load(base_model, params):
    """The plan from the shapes (None when off or when no budget is known)."""
    kwargs = base_model.model_config.model_kwargs
    if not enabled(kwargs):
        return None
    budget = budget_bytes(kwargs, base_model.device_torch)
    if budget is None:
        print("memory plan: no VRAM figures on this device and no vram_budget_gib: every block resident",
              flush=True)
        return None
    run = getattr(base_model, "memory_plan_run", None) or {"resolution": 1024, "batch": 1, "lora_rank": 32}
    run = {**run, "copies": holds_8bit_copies(base_model.model_config.qtype, kwargs),
           "compiled": block_compile.requested(kwargs)}
    base_model.memory_plan_budget = (budget, run)
    return carried(handed_or_planned(kwargs, params, run, budget), base_model.model_config.qtype, budget)


def carried(plan, qtype: str, budget: int):
    """The plan, or None (every block resident, as without a plan, saying so) where it streams blocks
    of a qtype that streaming does not carry."""
    if not plan.streamed() or qtype in STREAMABLE:
        return plan
    print(f"memory plan: {len(plan.streamed())} blocks would be streamed at a {budget / GIB:.2f} GiB budget, "
          f"but streaming carries only the qtypes {', '.join(STREAMABLE)} (this run: qtype {qtype}): every block "
          f"resident, as without a plan. Set qtype int4_fused in the preset (or run `python -m launcher selftest` "
          f"for qtype auto) to stream.", flush=True)
    return None


def handed_or_planned(kwargs: dict, params, run: dict, budget: int):
    """The plan `run` handed over (model_kwargs launch_plan) where this process finds the budget
    bytes and run shape it was made for, else a plan made here, with a line saying why."""
    text = read(kwargs, "launch_plan")
    if text is None:
        return plan_for(kwargs, params, run, budget)
    found = plan_ask(shape_of(params), budget, run["resolution"], run["batch"], run["lora_rank"], in_flight(kwargs),
                     math_attention(kwargs), run["copies"], run["compiled"])
    try:
        ask, plan = handed(text)
    except ValueError as error:
        print(f"memory plan: {error}: planning again", flush=True)
        return plan_for(kwargs, params, run, budget)
    if ask == found:
        return plan
    print(f"memory plan: {'; '.join(ask_differences(ask, found))} `run` planned for: planning again", flush=True)
    return plan_for(kwargs, params, run, budget)


def hold_copies(transformer, plan) -> list[str]:
    """The plan's 8-bit weight copies, made once the blocks are placed; a line where none could be."""
    from toolkit.int4_linear import hold_block_copies

    if not plan.copies():
        return []
    held = sum(hold_block_copies(transformer.get_submodule(name), count) for name, count in plan.copies().items())
    if not held:
        return ["  8-bit weight copies: none held (no 8-bit GPU kernel runs here: the matmuls requantize)"]
    # a block the plan from the loaded sizes made resident is still on the host here: it holds none
    short = f" of the {size(plan.copy_bytes)} planned" if held < plan.copy_bytes else ""
    return [f"  8-bit weight copies held: {size(held)}{short}"]


def after_load(base_model, transformer, params, plan):
    """Re-plan where the loaded sizes differ from the plan's, stream what the plan says, record it;
    None where the plan from the loaded sizes is not carried (`carried`)."""
    kwargs = base_model.model_config.model_kwargs
    budget, run = base_model.memory_plan_budget
    weights, nonblock = measured(transformer, plan)
    blocks, outside = plan.assumed_sizes()
    if (weights, nonblock) != (blocks, outside):
        changed = sum(1 for name, nbytes in weights.items() if blocks.get(name) != nbytes)
        rest = " and the weights outside them" if nonblock != outside else ""
        print(f"memory plan: {changed} of {len(weights)} loaded blocks{rest} differ from the sizes planned from the "
              f"shapes ({size(sum(weights.values()) + nonblock)} loaded, not {size(sum(blocks.values()) + outside)}): "
              "planning again from the loaded sizes", flush=True)
        plan = carried(plan_for(kwargs, params, run, budget, weight_bytes=weights, nonblock_bytes=nonblock),
                       base_model.model_config.qtype, budget)
        if plan is None:
            return None
    mode = stream_mode(kwargs)
    block_streaming.install(transformer, plan, base_model.device_torch, mode)
    held = hold_copies(transformer, plan)
    for line in plan.summary() + ([f"  stream mode: {mode}"] if plan.streamed() else []) + held:
        print(line, flush=True)
    trainer_telemetry.record_event("memory_plan", memory_plan={**plan.to_json(), "stream_mode": mode})
    if plan.compiled:
        block_compile.when_uncompiled(lambda why: recompute_past_fallback(transformer, plan, why))
    return plan


def recompute_past_fallback(transformer, plan, why: str) -> None:
    """The blocks run uncompiled from now on, and an uncompiled block that keeps its activations holds
    more than the compiled plan counted: the kept blocks past the plan's fallback_kept recompute."""
    demoted = [name for name in plan.kept() if name not in plan.fallback_kept]
    for name in demoted:
        transformer.get_submodule(name).checkpointed = True
    if demoted:
        print(f"memory plan: the blocks run uncompiled ({why}) and hold more each: {len(plan.fallback_kept)} of "
              f"the {len(plan.kept())} kept blocks keep their activations, {compact(demoted)} recompute them "
              "from now on", flush=True)
