"""One memory plan per launch: which transformer blocks stay resident on the training device and
which are streamed from host memory, and which blocks keep their activations instead of
recomputing them (gradient checkpointing).

A pure function of numbers (stdlib only), so the launcher's `run --dry-run` can ask for the same
plan the trainer makes, and tests can check it for any budget without a GPU.

What one step needs on the device (bytes):
- the non-block weights (embedders, modulations, final layer), always resident;
- the LoRA and its optimizer state (weights, gradients, the optimizer's states);
- the input of every block, which gradient checkpointing keeps (batch x tokens x hidden, bf16);
- the working set of the block being recomputed in the backward: its saved tensors and their
  gradients, 2 x `activation_bytes` of one block;
- where only PyTorch's math attention runs on the GPU (model_kwargs sdpa_kernels: math), the
  attention matrices it materialises in the block being computed: MATH_MATRICES x batch x heads x
  tokens^2 fp32 values (the softmax's output, kept for the backward, beside the scores it is made
  from, or beside the gradient made from it); at 1024 px 2 x 48 x 4608^2 x 4 bytes = 8.2 GB;
- each resident block's 4-bit weights; with any block streamed, a double buffer: the two largest
  streamed blocks in flight (one computing, the next being copied; one when serialized); the
  streamed blocks of one size are spread among the resident ones, so a copy overlaps more compute;
- what is left keeps the activations of resident blocks (no recompute), in model order;
- then, for `int4_w4a8`, 8-bit copies of resident blocks' weights (toolkit/int4_linear.Int4Linear.hold_copy), in
  model order: first each block's forward copy (its forward and its recompute skip requantizing the
  4-bit weight), then its input gradient's. A kept activation saves a block's whole recompute, several
  times what the same bytes of copies save (bench/RESULTS.md), so copies come last; and only where
  no block streams (a streamed step waits on the host link, and the cap's slack is the buffers').
  A block that holds both copies multiplies through them alone, so its 4-bit weights are freed
  (`BlockSize.release_bytes`): its input gradient's copy costs the difference, and what that frees
  holds the next block's.

A block's saved activations are computed from the shapes, not measured:
`ACTIVATION_WIDTHS x hidden` bf16 values per token, per block: the tensors autograd saves in one
FLUX.2 block (normed and modulated inputs, qkv, normed q/k, attention output, the MLP's input,
hidden and gated activation, the LoRA inputs), counted from the block's code. A block that keeps
them holds more than the count: FLUX.2 klein 9B and 4B runs at full width that kept most blocks
peaked 18-26 % above their plan per kept block (bench/RESULTS.md, "FLUX.2 klein 9B and 4B through
`launcher run`"), so each kept block is planned at `KEPT_MEASURED` times the count. Compiled
blocks (model_kwargs compile_blocks) hold less: Inductor's partitioner saves fewer tensors and
recomputes the cheap elementwise ones in the backward. FLUX.2 [dev]'s compiled blocks held 0.72
times the count at 512 and at 1024 px (bench/RESULTS.md, "The compiled blocks' activation
estimate"), so a compiled plan counts `KEPT_COMPILED`. A compile that fails falls back to the
uncompiled blocks, which hold the full amount: the plan names the kept blocks that still fit its
bytes then (`fallback_kept`), and the trainer recomputes the others from that moment on
(toolkit/memory_budget.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from .qtypes import IN_REGISTER, has_eight_bit_kernel
from .settings import CATALOGUE, read

GIB = 1024 ** 3
BF16 = 2
# the math attention's matrices are fp32: it computes bf16 inputs in fp32 unless
# torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True) is set (PyTorch 2.5+)
FP32 = 4
MATH_MATRICES = 2
# kept free of the plan (allocator slack) unless the preset says vram_margin_gib
DEFAULT_MARGIN_GIB = CATALOGUE["vram_margin_gib"].default
# bf16 values saved per token and per hidden unit by one FLUX.2 block (double or single) when its
# activations are kept; see the module docstring
ACTIVATION_WIDTHS = 24
# what a block that keeps its activations holds, against the count above (measured, klein at full width)
KEPT_MEASURED = 1.3
# the same for compiled blocks: 0.72 measured ([dev], 512 and 1024 px), with 18 % to spare: the least that
# klein's uncompiled blocks held above the count (klein's compiled ones are not measured)
KEPT_COMPILED = 0.85
# text tokens FLUX.2 [dev] trains with (the Mistral prompt embedding's length)
TEXT_TOKENS = 512
# bytes per trainable LoRA parameter: fp32 weight + fp32 gradient + two 8-bit AdamW states
LORA_BYTES_PER_PARAM = 4 + 4 + 2
RESIDENT, STREAMED = "resident", "streamed"
KEPT, RECOMPUTED = "kept", "recomputed"


class PlanError(ValueError):
    """The budget cannot hold the resident minimum; the message gives every number."""


@dataclass(frozen=True)
class BlockSize:
    name: str
    weight_bytes: int       # the block's 4-bit weights (as they sit on the device)
    activation_bytes: int   # its saved activations for one step when kept
    copy_bytes: int = 0     # one 8-bit copy of its weights (int4_w4a8), 0 where the qtype has none
    release_bytes: int = 0  # its 4-bit weights, freed once it holds both copies


@dataclass(frozen=True)
class PlanInputs:
    budget_bytes: int
    blocks: tuple[BlockSize, ...]
    nonblock_bytes: int     # weights outside the blocks
    lora_bytes: int         # LoRA weights + gradients + optimizer state
    checkpoint_bytes: int   # every block's input, kept by gradient checkpointing
    resolution: int = 0
    batch: int = 1
    in_flight: int = 2      # streamed blocks on the device at once: 2 overlapped, 1 serialized
    attention_bytes: int = 0  # the math attention's matrices (sdpa_kernels: math), else 0
    copies: bool = False    # spend what is left on 8-bit copies of the weights (BlockSize.copy_bytes)
    compiled: bool = False  # the blocks run compiled: a kept block holds KEPT_COMPILED, not KEPT_MEASURED


@dataclass(frozen=True)
class BlockPlan:
    name: str
    weights: str      # RESIDENT or STREAMED
    activations: str  # KEPT or RECOMPUTED
    weight_bytes: int = 0
    copies: int = 0   # 8-bit copies of its weights held: 0, 1 (the forward's) or 2 (and the input gradient's)


@dataclass
class MemoryPlan:
    budget_bytes: int
    blocks: list[BlockPlan]
    fixed_bytes: dict = field(default_factory=dict)
    resident_weight_bytes: int = 0
    streamed_weight_bytes: int = 0
    buffer_bytes: int = 0
    kept_activation_bytes: int = 0
    copy_bytes: int = 0
    released_bytes: int = 0  # the 4-bit weights of the blocks holding both copies, freed
    resolution: int = 0
    batch: int = 1
    compiled: bool = False  # planned for compiled blocks (PlanInputs.compiled)
    fallback_kept: list = field(default_factory=list)  # a compiled plan's kept blocks that fit uncompiled

    def streamed(self) -> list[str]:
        return [b.name for b in self.blocks if b.weights == STREAMED]

    def kept(self) -> list[str]:
        return [b.name for b in self.blocks if b.activations == KEPT]

    def planned_bytes(self) -> int:
        return (sum(self.fixed_bytes.values()) + self.resident_weight_bytes + self.buffer_bytes
                + self.kept_activation_bytes + self.copy_bytes - self.released_bytes)

    def copies(self) -> dict:
        """Block name -> how many 8-bit copies of its weights it holds (1 or 2), for the blocks that hold any."""
        return {b.name: b.copies for b in self.blocks if b.copies}

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "MemoryPlan":
        return cls(**{**data, "blocks": [BlockPlan(**block) for block in data["blocks"]]})

    def assumed_sizes(self) -> tuple[dict, int]:
        """The block and non-block weight bytes the plan was made for (what after_load measures)."""
        return {b.name: b.weight_bytes for b in self.blocks}, self.fixed_bytes.get("non-block weights", 0)

    def summary(self) -> list[str]:
        """Lines for `run --dry-run` and the trainer's log."""
        n = len(self.blocks)
        lines = [
            f"memory plan: budget {size(self.budget_bytes)}, {self.resolution} px, batch {self.batch}; "
            f"planned {size(self.planned_bytes())}",
            "  fixed: " + ", ".join(f"{k} {size(v)}" for k, v in self.fixed_bytes.items()),
            f"  weights: {n - len(self.streamed())} of {n} blocks resident ({size(self.resident_weight_bytes)}), "
            f"{len(self.streamed())} streamed ({size(self.streamed_weight_bytes)} from host memory, "
            f"double buffer {size(self.buffer_bytes)})",
            f"  activations: {len(self.kept())} of {n} blocks kept ({size(self.kept_activation_bytes)}"
            + (f" compiled; {len(self.fallback_kept)} if the blocks run uncompiled" if self.compiled else "")
            + "), the rest recomputed",
        ]
        if self.streamed():
            lines.append("  streamed: " + compact(self.streamed()))
        if self.kept():
            lines.append("  kept: " + compact(self.kept()))
        if self.copies():
            both = [name for name, count in self.copies().items() if count == 2]
            lines.append(f"  8-bit weight copies: {len(self.copies())} of {n} blocks' forward, {len(both)} also the "
                         f"input gradient's ({size(self.copy_bytes)}): " + compact(list(self.copies())))
            if both:
                lines.append(f"  4-bit weights freed: the {len(both)} blocks that hold both copies "
                             f"({size(self.released_bytes)})")
        return lines


def size(nbytes: float) -> str:
    """GiB for model-sized figures, MiB or KiB for small ones (a tiny model's plan)."""
    for unit, scale in (("GiB", GIB), ("MiB", 1024 ** 2)):
        if abs(nbytes) >= 0.1 * scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / 1024:.1f} KiB"


def compact(names: list[str]) -> str:
    """`double_blocks.0`, `double_blocks.1`, ... -> `double_blocks.0-1`."""
    groups: list[list] = []
    for name in names:
        prefix, _, index = name.rpartition(".")
        if index.isdigit() and groups and groups[-1][0] == prefix and groups[-1][2] == int(index) - 1:
            groups[-1][2] = int(index)
        elif index.isdigit():
            groups.append([prefix, int(index), int(index)])
        else:
            groups.append([name, None, None])
    return ", ".join(p if a is None else f"{p}.{a}" + (f"-{b}" if b != a else "") for p, a, b in groups)


def spread_streamed(blocks: tuple[BlockSize, ...], resident: set[str]) -> set[str]:
    """The same number of streamed blocks of each size, spread evenly among the blocks of that size
    and ending on the last: each streamed block's copy then runs while the resident blocks before
    it compute, not while only the one streamed block before it does, and the forward's last
    streamed block is the recompute's first (no copy between them). Equal sizes swap places only,
    so every total of the plan stays what the greedy choice gave."""
    groups: dict[int, list[str]] = {}
    for block in blocks:
        groups.setdefault(block.weight_bytes, []).append(block.name)
    spread = set(resident)
    for names in groups.values():
        count = sum(name not in resident for name in names)
        if count:
            streamed = {names[(i + 1) * len(names) // count - 1] for i in range(count)}
            spread -= streamed
            spread |= set(names) - streamed
    return spread


def make_plan(inputs: PlanInputs) -> MemoryPlan:
    """Resident first, in model order, then the streamed blocks of each size spread among their
    size (spread_streamed); streamed through a double buffer; what is left keeps activations of
    resident blocks (at the compiled blocks' estimate where inputs.compiled, the ones that fit it
    uncompiled as fallback_kept), then (inputs.copies) holds 8-bit copies of their weights, every
    forward copy before any input gradient's, a block's 4-bit weights freed once it holds both.
    Raises PlanError when even the minimum does not fit."""
    blocks = inputs.blocks
    working = 2 * max((b.activation_bytes for b in blocks), default=0)
    fixed = {"non-block weights": inputs.nonblock_bytes, "LoRA + optimizer": inputs.lora_bytes,
             "checkpointed inputs": inputs.checkpoint_bytes, "one block in backward": working}
    if inputs.attention_bytes:
        fixed["math attention matrices"] = inputs.attention_bytes
    free = inputs.budget_bytes - sum(fixed.values())
    buffer = 0
    if sum(b.weight_bytes for b in blocks) <= free:
        resident = {b.name for b in blocks}
    else:
        buffer = inputs.in_flight * max(b.weight_bytes for b in blocks)
        if free < buffer:
            raise PlanError(minimum_message(inputs, fixed, buffer))
        room = free - buffer
        resident = set()
        for block in blocks:
            if block.weight_bytes <= room:
                resident.add(block.name)
                room -= block.weight_bytes
        resident = spread_streamed(blocks, resident)
        # the buffer only needs the largest streamed blocks
        buffer = inputs.in_flight * max(b.weight_bytes for b in blocks if b.name not in resident)
    free -= buffer + sum(b.weight_bytes for b in blocks if b.name in resident)
    kept, kept_bytes = set(), 0
    for block in blocks:
        held = int(block.activation_bytes * (KEPT_COMPILED if inputs.compiled else KEPT_MEASURED))
        if block.name in resident and held <= free:
            kept.add(block.name)
            kept_bytes += held
            free -= held
    # the first kept blocks, in model order: a compile fails at a class's first call, when the later ones have not run
    fallback, room = [], kept_bytes
    for block in (b for b in blocks if inputs.compiled and b.name in kept):
        held = int(block.activation_bytes * KEPT_MEASURED)
        if held > room:
            break
        fallback.append(block.name)
        room -= held
    copies = {b.name: 0 for b in blocks}
    released = 0
    if inputs.copies and len(resident) == len(blocks):
        for orientation in ("forward", "input gradient"):
            for block in blocks:
                # the whole copy must fit: it is made before the 4-bit weights it replaces are freed
                if block.name in resident and 0 < block.copy_bytes <= free:
                    copies[block.name] += 1
                    free -= block.copy_bytes
                    if orientation == "input gradient":
                        free += block.release_bytes
                        released += block.release_bytes
    return MemoryPlan(
        budget_bytes=inputs.budget_bytes,
        blocks=[BlockPlan(b.name, RESIDENT if b.name in resident else STREAMED,
                          KEPT if b.name in kept else RECOMPUTED, b.weight_bytes, copies[b.name]) for b in blocks],
        fixed_bytes=fixed,
        resident_weight_bytes=sum(b.weight_bytes for b in blocks if b.name in resident),
        streamed_weight_bytes=sum(b.weight_bytes for b in blocks if b.name not in resident),
        buffer_bytes=buffer, kept_activation_bytes=kept_bytes,
        copy_bytes=sum(copies[b.name] * b.copy_bytes for b in blocks), released_bytes=released,
        resolution=inputs.resolution, batch=inputs.batch, compiled=inputs.compiled, fallback_kept=fallback,
    )


def minimum_message(inputs: PlanInputs, fixed: dict, buffer: int) -> str:
    need = sum(fixed.values()) + buffer
    parts = ", ".join(f"{k} {size(v)}" for k, v in fixed.items())
    return (f"a VRAM budget of {size(inputs.budget_bytes)} cannot hold the resident minimum of "
            f"{size(need)} at {inputs.resolution} px, batch {inputs.batch} ({parts}, "
            f"{inputs.in_flight} streamed block(s) in flight {size(buffer)}). Lower the resolution or the "
            f"LoRA rank, or give more VRAM (model_kwargs vram_budget_gib / vram_margin_gib in the preset).")


# ---------------------------------------------------------------- sizes from the FLUX.2 shapes


@dataclass(frozen=True)
class Flux2Shape:
    hidden: int = 6144
    heads: int = 48
    depth: int = 8
    depth_single: int = 48
    mlp_ratio: float = 3.0
    context_in_dim: int = 15360
    in_channels: int = 128

    @classmethod
    def from_params(cls, params: dict) -> "Flux2Shape":
        names = {"hidden_size": "hidden", "num_heads": "heads", "depth": "depth",
                 "depth_single_blocks": "depth_single", "mlp_ratio": "mlp_ratio",
                 "context_in_dim": "context_in_dim", "in_channels": "in_channels"}
        return cls(**{ours: params[theirs] for theirs, ours in names.items() if theirs in params})


def int4_bytes(in_features: int, out_features: int, group_size: int = 64) -> int:
    """A 4-bit Linear: packed codes + a bf16 scale and a uint8 zero per group of the row."""
    return out_features * in_features // 2 + out_features * (in_features // group_size) * (BF16 + 1)


def copy_bytes(in_features: int, out_features: int) -> int:
    """One 8-bit copy of a Linear's weight (toolkit/int4_linear.Int4Linear.hold_copy): a byte per weight; its
    inner width padded to 128 (int4_w4a8.K_ALIGN) adds none at FLUX.2's widths."""
    return in_features * out_features


def block_linears(shape: Flux2Shape) -> tuple[list, list]:
    """(in, out) of every Linear of one double-stream block and of one single-stream block."""
    h, mlp = shape.hidden, int(shape.hidden * shape.mlp_ratio)
    stream = [(h, 3 * h), (h, h), (h, 2 * mlp), (mlp, h)]  # qkv, proj, mlp in (gated), mlp out
    return stream * 2, [(h, 3 * h + 2 * mlp), (h + mlp, h)]


def nonblock_linears(shape: Flux2Shape) -> list:
    """(in, out) of the Linears outside the blocks, 4-bit like the blocks (the quantizer's extras):
    img_in, time_in and guidance_in (2 each), txt_in, the three modulations, the final layer (2)."""
    h = shape.hidden
    return [(shape.in_channels, h), (256, h), (h, h), (256, h), (h, h), (shape.context_in_dim, h),
            (h, 6 * h), (h, 6 * h), (h, 3 * h), (h, shape.in_channels), (h, 2 * h)]


def tokens(resolution: int) -> int:
    """Image tokens of a square latent (VAE /8, 2x2 patches: /16 per side) + the text tokens."""
    return (resolution // 16) ** 2 + TEXT_TOKENS


def flux2_inputs(shape: Flux2Shape, budget_bytes: int, resolution: int, batch: int = 1,
                 lora_rank: int = 32, group_size: int = 64, nonblock_bytes: int | None = None,
                 weight_bytes: dict | None = None, in_flight: int = 2, math_attention: bool = False,
                 copies: bool = False, compiled: bool = False) -> PlanInputs:
    """Plan inputs from the shapes; `weight_bytes` (name -> bytes, measured on the loaded model)
    and `nonblock_bytes` replace the estimates when given; `math_attention`: only the math
    attention runs (sdpa_kernels: math); `copies`: the qtype multiplies through 8-bit copies of the
    weights (holds_8bit_copies), which what is left of the budget may hold; `compiled`: the blocks run
    compiled (model_kwargs compile_blocks)."""
    double, single = block_linears(shape)
    seq = batch * tokens(resolution)
    activation = seq * shape.hidden * ACTIVATION_WIDTHS * BF16
    blocks = []
    for prefix, count, linears in (("double_blocks", shape.depth, double),
                                   ("single_blocks", shape.depth_single, single)):
        estimate = sum(int4_bytes(i, o, group_size) for i, o in linears)
        copy = sum(copy_bytes(i, o) for i, o in linears) if copies else 0
        for index in range(count):
            name = f"{prefix}.{index}"
            weight = (weight_bytes or {}).get(name, estimate)
            blocks.append(BlockSize(name, weight, activation, copy, min(weight, estimate) if copies else 0))
    lora_params = lora_rank * (shape.depth * sum(i + o for i, o in double)
                               + shape.depth_single * sum(i + o for i, o in single))
    if nonblock_bytes is None:
        nonblock_bytes = sum(int4_bytes(i, o, group_size) for i, o in nonblock_linears(shape))
    return PlanInputs(
        budget_bytes=budget_bytes, blocks=tuple(blocks), nonblock_bytes=nonblock_bytes,
        lora_bytes=lora_params * LORA_BYTES_PER_PARAM,
        checkpoint_bytes=len(blocks) * seq * shape.hidden * BF16,
        resolution=resolution, batch=batch, in_flight=in_flight,
        attention_bytes=MATH_MATRICES * batch * shape.heads * tokens(resolution) ** 2 * FP32 if math_attention else 0,
        copies=copies, compiled=compiled,
    )


def holds_8bit_copies(qtype: str, model_kwargs: dict) -> bool:
    """Whether a plan may spend what it leaves on 8-bit copies of qtype's weights: an 8-bit qtype
    whose forward requantizes the 4-bit weight (every GEMM but in_register), with model_kwargs
    hold_8bit_copies true (settings resolved by `run`)."""
    return (has_eight_bit_kernel(qtype) and read(model_kwargs, "hold_8bit_copies")
            and read(model_kwargs, "w4a8_gemm") != IN_REGISTER)


def budget_bytes_of(budget_gib: float, margin_gib: float) -> int:
    """The bytes a plan may use under a preset's budget, rounded as the trainer rounds them
    (toolkit/memory_budget.py budget_bytes, where nothing else holds VRAM)."""
    return int(float(budget_gib) * GIB) - int(float(margin_gib) * GIB)


def plan_for_budget(budget_gib: float, resolution: int, batch: int = 1, rank: int = 32, in_flight: int = 2,
                    flux2_params: dict | None = None, margin_gib: float = DEFAULT_MARGIN_GIB,
                    math_attention: bool = False, copies: bool = False, compiled: bool = False) -> MemoryPlan:
    """The plan from the shapes for a budget in GiB (what `run --dry-run` shows); PlanError when the
    budget cannot hold the resident minimum."""
    shape = Flux2Shape.from_params(flux2_params or {})
    return make_plan(flux2_inputs(shape, budget_bytes_of(budget_gib, margin_gib), resolution, batch, rank,
                                  in_flight=in_flight, math_attention=math_attention, copies=copies,
                                  compiled=compiled))


# ---------------------------------------------------------------- the plan `run` hands the trainer


def plan_ask(shape: Flux2Shape, budget_bytes: int, resolution: int, batch: int, lora_rank: int,
             in_flight: int, math_attention: bool = False, copies: bool = False, compiled: bool = False) -> dict:
    """Everything a plan from the shapes is made of, besides the planner's own constants: two equal
    asks get the same plan. `run` hands its ask with its plan; the trainer compares its own."""
    return {"budget_bytes": int(budget_bytes), "resolution": int(resolution), "batch": int(batch),
            "lora_rank": int(lora_rank), "in_flight": int(in_flight), "math_attention": bool(math_attention),
            "copies": bool(copies), "compiled": bool(compiled), "shape": asdict(shape)}


def ask_for_budget(budget_gib: float, resolution: int, batch: int = 1, rank: int = 32, in_flight: int = 2,
                   flux2_params: dict | None = None, margin_gib: float = DEFAULT_MARGIN_GIB,
                   math_attention: bool = False, copies: bool = False, compiled: bool = False) -> dict:
    """The ask of plan_for_budget with the same arguments."""
    return plan_ask(Flux2Shape.from_params(flux2_params or {}), budget_bytes_of(budget_gib, margin_gib),
                    resolution, batch, rank, in_flight, math_attention, copies, compiled)


def hand_over(ask: dict, plan: MemoryPlan) -> str:
    """model_kwargs launch_plan: the plan and its ask as one line of JSON."""
    return json.dumps({"ask": ask, "plan": plan.to_json()}, separators=(",", ":"), sort_keys=True)


def handed(text: str) -> tuple[dict, MemoryPlan]:
    """The ask and plan of a model_kwargs launch_plan; ValueError naming what is wrong."""
    try:
        data = json.loads(text)
        return data["ask"], MemoryPlan.from_json(data["plan"])
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"model_kwargs launch_plan is not a plan `python -m launcher run` wrote ({error!r})") from None


def ask_differences(planned: dict, found: dict) -> list[str]:
    """How the ask the trainer finds differs from the one `run` planned for, in words."""
    words = []
    for key in [*found, *(key for key in planned if key not in found)]:
        was, now = planned.get(key), found.get(key)
        if was == now:
            continue
        if key == "budget_bytes" and isinstance(was, int) and isinstance(now, int):
            shown = (size(now), size(was)) if size(now) != size(was) else (f"{now:,} bytes", f"{was:,}")
            words.append(f"{shown[0]} found, not the {shown[1]}")
        elif key == "shape" and isinstance(was, dict) and isinstance(now, dict):
            words += [f"{name} {now.get(name)} found, not the {was.get(name)}"
                      for name in sorted(was.keys() | now.keys()) if was.get(name) != now.get(name)]
        else:
            words.append(f"{key} {now} found, not the {was}")
    return words


def main(argv: list[str] | None = None) -> int:
    """`python -m flux2_contract.memory_plan --budget-gib G [--margin-gib M] --resolution R [--batch B]
    [--rank N] [--in-flight 1|2] [--flux2-params JSON] [--copies] [--compiled]`: print the plan as JSON."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m flux2_contract.memory_plan")
    parser.add_argument("--budget-gib", type=float, required=True)
    parser.add_argument("--margin-gib", type=float, default=DEFAULT_MARGIN_GIB)
    parser.add_argument("--resolution", type=int, required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--in-flight", type=int, choices=(1, 2), default=2)
    parser.add_argument("--flux2-params", default="{}")
    parser.add_argument("--copies", action="store_true", help="int4_w4a8: hold 8-bit weight copies with what is left")
    parser.add_argument("--compiled", action="store_true", help="the blocks run compiled (compile_blocks: true)")
    args = parser.parse_args(argv)
    try:
        plan = plan_for_budget(args.budget_gib, args.resolution, args.batch, args.rank, args.in_flight,
                               json.loads(args.flux2_params), args.margin_gib, copies=args.copies,
                               compiled=args.compiled)
    except PlanError as error:
        print(json.dumps({"error": str(error)}))
        return 2
    print(json.dumps({"plan": plan.to_json(), "summary": plan.summary()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
