#!/usr/bin/env python3
"""The 4-bit step with compiled blocks against bf16's at full width: seconds per step, where they
go, and the 8-bit matmul's parts per FLUX.2 block Linear shape.

  steps    one child process per variant, in the order given, sharing fresh Inductor and Triton
           caches. The model: FLUX.2 [dev]'s blocks at full width (--double 8, --single 36: the 44
           of 56 blocks of bench/same_call.sh), random weights (4-bit: bench/compile_time.py's random
           codes in the trainer's Int4Linear, its kernel from the variant's model_kwargs; bf16:
           bench/_trainer.build_random), a LoRA (rank 32, fp32 as the trainer's network) on every
           block Linear, the model's gradient checkpointing on every block (no memory plan, no
           cap), AdamW on the LoRA; the blocks compiled by toolkit/block_compile.compile_blocks
           unless the variant is eager. Per child: --warmup steps (the compiles), --steps timed
           steps (their median), then --profile steps under torch.profiler, charged to the
           categories of `run --profile N` (toolkit/step_breakdown.py). A variant VARIANT@base runs
           the trainer of --base-trainer (the code before a change) in the same call.
  kernels  per block Linear shape at 512 px: bf16 cuBLAS, the 8-bit matmul as the trainer runs it
           (forward and input gradient), its parts (activation quantization, the requantization per
           tile, torch._scaled_mm, with fast accumulation too, and its relative difference), and
           with the 8-bit weight held (toolkit/int4_linear.Int4Linear.hold_copy); summed per step with the
           layer counts of the 44 blocks (forward twice: the pass and its recompute).

    python3 -m bench.compiled_step steps --trainer T --base-trainer T0 --variants w4a8@base,bf16,w4a8 --out S.jsonl
    python3 -m bench.compiled_step kernels --trainer T --out K.json
    W/venv/bin/python -m bench.compiled_step steps --trainer W/trainer --tiny --variants w4a8,bf16 --out t.jsonl
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench._children import fresh_compile_caches, run_within

SCALED = {"w4a8_activations": "fp8", "w4a8_gemm": "scaled_mm", "int4_chunk_mib": 256}
FORWARD_COPIES_GIB = 24  # the forward copies of the 44 blocks' weights: 25.5e9 bytes, 23.8 GiB
IN_REGISTER = {**SCALED, "w4a8_gemm": "in_register"}  # the forward reads the 4-bit weight; the input gradient sliced
ONE_SLICE = {**SCALED, "int4_chunk_mib": 384}  # every FLUX.2 block Linear's 8-bit weight in one slice
VARIANTS = {
    "bf16": {"weights": "bf16"},
    "bf16_eager": {"weights": "bf16", "compile": False},
    "bf16_tf32": {"weights": "bf16", "tf32": True},
    "w4a8": {"weights": "int4_w4a8", "kwargs": SCALED},
    "w4a8_eager": {"weights": "int4_w4a8", "kwargs": SCALED, "compile": False},
    "w4a8_slice384": {"weights": "int4_w4a8", "kwargs": ONE_SLICE},
    "w4a8_tf32": {"weights": "int4_w4a8", "kwargs": ONE_SLICE, "tf32": True},
    "w4a8_hold_fwd": {"weights": "int4_w4a8", "kwargs": ONE_SLICE, "hold_gib": FORWARD_COPIES_GIB},
    "w4a8_hold_fwd_tf32": {"weights": "int4_w4a8", "kwargs": ONE_SLICE, "hold_gib": FORWARD_COPIES_GIB, "tf32": True},
    "w4a8_hold": {"weights": "int4_w4a8", "kwargs": ONE_SLICE, "hold_gib": 2 * FORWARD_COPIES_GIB},
    "w4a8_rerun": {"weights": "int4_w4a8", "kwargs": SCALED},
    "w4a8_lora_tf32": {"weights": "int4_w4a8", "kwargs": SCALED, "tf32": True},
    "w4a8_lora_bf16": {"weights": "int4_w4a8", "kwargs": SCALED, "lora_compute": "bf16"},
    "bf16_lora_bf16": {"weights": "bf16", "lora_compute": "bf16"},
    "w4a8_seed1": {"weights": "int4_w4a8", "kwargs": SCALED, "seed": 1},
    "w4a8_in_register_lora_bf16": {"weights": "int4_w4a8", "kwargs": IN_REGISTER, "lora_compute": "bf16"},
}
"""Each variant: its weights, their kernel (model_kwargs), compiled blocks (default) or not, the
bytes of 8-bit copies held (toolkit/int4_linear.hold_8bit_weights: forward copies first), and
`tf32`: the fp32 LoRA's matmuls on TF32 tensor cores (torch.set_float32_matmul_precision("high"));
the trainer keeps its LoRA in fp32 and leaves that precision at "highest"; `lora_compute`: the fp32
LoRA's two matmuls in that dtype (the weights cast per call); `w4a8_rerun` is `w4a8` again (the GPU's
run-to-run spread of the trained LoRA) and `w4a8_seed1` with another LoRA initialisation (what
`lora-compare` calls different)."""
RESOLUTION, TEXT_TOKENS = 512, 512
SHORTEST_CHILD_S = 40


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    steps = sub.add_parser("steps", help="seconds per step and its breakdown, one child per variant")
    steps.add_argument("--trainer", required=True, type=Path, help="a trainer checkout, or a carried copy")
    steps.add_argument("--base-trainer", type=Path, help="the trainer of the VARIANT@base variants")
    steps.add_argument("--variants", default="w4a8,bf16", help=f"comma list of {', '.join(VARIANTS)} (@base)")
    steps.add_argument("--out", required=True, type=Path, help="JSON lines, one per variant")
    steps.add_argument("--double", type=int, default=8)
    steps.add_argument("--single", type=int, default=36)
    steps.add_argument("--warmup", type=int, default=3)
    steps.add_argument("--steps", type=int, default=10)
    steps.add_argument("--profile", type=int, default=3, help="profiled steps after the timed ones (0: none)")
    steps.add_argument("--budget", type=float, default=540.0, help="seconds for every child together")
    steps.add_argument("--tiny", action="store_true", help="the bench's tiny Flux2Params, 64 px (CPU dry run)")
    steps.add_argument("--backend", default="inductor", help="torch.compile backend (a quick dry run: aot_eager)")
    steps.add_argument("--save-lora", type=Path, help="a folder: each variant's trained LoRA (<variant>.pt) for lora-compare")
    steps.add_argument("--child", help=argparse.SUPPRESS)
    kernels = sub.add_parser("kernels", help="the 8-bit matmul's parts per block Linear shape")
    kernels.add_argument("--trainer", required=True, type=Path)
    kernels.add_argument("--out", required=True, type=Path)
    kernels.add_argument("--px", type=int, default=512, choices=(512, 1024), help="the image size of the shapes")
    pairs = sub.add_parser("lora-compare", help="the LoRAs of steps --save-lora compared (bench/lora_fidelity.py)")
    pairs.add_argument("folder", type=Path, help="the --save-lora folder")
    pairs.add_argument("pairs", nargs="+", help="REF:OTHER variant names")
    pairs.add_argument("--steps-jsonl", type=Path, help="steps' --out: each variant's loss curve")
    pairs.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    if args.command == "steps":
        for spec in args.variants.split(","):
            name, _, where = spec.partition("@")
            if name not in VARIANTS or where not in ("", "base") or (where and not (args.base_trainer or args.child)):
                p.error(f"--variants: {spec!r} is not one of {', '.join(VARIANTS)} (VARIANT@base needs --base-trainer)")
    return args


def write_row(out: Path, row: dict) -> None:
    with open(out, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(row) + "\n")


def main(argv=None) -> int:
    args = parse(argv)
    if args.command == "kernels":
        from bench import w4a8_parts

        return w4a8_parts.main(args)
    if args.command == "lora-compare":
        return lora_compare(args)
    if args.child:
        return child(args)
    deadline = time.monotonic() + args.budget
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("", encoding="utf-8")
    failed = False
    with tempfile.TemporaryDirectory(prefix="compiled-step-") as caches:
        env = fresh_compile_caches(Path(caches))
        for spec in args.variants.split(","):
            failed |= not run_child(args, spec, env, deadline - time.monotonic())
    return 1 if failed else 0


def run_child(args, spec: str, env: dict, left: float) -> bool:
    """One variant in a child process, stopped (its process group) once `left` seconds are spent."""
    if left < SHORTEST_CHILD_S:
        write_row(args.out, {"variant": spec, "measure": "skipped", "reason": f"{max(left, 0):.0f} s left"})
        return True
    trainer = args.base_trainer if spec.endswith("@base") else args.trainer
    argv = [sys.executable, "-m", "bench.compiled_step", "steps", "--trainer", str(trainer.resolve()),
            "--variants", spec, "--out", str(args.out.resolve()), "--child", spec, "--double", str(args.double),
            "--single", str(args.single), "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--profile", str(args.profile), "--backend", args.backend] + (["--tiny"] if args.tiny else []) \
        + (["--save-lora", str(args.save_lora.resolve())] if args.save_lora else [])
    began = time.monotonic()
    code = run_within(argv, env, left)
    if code is None:
        write_row(args.out, {"variant": spec, "measure": "stopped", "after_s": round(time.monotonic() - began, 1)})
        return False
    if code:
        write_row(args.out, {"variant": spec, "measure": "failed", "exit_code": code})
    print(f"=== {spec}: exit {code} after {time.monotonic() - began:.0f} s", flush=True)
    return code == 0


# ---------------------------------------------------------------- a child: one variant


def build(torch, trainer, variant: dict, args, device):
    """The model of one variant, its LoRA parameters, and what was held (bytes of 8-bit copies)."""
    from bench import _trainer
    from bench.compile_time import random_4bit_model
    from toolkit import int4_linear

    params = trainer.params(tiny=args.tiny, depth=args.double, depth_single_blocks=args.single)
    if variant["weights"] == "bf16":
        model = _trainer.build_random(trainer, params, device, None, log=lambda *a: None)
    else:
        model = random_4bit_model(torch, trainer, int4_linear, params, device)
        int4_linear.configure_linears(model, variant["weights"], variant.get("kwargs", {}), device)
    held = 0
    if variant.get("hold_gib"):
        held = int4_linear.hold_8bit_weights(model, int(variant["hold_gib"] * 2**30))
    compute = {"bf16": torch.bfloat16}.get(variant.get("lora_compute"))
    lora, _ = _trainer.add_lora(model, 32, 32.0, device, torch.float32, compute_dtype=compute)
    model.gradient_checkpointing = True
    model.train()
    return params, model, lora, held


def child(args) -> int:
    import torch

    from bench import _trainer

    trainer = _trainer.Trainer(args.trainer)
    from toolkit import block_compile

    spec = args.child
    variant = VARIANTS[spec.partition("@")[0]]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if variant.get("tf32"):
        torch.set_float32_matmul_precision("high")
    torch.manual_seed(variant.get("seed", 0))  # the LoRA's initial down projection (bench/_trainer.add_lora draws it)
    began = time.perf_counter()
    params, model, lora, held = build(torch, trainer, variant, args, device)
    resolution, text_tokens = (64, 8) if args.tiny else (RESOLUTION, TEXT_TOKENS)
    inputs, target = _trainer.make_inputs(trainer, params, resolution, 1, text_tokens, device)
    optimizer = torch.optim.AdamW(lora, lr=1e-4)
    row = {"variant": spec, "measure": "steps", "trainer": trainer.commit(), "weights": variant["weights"],
           "model_kwargs": variant.get("kwargs", {}), "compiled": variant.get("compile", True),
           "float32_matmul_precision": torch.get_float32_matmul_precision(),
           "held_8bit_gib": round(held / 2**30, 2), "double": params.depth, "single": params.depth_single_blocks,
           "px": resolution, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "build_s": round(time.perf_counter() - began, 1)}
    if row["compiled"]:
        block_compile.COMPILE_BOUND_S = float("inf")  # measured here, not cut short
        block_compile.compile_blocks(model, backend=args.backend, log=lambda line: None)
    step = stepper(torch, model, inputs, target, optimizer, lora, device)
    warmup = [step() for _ in range(args.warmup)]
    row["warmup_s"] = [round(t, 3) for t, _ in warmup]
    row["warmup_losses"] = [loss for _, loss in warmup]
    timed = [step() for _ in range(args.steps)]
    row["s_per_step"] = round(statistics.median(t for t, _ in timed), 4)
    row["steps_s"] = [round(t, 4) for t, _ in timed]
    row["losses"] = [loss for _, loss in timed]
    row["lora_norm"] = float(torch.linalg.vector_norm(torch.cat([p.detach().flatten() for p in lora])))
    row["lora_compute"] = variant.get("lora_compute", "fp32")
    if args.save_lora:
        args.save_lora.mkdir(parents=True, exist_ok=True)
        factors = {name: (m.lora_up.weight.detach().float().cpu(), m.lora_down.weight.detach().float().cpu())
                   for name, m in model.named_modules() if hasattr(m, "lora_down")}
        torch.save(factors, args.save_lora / f"{spec.replace('@', '_at_')}.pt")
    if device.type == "cuda":
        row["peak_alloc_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    counters = torch._dynamo.utils.counters
    row["graph_breaks"] = sum(counters["graph_break"].values())
    row["compile_s"] = {k: round(v, 1) for k, v in block_compile.compile_seconds().items()}
    if args.profile:
        row["breakdown"] = profiled(torch, step, args.profile, device)
    write_row(args.out, row)
    print(json.dumps({k: row[k] for k in ("variant", "s_per_step", "held_8bit_gib", "graph_breaks")}), flush=True)
    return 0


def lora_compare(args) -> int:
    """Each pair's per-module cosine and norm ratio of the trained deltas (bench/lora_fidelity.py's
    measures) and its loss curves."""
    import torch

    from bench import lora_fidelity

    curves = {}
    if args.steps_jsonl:
        for line in args.steps_jsonl.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            if row.get("losses"):
                curves[row["variant"]] = dict(enumerate(row.get("warmup_losses", []) + row["losses"], start=1))
    result = {"pairs": [], "losses": curves}
    for pair in args.pairs:
        reference, other = pair.split(":", 1)
        loras = [torch.load(args.folder / f"{name}.pt") for name in (reference, other)]
        modules = lora_fidelity.compare_modules(*loras)
        item = {"reference": reference, "other": other, **lora_fidelity.summary(modules),
                "loss": lora_fidelity.loss_figures(curves.get(reference, {}), curves.get(other, {}))}
        result["pairs"].append(item)
        print(f"{reference} vs {other}: cosine median {item['cosine_median']:.4f}, min {item['cosine_min']:.4f}, "
              f"norm ratio {item['norm_ratio_median']:.4f}, loss {item['loss']}", flush=True)
    args.out.write_text(json.dumps(result) + "\n", encoding="utf-8")
    return 0


def stepper(torch, model, inputs, target, optimizer, lora, device):
    """One LoRA step (forward, MSE, backward, AdamW), timed to the GPU's end: (seconds, loss)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step():
        optimizer.zero_grad(set_to_none=True)
        sync()
        start = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(**inputs).float(), target.float())
        loss.backward()
        optimizer.step()
        sync()
        return time.perf_counter() - start, round(float(loss.detach()), 6)

    return step


def profiled(torch, step, steps: int, device) -> dict:
    """`steps` steps under torch.profiler, charged to toolkit/step_breakdown.py's categories."""
    from toolkit import step_breakdown

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with tempfile.TemporaryDirectory(prefix="compiled-step-trace-") as folder:
        trace = Path(folder) / "trace.json"
        with torch.profiler.profile(activities=activities, record_shapes=True) as profile:
            start = time.perf_counter()
            for _ in range(steps):
                step()
            wall = time.perf_counter() - start
        profile.export_chrome_trace(str(trace))
        events = step_breakdown.load_trace(str(trace))
    result = step_breakdown.breakdown(events, wall, steps)
    result["top_kernels_ms"] = top_kernels(events, steps)
    return result


def top_kernels(events: list, steps: int, count: int = 25) -> dict:
    """The GPU kernels with the most time, milliseconds per step and launches per step."""
    totals = {}
    for event in events:
        if event.get("ph") == "X" and event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            name = event.get("name", "")[:90]
            time_us, launches = totals.get(name, (0.0, 0))
            totals[name] = (time_us + event.get("dur", 0), launches + 1)
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:count]
    return {name: [round(us / 1e3 / steps, 2), launches // steps] for name, (us, launches) in ranked}


if __name__ == "__main__":
    sys.exit(main())
