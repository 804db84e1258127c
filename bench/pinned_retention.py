#!/usr/bin/env python3
"""Host RAM kept after quantized blocks went GPU -> host -> GPU: non-blocking vs blocking copies.

The fork's quantize_transformer_block parked each block with block.to("cpu", non_blocking=True).
From a CUDA tensor that copy lands in pinned host memory, which torch's host allocator caches
(rounded up to a power of two) and does not return when the tensor dies. A first launch with
qtype int4_fused (Int4Linear: plain tensor buffers) kept ~30 GiB of host RSS for the whole
training, a launch from the cache ~6 GiB. Here, one child process per variant:

  quantize FLUX.2-shaped Linears on the GPU with the trainer's quantize_transformer_block
  (placed on the GPU), copy every block to the host (the copy under test), move it back to
  the GPU, and report host RSS, the host allocator's cached pinned bytes, and RSS after
  gc + malloc_trim (toolkit/host_memory.release_freed_memory).

    python -m bench.pinned_retention --trainer .bench-carry/trainer --gib 4 --out pinned.json
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = "int4_fused:1,int4_fused:0,uint4:1,uint4:0"  # qtype:non_blocking


def child(trainer: Path, qtype: str, non_blocking: bool, gib: float) -> dict:
    import torch

    from bench import _trainer as T

    tr = T.Trainer(trainer)
    from toolkit.host_memory import release_freed_memory

    q = tr.quantize
    stub = T.BaseModelStub("cuda", qtype=qtype)
    qt = q.get_qtype(qtype)
    hidden = 6144
    blocks = []
    stored = 0
    base = T.proc_status()["VmRSS"]
    while stored < gib * T.GiB:  # an MLP pair of FLUX.2 [dev]'s single block width
        block = torch.nn.Sequential(torch.nn.Linear(hidden, 3 * hidden, bias=False),
                                    torch.nn.Linear(3 * hidden, hidden, bias=False)).to("cuda", torch.bfloat16)
        q.quantize_transformer_block(stub, block, qt, torch.device("cuda"), name=f"b{len(blocks)}", place="cuda")
        block.to("cpu", non_blocking=non_blocking)  # the copy under test
        torch.cuda.synchronize()
        stored += sum(t.numel() * t.element_size() for t in block.state_dict().values())
        blocks.append(block)
    parked = T.proc_status()["VmRSS"]
    for block in blocks:
        block.to("cuda")
    torch.cuda.synchronize()
    import gc

    gc.collect()
    moved = T.proc_status()["VmRSS"]
    cached = torch.cuda.host_memory_stats().get("reserved_bytes.current", None)
    release_freed_memory()
    trimmed = T.proc_status()["VmRSS"]
    return {"qtype": qtype, "non_blocking": non_blocking, "quantized_gib": stored / T.GiB,
            "parked_gib": (parked - base) / T.GiB, "after_move_gib": (moved - base) / T.GiB,
            "pinned_cached_gib": None if cached is None else cached / T.GiB,
            "after_trim_gib": (trimmed - base) / T.GiB}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trainer", required=True, type=Path)
    p.add_argument("--gib", type=float, default=4.0, help="quantized weights per variant")
    p.add_argument("--variants", default=VARIANTS, help="qtype:non_blocking (1/0), comma-separated")
    p.add_argument("--out", type=Path)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.trainer, args.child[0], args.child[1] == "1", args.gib)), flush=True)
        return 0
    rows = []
    for variant in args.variants.split(","):
        qtype, non_blocking = variant.split(":")
        done = subprocess.run([sys.executable, "-m", "bench.pinned_retention", "--trainer", str(args.trainer),
                               "--gib", str(args.gib), "--child", qtype, non_blocking],
                              capture_output=True, text=True, cwd=REPO)
        if done.returncode:
            print(done.stdout[-2000:], done.stderr[-3000:], file=sys.stderr)
            return 1
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
