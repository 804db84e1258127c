#!/usr/bin/env python3
"""Seconds to compile FLUX.2's block classes at full width (model_kwargs compile_blocks), cold and
warm, the graphs each class gets, and the compiled step against the uncompiled one.

The blocks are FLUX.2 [dev]'s (the trainer's own Flux2Params: hidden 6144, 48 heads, mlp_ratio
3), --double and --single of each class (8: were a graph compiled per block, a class would show 8),
with random 4-bit weights in the trainer's Int4Linear, a LoRA (rank 32, fp32 as the trainer's
network) on every block Linear, the model's gradient checkpointing, and, with --plan stream (the
default), a memory plan as a 24 GB card's at 512 px has it: every other block streamed from host
memory, the first double block's activations kept. A step is a forward and backward at 512 px
(1024 image tokens, 512 text tokens).

Per qtype (--qtypes, each `QTYPE[:GEMM]`), two child processes share fresh TORCHINDUCTOR_CACHE_DIR
and TRITON_CACHE_DIR folders: the first compiles cold, the second warm. Each child takes an
uncompiled warm-up step (Triton's 4-bit kernels compile and tune), --steps timed uncompiled steps,
then a one-kernel function compiled alone (the start a process pays once, on its first compile:
Inductor's imports, its compile workers, the first Triton kernel; the trainer's first block class
pays it), then toolkit/block_compile.compile_blocks, the first compiled step and --steps timed
compiled ones. Every line toolkit/block_compile prints is written as it comes; then one line per
class (seconds compiling, graphs) and one for the child's steps. A child still running when --budget is spent is
stopped, with a line that says so, and the qtypes after it are skipped the same way.

    python3 -m bench.compile_time --trainer .bench-carry/trainer --out OUT/compile_time.jsonl   (GPU)
    W/venv/bin/python -m bench.compile_time --trainer W/trainer --tiny --out t.jsonl          (CPU)
"""

import argparse
import json
import logging
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench._children import fresh_compile_caches, run_within

QTYPES = "int4_w4a8:scaled_mm,int4_fused"
RESOLUTION, TEXT_TOKENS = 512, 512
TINY_RESOLUTION, TINY_TEXT_TOKENS = 64, 8
SHORTEST_CHILD_S = 30  # less left than this: a child could not even build its model


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trainer", required=True, type=Path, help="a trainer checkout, or .bench-carry/trainer")
    p.add_argument("--out", required=True, type=Path, help="JSON lines, one per measurement")
    p.add_argument("--qtypes", default=QTYPES, help=f"comma list of QTYPE[:GEMM] (default {QTYPES})")
    p.add_argument("--double", type=int, default=8, help="double-stream blocks")
    p.add_argument("--single", type=int, default=8, help="single-stream blocks")
    p.add_argument("--plan", choices=("stream", "resident"), default="stream",
                   help="stream: every other block streamed, the first block kept; resident: no memory plan")
    p.add_argument("--steps", type=int, default=5, help="timed steps, uncompiled and compiled")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run, children included")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (a quick dry run: aot_eager)")
    p.add_argument("--tiny", action="store_true", help="the bench's tiny Flux2Params, 64 px (CPU dry run)")
    p.add_argument("--child", choices=("cold", "warm"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def write_row(out: Path, row: dict) -> None:
    with open(out, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


# ---------------------------------------------------------------- the parent: children per qtype and cache


def main(argv=None) -> int:
    args = parse(argv)
    if args.child:
        return child(args)
    deadline = time.monotonic() + args.budget
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("", encoding="utf-8")
    failed = False
    for spec in args.qtypes.split(","):
        with tempfile.TemporaryDirectory(prefix="compile-time-") as caches:
            env = fresh_compile_caches(Path(caches))
            for cache in ("cold", "warm"):
                failed |= not run_child(args, spec, cache, env, deadline - time.monotonic())
    return 1 if failed else 0


def run_child(args, spec: str, cache: str, env: dict, left: float) -> bool:
    """One child, stopped (its process group) once `left` seconds are spent; whether it finished."""
    where = {"qtype": spec, "cache": cache}
    if left < SHORTEST_CHILD_S:
        write_row(args.out, {"measure": "skipped", **where, "reason": f"{max(left, 0):.0f} s of the budget left"})
        return True
    argv = [sys.executable, "-m", "bench.compile_time", "--trainer", str(args.trainer.resolve()),
            "--out", str(args.out.resolve()), "--qtypes", spec, "--double", str(args.double),
            "--single", str(args.single), "--plan", args.plan, "--steps", str(args.steps),
            "--backend", args.backend, "--child", cache] + (["--tiny"] if args.tiny else [])
    began = time.monotonic()
    code = run_within(argv, env, left)
    if code is None:
        write_row(args.out, {"measure": "stopped", **where, "after_s": round(time.monotonic() - began, 1),
                        "reason": "the budget was spent"})
        return False
    if code:
        write_row(args.out, {"measure": "failed", **where, "exit_code": code})
    return code == 0


# ---------------------------------------------------------------- a child: one qtype, one cache state


class Recompiles(logging.Handler):
    """Dynamo's recompile reasons (its `recompiles` log), one string per recompile."""

    def __init__(self):
        super().__init__()
        self.reasons = []

    def emit(self, record):
        failures = re.findall(r"^\s*- (\d+/\d+: .*)$", record.getMessage(), flags=re.MULTILINE)
        self.reasons.append("; ".join(failure.strip()[:200] for failure in failures))


def child(args) -> int:
    import torch

    from bench import _trainer

    trainer = _trainer.Trainer(args.trainer)
    from toolkit import block_compile, block_streaming, int4_linear
    from flux2_contract import memory_plan

    qtype, _, gemm = args.qtypes.partition(":")
    where = {"qtype": args.qtypes, "cache": args.child}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    began = time.perf_counter()
    params = trainer.params(tiny=args.tiny, depth=args.double, depth_single_blocks=args.single)
    model = random_4bit_model(torch, trainer, int4_linear, params, device)
    kwargs = {"w4a8_gemm": gemm, "w4a8_activations": "fp8"} if gemm == "scaled_mm" else ({"w4a8_gemm": gemm} if gemm else {})
    int4_linear.configure_linears(model, qtype, kwargs, device)
    lora, _ = _trainer.add_lora(model, 32, 32.0, device, torch.float32)
    model.gradient_checkpointing = True
    if args.plan == "stream":
        block_streaming.BlockStreamer(model, plan_of(memory_plan, params), device)
    resolution, text_tokens = (TINY_RESOLUTION, TINY_TEXT_TOKENS) if args.tiny else (RESOLUTION, TEXT_TOKENS)
    inputs, target = _trainer.make_inputs(trainer, params, resolution, 1, text_tokens, device)
    kernel = next(m.kernel for m in model.modules() if isinstance(m, int4_linear.Int4Linear))
    write_row(args.out, {"measure": "setup", **where, "device": torch.cuda.get_device_name() if device.type == "cuda"
                    else "cpu", "torch": torch.__version__, "hidden": params.hidden_size, "heads": params.num_heads,
                    "double": params.depth, "single": params.depth_single_blocks, "image_tokens": (resolution // 16) ** 2,
                    "text_tokens": text_tokens, "plan": args.plan, "kernel": repr(kernel), "backend": args.backend,
                    "build_s": round(time.perf_counter() - began, 1)})

    def step() -> float:
        sync()
        start = time.perf_counter()
        for p in lora:
            p.grad = None
        torch.nn.functional.mse_loss(model(**inputs).float(), target.float()).backward()
        sync()
        return time.perf_counter() - start

    eager_first = step()
    eager = statistics.median(step() for _ in range(args.steps))
    write_row(args.out, {"measure": "first_compile", **where, "seconds": round(first_compile(torch, device, args.backend), 1)})
    torch._dynamo.utils.counters.clear()
    torch._dynamo.utils.compilation_time_metrics.clear()
    recompiles = Recompiles()
    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(recompiles)
    block_compile.COMPILE_BOUND_S = float("inf")  # measured here, not cut short
    started = time.perf_counter()
    classes = block_compile.compile_blocks(model, backend=args.backend, log=lambda line: write_row(
        args.out, {"measure": "log", **where, "at_s": round(time.perf_counter() - started, 1), "line": line}))
    compiled_first = step()
    compiled = statistics.median(step() for _ in range(args.steps))
    seconds, graphs = block_compile.compile_seconds(), block_compile.compiled_graphs(classes)
    for cls in classes:
        name = cls.__name__
        write_row(args.out, {"measure": "compile", **where, "class": name, "seconds": round(seconds.get(name, 0.0), 1),
                        "graphs": graphs[name], "failure": cls.forward.failure})
    counters = torch._dynamo.utils.counters
    phases = {k: round(sum(v), 2) for k, v in torch._dynamo.utils.compilation_time_metrics.items() if sum(v) >= 0.05}
    write_row(args.out, {"measure": "steps", **where, "eager_first_s": round(eager_first, 3), "eager_s": round(eager, 4),
                    "compiled_first_s": round(compiled_first, 2), "compiled_s": round(compiled, 4),
                    "x_eager": round(compiled / eager, 3), "unique_graphs": counters["stats"]["unique_graphs"],
                    "graph_breaks": sum(counters["graph_break"].values()), "recompiles": recompiles.reasons,
                    "inductor_cache": {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")},
                    "dynamo_phases_s": phases})
    return 0


def first_compile(torch, device, backend: str) -> float:
    """Seconds to compile and run a one-kernel function: what the process's first compile costs
    whatever it compiles."""
    x = torch.ones(8, device=device)
    start = time.perf_counter()
    torch.compile(lambda t: t * 2 + 1, backend=backend)(x).sum().item()
    return time.perf_counter() - start


def random_4bit_model(torch, trainer, int4_linear, params, device):
    """Flux2 with every block Linear an Int4Linear of random codes (group scales ~0.003, zero point 8:
    weights within +-0.03), the rest N(0, 0.02) in bf16; nothing is ever held in bf16 whole."""
    from bench import _trainer

    with torch.device("meta"):
        model = trainer.model.Flux2(params).to(torch.bfloat16)
    for block in _trainer.blocks_of(model):
        for parent in list(block.modules()):
            for name, linear in list(parent.named_children()):
                if type(linear) is torch.nn.Linear:
                    setattr(parent, name, int4_linear.Int4Linear(linear.in_features, linear.out_features,
                                                                 bias=linear.bias is not None, device="meta"))
    model.to_empty(device=device)
    _trainer.init_random_(model, seed=0)
    generator = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, int4_linear.Int4Linear):
                module.qweight.random_(0, 256, generator=generator)
                module.scale.uniform_(0.002, 0.004, generator=generator)
                module.zero.fill_(8)
    return model.requires_grad_(False)


def plan_of(memory_plan, params):
    """Every other block of each class streamed, the rest resident; the first double block's
    activations kept, the others recomputed (a 24 GB card's plan at 512 px keeps one, the first)."""
    blocks = []
    for prefix, count in (("double_blocks", params.depth), ("single_blocks", params.depth_single_blocks)):
        for i in range(count):
            kept = prefix == "double_blocks" and i == 0
            blocks.append(memory_plan.BlockPlan(f"{prefix}.{i}", memory_plan.STREAMED if i % 2 else memory_plan.RESIDENT,
                                                memory_plan.KEPT if kept else memory_plan.RECOMPUTED))
    return memory_plan.MemoryPlan(budget_bytes=0, blocks=blocks)


if __name__ == "__main__":
    sys.exit(main())
