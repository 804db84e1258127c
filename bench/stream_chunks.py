"""Streamed blocks' host copies packed into power-of-two chunks (toolkit/block_streaming.py) against
one pinned tensor per frozen tensor (the layout before), one GPU.

`--blocks` FLUX.2 4-bit blocks of `--arch`'s shape (each Linear's Int4Linear buffers, random codes,
and the q/k norms), half double and half single, streamed by the
streamer itself: the pinned host memory each layout costs (the process's shared-memory RSS, where
CUDA's pinned pages show, and torch's pinned-allocator count), and the milliseconds of a forward
pass over every block, serialized and overlapped, each block's compute a GPU sleep of `--compute-ms`
(so overlapped, a pass takes the longer of copies and compute; serialized, their sum). The layout
before is the same streamer with each slot's host copy swapped for a pinned tensor of its own.
5 passes after one. `--align` and `--chunk-mib` change the packed layout's alignment and largest
chunk (what the streamer's ALIGN and CHUNK were chosen against). One JSON line on stdout.

  python3 -m bench.stream_chunks [--arch flux2] [--blocks 8] [--compute-ms 8] [--align 512] [--chunk-mib 1024]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def shared_rss_bytes() -> int:
    """RssShmem of this process: pinned (page-locked) host memory shows there on Linux."""
    for line in Path("/proc/self/status").read_text(encoding="utf-8").splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    return 0


def pinned_count() -> int:
    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    return stats.get("allocated_bytes.current", 0)


def block_tensors(int4_linear, memory_plan, shape, double: bool) -> list:
    """One 4-bit block's frozen tensors in module order: each Linear's buffers (an Int4Linear's, its
    codes random), then the bf16 q/k norms."""
    tensors = []
    for inputs, outputs in memory_plan.block_linears(shape)[0 if double else 1]:
        linear = int4_linear.Int4Linear(inputs, outputs)
        linear.qweight.random_(0, 256)
        tensors += list(linear.buffers())
    return tensors + [torch.ones(shape.hidden // shape.heads, dtype=torch.bfloat16)] * (4 if double else 2)


class Block(torch.nn.Module):
    """Frozen tensors as buffers; the forward keeps the GPU busy for `cycles` without touching memory."""

    def __init__(self, tensors, cycles: int):
        super().__init__()
        self.cycles = cycles
        for i, tensor in enumerate(tensors):
            self.register_buffer(f"t{i}", tensor)

    def forward(self, x):
        torch.cuda._sleep(self.cycles)
        return x


def sleep_cycles(ms: float) -> int:
    """GPU clock cycles that torch.cuda._sleep spends in `ms` milliseconds, measured."""
    torch.cuda.synchronize()
    began = time.perf_counter()
    torch.cuda._sleep(10_000_000)
    torch.cuda.synchronize()
    return int(10_000_000 * ms / ((time.perf_counter() - began) * 1e3))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="flux2")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--compute-ms", type=float, default=8.0)
    parser.add_argument("--align", type=int, help="bytes each packed host copy starts at a multiple of "
                        "(default: the streamer's ALIGN)")
    parser.add_argument("--chunk-mib", type=int, help="the largest chunk (default: the streamer's CHUNK)")
    args = parser.parse_args(argv)
    sys.path[:0] = [str(REPO / "overlay"), str(REPO)]
    from toolkit import block_streaming, int4_linear
    block_streaming.ALIGN = args.align or block_streaming.ALIGN
    block_streaming.CHUNK = (args.chunk_mib << 20) if args.chunk_mib else block_streaming.CHUNK
    from flux2_contract import memory_plan
    from flux2_contract.families import FAMILIES

    shape = memory_plan.Flux2Shape.from_params(FAMILIES[args.arch].shape)
    torch.cuda.init()
    cycles = sleep_cycles(args.compute_ms)
    x = torch.zeros(1, device="cuda")
    row = {"device": torch.cuda.get_device_name(), "arch": args.arch, "blocks": args.blocks,
           "compute_ms": args.compute_ms, "align": block_streaming.ALIGN,
           "chunk_mib": block_streaming.CHUNK >> 20}
    for mode in (block_streaming.SERIALIZED, block_streaming.OVERLAPPED):
        model = torch.nn.Module()
        model.blocks = torch.nn.ModuleList(
            Block(block_tensors(int4_linear, memory_plan, shape, i < args.blocks // 2), cycles)
            for i in range(args.blocks))
        payload = sum(t.numel() * t.element_size() for t in model.buffers())
        row["streamed_gib"] = round(payload / 2**30, 3)
        plan = memory_plan.MemoryPlan(budget_bytes=0, blocks=[
            memory_plan.BlockPlan(f"blocks.{i}", memory_plan.STREAMED, memory_plan.RECOMPUTED)
            for i in range(args.blocks)])
        # pinned memory is measured in the first mode only: the second reuses the pages the allocator
        # cached from the first, and would show none
        first = mode == block_streaming.SERIALIZED
        shm, counted = shared_rss_bytes(), pinned_count()
        streamer = block_streaming.BlockStreamer(model, plan, "cuda", mode)
        if first:
            row["packed_pinned_rss_gib"] = round((shared_rss_bytes() - shm) / 2**30, 3)
            row["packed_pinned_counted_gib"] = round((pinned_count() - counted) / 2**30, 3)
            row["chunks_mib"] = [chunk.numel() >> 20 for chunk in streamer.chunks]
        for layout in ("packed", "per_tensor"):
            if layout == "per_tensor":  # the layout before: a pinned tensor per slot
                shm, counted = shared_rss_bytes(), pinned_count()
                for slots in streamer.slots.values():
                    for slot in slots:
                        slot.host = slot.host.clone().pin_memory()
                        slot.put(slot.host)
                if first:
                    row["per_tensor_pinned_rss_gib"] = round((shared_rss_bytes() - shm) / 2**30, 3)
                    row["per_tensor_pinned_counted_gib"] = round((pinned_count() - counted) / 2**30, 3)
            with torch.no_grad():
                passes = []
                for _ in range(6):
                    torch.cuda.synchronize()
                    began = time.perf_counter()
                    for block in model.blocks:
                        block(x)
                    torch.cuda.synchronize()
                    passes.append(time.perf_counter() - began)
            row[f"{mode}_{layout}_pass_ms"] = round(sorted(passes[1:])[2] * 1e3, 1)
        del streamer, model
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
