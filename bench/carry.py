#!/usr/bin/env python3
"""Copy the few patched-trainer files the GPU benches import into .bench-carry/trainer.

A GPU machine that gets only this repository's working tree needs these files next to it;
.bench-carry/ is ignored by git (.git/info/exclude): copy it along, never commit it.

    python -m bench.carry --trainer W/trainer [--dest .bench-carry/trainer]
"""

import argparse
import shutil
import sys
from pathlib import Path

FLUX2_SRC = Path("extensions_built_in/diffusion_models/flux2/src")
# everything bench/_trainer.py imports from the trainer on the GPU machine; the contract package these
# modules import (flux2_contract/) travels with the repository's working tree itself
CARRY_FILES = [
    FLUX2_SRC / "model.py",
    FLUX2_SRC / "sampling.py",
    Path("toolkit/__init__.py"),
    Path("toolkit/print.py"),
    Path("toolkit/util/quantize.py"),
    Path("toolkit/dequantize.py"),
    Path("toolkit/quantized_cache.py"),
    Path("toolkit/streamed_safetensors.py"),
    Path("toolkit/int4_linear.py"),  # qtype int4_fused (quantize.py and quantized_cache.py import it)
    Path("toolkit/staged_load.py"),  # the cache's bounded-staging reader
    Path("toolkit/host_memory.py"),
    Path("toolkit/int4_w4a8.py"),  # qtype int4_w4a8 (Int4Linear imports it in 8-bit mode)
    Path("toolkit/int4_kernels.py"),  # the 4-bit format and kernels (int4_linear.py imports them)
    Path("toolkit/qcache_format.py"),
    Path("toolkit/qcache_codecs.py"),
    Path("toolkit/qcache_rebuild.py"),
    Path("toolkit/block_compile.py"),  # compiled blocks (bench/compile_time.py)
    Path("toolkit/block_streaming.py"),  # streamed blocks (block_compile.py imports it)
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trainer", required=True, type=Path)
    p.add_argument("--dest", type=Path, default=Path(".bench-carry/trainer"))
    args = p.parse_args()
    if args.dest.exists():
        shutil.rmtree(args.dest)
    for rel in CARRY_FILES:
        s = args.trainer / rel
        if not s.is_file():
            print(f"missing in the trainer checkout: {rel}", file=sys.stderr)
            return 1
        d = args.dest / rel
        d.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(s, d)
    head = (args.trainer / ".git").exists()
    if head:
        import subprocess
        rev = subprocess.run(["git", "-C", str(args.trainer), "rev-parse", "HEAD"], capture_output=True,
                             text=True).stdout.strip()
        (args.dest / "COMMIT").write_text(rev + "\n")
    print(f"copied {len(CARRY_FILES)} files to {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
