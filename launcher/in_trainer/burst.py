"""The rescue process: sustained large GEMMs for a set time, then one JSON line with its rate.

docs/recipe.md, "The stall": a FRESH process running 6144x6144 @ 6144x18432 bf16 matmuls, synchronised
each iteration, for ~25 s flips a stalled card back to full speed; small keep-warm work and
allocations do nothing, a long-lived rescuer degrades, and about half of fresh processes start
degraded. So each burst is its own process and measures its own TFLOP/s; the watchdog calls a
result below its threshold a dud and starts another at once.

Run it with the trainer's interpreter (it needs torch), from the folder above the package:
    python -m launcher.in_trainer.burst --seconds 25 --device cuda
It prints exactly one JSON line on stdout: {"ok": true, "tflops": ..., "iterations": ..., ...};
on failure {"ok": false, "error": "..."} and exit code 1. Memory: m*k + k*n + m*n elements
(~0.6 GB in bf16 at the default sizes).

On a CPU bf16 matmul is emulated and very slow in many builds, so `--dtype auto` uses float32
there (tests run it on a CPU at tiny sizes); on a GPU it uses bf16, like the recipe.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m launcher.in_trainer.burst", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=25.0, help="measured run time (default %(default)s)")
    parser.add_argument("--device", default="cuda", help="torch device, e.g. cuda, cuda:1, cpu (default %(default)s)")
    parser.add_argument("--m", type=int, default=6144)
    parser.add_argument("--k", type=int, default=6144)
    parser.add_argument("--n", type=int, default=18432)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                        help="auto: bf16 on a GPU, fp32 on a CPU (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations first (default %(default)s)")
    return parser.parse_args(argv)


def run_burst(seconds: float, device: str, m: int, k: int, n: int, dtype: str = "auto", warmup: int = 2) -> dict:
    """Multiply until `seconds` have passed (at least one timed iteration); return the result."""
    import torch

    target = torch.device(device)
    if dtype == "auto":
        dtype = "fp32" if target.type == "cpu" else "bf16"
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]

    def sync() -> None:
        if target.type == "cuda":
            torch.cuda.synchronize(target)

    started = time.perf_counter()
    a = torch.randn(m, k, device=target, dtype=torch_dtype)
    b = torch.randn(k, n, device=target, dtype=torch_dtype)
    out = torch.empty(m, n, device=target, dtype=torch_dtype)
    for _ in range(warmup):
        torch.matmul(a, b, out=out)
        sync()
    iterations = 0
    timed_from = time.perf_counter()
    elapsed = 0.0
    while iterations == 0 or elapsed < seconds:
        torch.matmul(a, b, out=out)
        sync()  # each iteration must finish: the card has to stay busy, not queue work
        iterations += 1
        elapsed = time.perf_counter() - timed_from
    tflops = 2.0 * m * k * n * iterations / elapsed / 1e12
    return {
        "ok": True, "tflops": round(tflops, 6), "iterations": iterations, "seconds": round(elapsed, 3),
        "startup_s": round(timed_from - started, 3), "device": str(target), "dtype": dtype,
        "m": m, "k": k, "n": n, "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = run_burst(args.seconds, args.device, args.m, args.k, args.n, args.dtype, args.warmup)
    except Exception as error:  # report every failure as the one JSON line the watchdog reads
        print(json.dumps({"ok": False, "error": f"{type(error).__name__}: {error}"}), flush=True)
        return 1
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
