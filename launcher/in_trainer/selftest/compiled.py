"""The self-test's compile check: the trainer's FLUX.2 blocks compiled (toolkit/block_compile.py)
against the same model uncompiled, in a child process with a deadline.

torch.compile needs Triton and a working compiler toolchain on the user's machine, which ROCm on
Windows may not have. So `compile_blocks: auto` compiles only where this check compiled a small
FLUX.2 (the trainer's own block classes, the self-test's fastest 4-bit path in every block
Linear, a LoRA on each, gradient checkpointing as in training) on the GPU, forward and backward,
within the deadline; matched the uncompiled model's loss and LoRA gradients; and was not slower.
The small model only guards against a slowdown: its steps are too short to show the gain of a
full-size one (on an H200 it read 1.01x against the full-size steps' gain docs/cards.md gives, from
bench/RESULTS.md's same-call runs).
`launcher selftest` starts the child beside its sampling check (compiling is CPU work):
`python -m launcher.in_trainer.selftest.compiled --trainer DIR [--candidate JSON]` prints one
JSON line. Nothing here imports torch at module level: the launcher reads the constants and
`verdict`.
"""

import argparse
import json
import sys
import time
from pathlib import Path

DEADLINE_SECONDS = 420.0
"""Compiling two block classes, with and without grad, forward and backward: about a minute on a
GPU machine; past this the toolchain is stuck or far too slow to pay off."""
TOLERANCE = 1e-1
"""Largest difference from the uncompiled loss and LoRA gradients (relative Frobenius norm): fused
kernels keep fp32 between ops that the uncompiled model rounds to bf16, and 8-bit activations
turn some of those roundings into a code step. Measured on small models (CPU): 0.01-0.016 with
bf16 Linears, 0.024-0.074 with FP8 activations; a wrong fusion is off by the whole gradient."""
SLOWER_LIMIT = 1.1
"""The compiled small model may take up to this times the uncompiled time (its short steps are
noisy); slower than that, compiling is a loss on this GPU."""
GPU_SHAPE = {"hidden_size": 3072, "num_heads": 24, "axes_dim": [32, 32, 32, 32], "depth": 1,
             "depth_single_blocks": 2, "image_side": 32, "text_tokens": 256}
CPU_SHAPE = {"hidden_size": 64, "num_heads": 2, "axes_dim": [8, 8, 8, 8], "depth": 1,
             "depth_single_blocks": 1, "image_side": 4, "text_tokens": 8}
TIMED_STEPS = 10
RANK = 16


def build(m, flux2, shape: dict, candidate: dict | None, device):
    """The small FLUX.2 in bf16 with the candidate's 4-bit block Linears (bf16 ones without a
    candidate), a LoRA on each block Linear (both factors non-zero, so both get gradients), and
    gradient checkpointing on."""
    from launcher.in_trainer.selftest import training

    torch = m.torch
    torch.manual_seed(0)
    names = ("hidden_size", "num_heads", "axes_dim", "depth", "depth_single_blocks")
    params = flux2.Flux2Params(in_channels=128, context_in_dim=256, **{k: shape[k] for k in names})
    model = flux2.Flux2(params).to(torch.bfloat16)
    model.requires_grad_(False)
    in_blocks = lambda name, _: name.split(".")[0] in ("double_blocks", "single_blocks")  # noqa: E731
    if candidate:
        m.int4.quantize_linears(model, in_blocks)
        m.int4.configure_linears(model, candidate["qtype"], candidate.get("kernel"), device)
    adapters = training.with_lora(m, model, RANK, kinds=(m.int4.Int4Linear,) if candidate else (torch.nn.Linear,),
                                  where=in_blocks)
    for up in adapters[1::2]:
        torch.nn.init.normal_(up, std=0.02)
    model.gradient_checkpointing = True
    return model.to(device), params, adapters


def step(torch, model, adapters, batch, target):
    """One forward and backward; (loss, the LoRA gradients)."""
    for p in adapters:
        p.grad = None
    loss = torch.nn.functional.mse_loss(model(**batch).float(), target)
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in adapters]


def timed(torch, model, adapters, batch, target, device, steps: int) -> float:
    """Median milliseconds of `steps` forward + backward passes."""
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        step(torch, model, adapters, batch, target)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - began) * 1e3)
    return sorted(times)[len(times) // 2]


def relative_difference(got: list, want: list) -> float:
    """The largest |got - want| / |want| (Frobenius norms) over the loss and every gradient."""
    return max(float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)) for a, b in zip(got, want))


def child(trainer: Path, candidate: dict | None, backend: str) -> dict:
    """Uncompiled steps first (reference and time), then the same model compiled."""
    sys.path.insert(0, str(trainer))
    from toolkit import block_compile

    from launcher.in_trainer.selftest import kernels, training

    m = kernels.Modules()
    torch = m.torch
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = GPU_SHAPE if device.type == "cuda" else CPU_SHAPE
    flux2 = training.load_flux2(trainer)
    model, params, adapters = build(m, flux2, shape, candidate, device)
    batch, target = training.tiny_batch(torch, device, shape["image_side"], shape["text_tokens"], params.in_channels,
                                        params.context_in_dim)
    want = step(torch, model, adapters, batch, target)
    eager_ms = timed(torch, model, adapters, batch, target, device, TIMED_STEPS)
    classes = block_compile.compile_blocks(model, log=lambda line: None, backend=backend)
    try:
        began = time.perf_counter()
        got = step(torch, model, adapters, batch, target)
        if device.type == "cuda":
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - began
        failures = [f"{cls.__name__}: {cls.forward.failure}" for cls in classes if cls.forward.failure]
        compiled_ms = timed(torch, model, adapters, batch, target, device, TIMED_STEPS)
    finally:
        block_compile.uncompile(classes)
    difference = relative_difference([got[0], *got[1]], [want[0], *want[1]])
    return {"device": device.type, "backend": backend, "candidate": (candidate or {}).get("name", "bf16"),
            "compiled": not failures, "failures": failures, "max_relative_difference": difference,
            "eager_ms": round(eager_ms, 2), "compiled_ms": round(compiled_ms, 2),
            "x_eager": round(compiled_ms / eager_ms, 3), "compile_s": round(compile_s, 1), **shape}


def applicable(report: dict) -> str | None:
    """Why the check cannot run for this self-test report, or None."""
    env = report["environment"]
    if env.get("gpu") is None or env.get("triton") is None:
        return "compiling the blocks is checked on a GPU with Triton only"
    if not (report.get("fastest") or {}).get("qtype"):
        return "no 4-bit kernel path passed, so none was compiled around"
    return None


def candidate_from(fastest: dict) -> dict:
    """The self-test's fastest candidate, as the child takes it."""
    return {"name": fastest["candidate"], "qtype": fastest["qtype"], "kernel": fastest.get("kernel") or {}}


def verdict(stdout: str, returncode: int, stderr: str) -> dict:
    """The child's report with passed and, when it did not pass, the reason."""
    try:
        report = json.loads(stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        reason = f"the compile check stopped with exit code {returncode}: {stderr.strip()[-300:]}"
        return {"passed": False, "reason": reason}
    if not report["compiled"]:
        reason = f"the blocks did not compile here ({'; '.join(report['failures'])[:300]})"
    elif report["max_relative_difference"] > TOLERANCE:
        reason = (f"the compiled blocks differ from the uncompiled ones by {report['max_relative_difference']:.1e} "
                  f"(limit {TOLERANCE:.0e})")
    elif report["x_eager"] > SLOWER_LIMIT:
        reason = f"the compiled blocks stepped {report['x_eager']:.2f}x the uncompiled time: slower on this GPU"
    else:
        return {**report, "passed": True}
    return {**report, "passed": False, "reason": reason}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", type=Path, required=True)
    parser.add_argument("--candidate", type=json.loads, default=None, help="a self-test candidate, as JSON")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (tests: aot_eager)")
    args = parser.parse_args(argv)
    print(json.dumps(child(args.trainer.resolve(), args.candidate, args.backend)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
