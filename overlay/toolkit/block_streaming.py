"""Carry out a memory plan (flux2_contract/memory_plan.py) on a loaded transformer: resident blocks stay
on the device; streamed blocks keep their frozen (already quantized, never bf16) tensors in pinned
host memory (plain memory where pinning is impossible) and are copied onto the device only while
they compute, in the order the step needs them: forward, then recompute + backward in reverse.

The host copies are packed, in block order, into chunks whose sizes are powers of two
(chunk_layout): PyTorch's pinned allocator rounds every request up to a power of two, which cost a
tensor at a time 51-59 % more pinned memory than the streamed bytes (bench/RESULTS.md). On the
device each tensor is still an allocation of its own, copied on its own: a compiled block handed
views into one block-sized buffer sees a new view object at every call (wall 11: `int4_w4a8`
derived its 8-bit weight scales again each time), which made an 8 GB card's step 2.4x slower.

Two modes. `serialized`: synchronize, copy, synchronize, compute: no copy is ever in flight during
a kernel (block swap with overlapping copies deadlocked the HIP driver on Windows: wall 5).
`overlapped`: the next block's copy runs on a side stream while the current block computes, and
at most two streamed blocks (the one computing and the next) are held by the streamer.

A streamed block's class is swapped for a subclass (same name in the state dict, same LoRA keys)
whose forward fetches and releases its tensors and whose `_apply` leaves them where they are, so
a later `transformer.to(device)` by the trainer moves only the resident part. Every streamed block
is recomputed under gradient checkpointing, so the autograd graph never keeps a streamed block's
device tensors beyond its own backward. The FLUX.2 forward reads `block.checkpointed` (patch).

Where a plan streams any block, the resident blocks wear that subclass too (their calls go straight
to the base class): a compiled block forward (toolkit/block_compile.py) guards on its block's type,
and two types per block class compiled each of the class's graphs twice (CPU: 4 graphs per class
instead of 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from toolkit.host_memory import release_freed_memory
from toolkit.int4_w4a8 import carry_scales
from flux2_contract.memory_plan import KEPT, STREAMED, MemoryPlan

SERIALIZED, OVERLAPPED = "serialized", "overlapped"
FORWARD, RECOMPUTE, BACKWARD, FETCH = "forward", "recompute", "backward", "fetch"


@dataclass
class HostSlot:
    """One frozen tensor of a streamed block: where it sits in its module, and its host copy."""
    module: torch.nn.Module
    kind: str  # "_parameters" or "_buffers"
    name: str
    host: torch.Tensor

    def put(self, tensor: torch.Tensor) -> None:
        if self.kind == "_parameters":
            tensor = torch.nn.Parameter(tensor, requires_grad=False)
        getattr(self.module, self.kind)[self.name] = tensor

    def current(self) -> torch.Tensor:
        return getattr(self.module, self.kind)[self.name]


@dataclass
class Held:
    """A streamed block's tensors on the device, and the event its copy ends with (overlapped)."""
    tensors: list
    ready: object = None


@dataclass
class StreamStats:
    bytes_total: int = 0
    bytes_last_step: int = 0
    bytes_this_step: int = 0
    events: list = field(default_factory=list)  # (what, block) when recording (tests)
    record: bool = False


ALIGN = 512  # where each host copy starts: a view of any dtype, aligned for the copy engine as an allocation is
CHUNK = 1 << 30  # four FLUX.2 [dev] single blocks or two double blocks (each just under 256 / 512 MiB)


def chunk_layout(sizes: list, largest: int) -> tuple[list, list]:
    """(chunk sizes, (chunk, offset) of each tensor) for tensors of `sizes` bytes placed in order,
    each at an ALIGN multiple, in the open chunk while they fit. Every chunk is a power of two, so
    the pinned allocator's rounding adds nothing: `largest` while that much is left to place, then
    the largest power of two the rest fills, so the last chunks shrink with it."""
    chunks, places, used = [], [], 0
    remaining = sum(-(-size // ALIGN) * ALIGN for size in sizes)
    for size in sizes:
        size = -(-size // ALIGN) * ALIGN
        if not chunks or used + size > chunks[-1]:
            fill = 1 << (max(remaining, 1).bit_length() - 1)  # the largest power of two <= remaining
            chunks.append(max(min(largest, fill), 1 << (max(size, 1) - 1).bit_length()))
            used = 0
        places.append((len(chunks) - 1, used))
        used += size
        remaining -= size
    return chunks, places


def host_chunk(size: int) -> torch.Tensor:
    """`size` bytes of host memory, pinned where the platform allows (a CPU-only torch cannot pin)."""
    if torch.cuda.is_available():
        try:
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:
            pass
    return torch.empty(size, dtype=torch.uint8)


class BlockStreamer:
    def __init__(self, transformer: torch.nn.Module, plan: MemoryPlan, device, mode: str = SERIALIZED,
                 record: bool = False):
        if mode not in (SERIALIZED, OVERLAPPED):
            raise ValueError(f"stream mode {mode!r}: use {SERIALIZED} or {OVERLAPPED}")
        self.device = torch.device(device)
        self.accelerated = self.device.type == "cuda" and torch.cuda.is_available()
        if self.accelerated and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.mode = mode  # on the CPU both modes copy at once; overlapped still copies one block ahead
        self.stats = StreamStats(record=record)
        self.slots: dict[str, list[HostSlot]] = {}
        self.chunks: list[torch.Tensor] = []
        self.held: dict[str, Held] = {}
        streamed = [b.name for b in plan.blocks if b.weights == STREAMED]
        # the order one step needs them: forward, then recompute + backward in reverse
        self.schedule = streamed + streamed[::-1]
        self.position = -1
        self.side = torch.cuda.Stream(self.device) if self.accelerated and mode == OVERLAPPED else None
        sizes = [tensor.numel() * tensor.element_size() for name in streamed
                 for *_, tensor in frozen_tensors(name, transformer.get_submodule(name))]  # all checked first
        chunk_sizes, places = chunk_layout(sizes, CHUNK)
        places = iter(places)
        for block_plan in plan.blocks:
            block = transformer.get_submodule(block_plan.name)
            if block_plan.weights == STREAMED:
                self._stream(block_plan.name, block, chunk_sizes, places)
                # the copy it was loaded into (plain host memory) is freed: its heap pages go back
                # now, so the host holds the streamed blocks once, not once plain and once pinned
                release_freed_memory(collect=False)
            else:
                block.checkpointed = block_plan.activations != KEPT
        if streamed:  # every planned block, streamed or not, of the one class (module docstring)
            for block_plan in plan.blocks:
                block = transformer.get_submodule(block_plan.name)
                block.__class__ = streamed_class(type(block))
                block._streamer, block._stream_name = self, block_plan.name

    # ---- setting up

    def _stream(self, name: str, block: torch.nn.Module, chunk_sizes: list, places) -> None:
        """Copy the block's frozen tensors into their places in the chunks (chunk_layout) and point
        its modules at those copies."""
        slots = []
        for module, kind, key, tensor in frozen_tensors(name, block):
            chunk, offset = next(places)
            while len(self.chunks) <= chunk:
                self.chunks.append(host_chunk(chunk_sizes[len(self.chunks)]))
            size = tensor.numel() * tensor.element_size()
            host = self.chunks[chunk][offset:offset + size].view(tensor.dtype).view(tensor.shape)
            host.copy_(tensor)
            slots.append(HostSlot(module, kind, key, host))
        self.slots[name] = slots
        for slot in slots:
            slot.put(slot.host)
        block.checkpointed = True

    def streamed_bytes(self) -> int:
        return sum(slot.host.numel() * slot.host.element_size() for slots in self.slots.values() for slot in slots)

    # ---- one block's turn

    def enter(self, name: str) -> str:
        """Before `name` computes: its tensors on the device; the next block's copy started."""
        phase = self._advance(name)
        held = self.held.get(name) or self._fetch(name)
        self._note(phase, name)
        if held.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(held.ready)
            held.ready = None
        for slot, tensor in zip(self.slots[name], held.tensors):
            carry_scales(slot.host, tensor)
            slot.put(tensor)
        self.held = {name: held}
        if self.mode == OVERLAPPED:
            upcoming = self.schedule[(self.position + 1) % len(self.schedule)]
            if upcoming not in self.held:
                self.held[upcoming] = self._fetch(upcoming)
        return phase

    def leave(self, name: str) -> None:
        """After `name` computed: its module slots point at the host again. The device copy lives
        on while autograd needs it, or while it is the next block to compute."""
        for slot in self.slots[name]:
            carry_scales(slot.current(), slot.host)
            slot.put(slot.host)
        upcoming = self.schedule[(self.position + 1) % len(self.schedule)]
        if upcoming != name:
            self.held.pop(name, None)

    def _advance(self, name: str) -> str:
        expected = (self.position + 1) % len(self.schedule)
        if self.schedule[expected] != name:  # a forward without backward (no grad): start over
            expected = self.schedule.index(name)
        if expected == 0:
            self.stats.bytes_last_step, self.stats.bytes_this_step = self.stats.bytes_this_step, 0
        self.position = expected
        return FORWARD if expected < len(self.schedule) // 2 else RECOMPUTE

    def _fetch(self, name: str) -> Held:
        """The block's tensors copied onto the device, each into an allocation of its own (module
        docstring)."""
        self._note(FETCH, name)
        hosts = [slot.host for slot in self.slots[name]]
        size = sum(t.numel() * t.element_size() for t in hosts)
        self.stats.bytes_total += size
        self.stats.bytes_this_step += size
        if not self.accelerated:  # the CPU: a separate tensor copy, so the mechanics still run
            return Held([t.clone() for t in hosts])
        if self.mode == SERIALIZED:
            torch.cuda.synchronize(self.device)
            tensors = [t.to(self.device) for t in hosts]
            torch.cuda.synchronize(self.device)
            return Held(tensors)
        compute = torch.cuda.current_stream(self.device)
        self.side.wait_stream(compute)  # the side stream may reuse memory the compute stream freed
        with torch.cuda.stream(self.side):
            tensors = [t.to(self.device, non_blocking=True) for t in hosts]
            ready = torch.cuda.Event()
            ready.record(self.side)
        for tensor in tensors:
            tensor.record_stream(compute)
        return Held(tensors, ready)

    def _note(self, what: str, name: str) -> None:
        if self.stats.record:
            self.stats.events.append((what, name))

    def note_backward(self, name: str, output) -> None:
        """Record when the gradient reaches `name`'s output (tests of the stream order)."""
        if not self.stats.record:
            return
        first = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(first, torch.Tensor) and first.requires_grad:
            first.register_hook(lambda grad: self._note(BACKWARD, name))


def frozen_tensors(name: str, block: torch.nn.Module) -> list:
    """(module, kind, key, tensor) of every frozen tensor of a block to stream; trainable tensors stay
    where they are. A quantized tensor subclass is refused by name."""
    frozen = [(module, kind, key, tensor) for module in block.modules() for kind in ("_parameters", "_buffers")
              for key, tensor in getattr(module, kind).items()
              if tensor is not None and not tensor.requires_grad]
    for module, _, key, tensor in frozen:
        if type(tensor.data) is not torch.Tensor:
            raise ValueError(
                f"{name}: {type(module).__name__}.{key} is a {type(tensor.data).__name__}; streaming "
                f"carries the plain tensors of qtype int4_fused / int4_w4a8 blocks only. Set qtype "
                f"int4_fused in the preset, or a VRAM budget that keeps every block resident.")
    return frozen


class StreamedBlock:
    """Mixed into the own class of every block of a plan that streams (see streamed_class); a
    resident block's calls go straight to its base class."""

    def forward(self, *args, **kwargs):
        if self._stream_name not in self._streamer.slots:
            return super().forward(*args, **kwargs)
        phase = self._streamer.enter(self._stream_name)
        try:
            output = super().forward(*args, **kwargs)
        finally:
            self._streamer.leave(self._stream_name)
        if phase == RECOMPUTE and torch.is_grad_enabled():
            self._streamer.note_backward(self._stream_name, output)
        return output

    def _apply(self, fn, recurse=True):
        """`.to()`, `.cuda()`, casts: the streamed tensors stay in host memory, the rest moves."""
        slots = self._streamer.slots.get(self._stream_name, ())
        for slot in slots:
            getattr(slot.module, slot.kind)[slot.name] = None
        try:
            return super()._apply(fn, recurse)
        finally:
            for slot in slots:
                slot.put(slot.host)


_classes: dict = {}


def streamed_class(cls: type) -> type:
    if issubclass(cls, StreamedBlock):
        return cls
    if cls not in _classes:
        _classes[cls] = type(cls.__name__, (StreamedBlock, cls), {"__module__": cls.__module__})
    return _classes[cls]


# ---- what the trainer and its telemetry ask

_active: BlockStreamer | None = None


def install(transformer, plan: MemoryPlan, device, mode: str = SERIALIZED, record: bool = False) -> BlockStreamer:
    global _active
    _active = BlockStreamer(transformer, plan, device, mode, record)
    return _active


def telemetry_fields() -> dict:
    """Bytes copied onto the device for the last complete step, and in all (telemetry rows)."""
    if _active is None or not _active.slots:
        return {}
    return {"streamed_bytes_step": _active.stats.bytes_last_step, "streamed_bytes_total": _active.stats.bytes_total}
