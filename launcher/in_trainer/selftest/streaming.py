"""The self-test's streaming part: the overlapped block streaming (the trainer's
toolkit/block_streaming.py) run for a bounded time, in a child process with a deadline.

Block swap with copies in flight during kernels deadlocked the HIP driver on Windows (wall 5), so
`stream_mode: auto` uses overlapped streaming only where this check ran to the end on an NVIDIA
GPU and gave the serialized mode's outputs and gradients; a hang is a result (the child is killed
at the deadline), not a hung self-test. On a ROCm GPU it is not run at all (`not_on_amd`).
`python -m launcher.in_trainer.selftest.streaming --trainer DIR --seconds S` is the child: it
prints one JSON line.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

RUN_SECONDS = 20.0
CPU_SECONDS = 2.0
DEADLINE_SECONDS = 120.0
"""The child's own work is ~RUN_SECONDS plus compiling the 4-bit kernels; past this it is stuck."""
TOLERANCE = 1e-2
"""Largest difference from the serialized mode's output and LoRA gradient, relative to their size."""
GPU_SHAPE = {"width": 3072, "depth": 8, "tokens": 2048}
CPU_SHAPE = {"width": 128, "depth": 4, "tokens": 16}


def block_stack(torch, int4_linear, width: int, depth: int):
    """A trainable Linear, then `depth` frozen blocks (LayerNorm + a 4-bit Linear, residual) in the
    FLUX.2 forward's loop: a block checkpoints unless it says `checkpointed = False`."""
    import torch.utils.checkpoint as ckpt

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(width)
            self.linear = int4_linear.Int4Linear.from_linear(torch.nn.Linear(width, width, bias=True))

        def forward(self, x):
            return x + torch.tanh(self.linear(self.norm(x)))

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lora = torch.nn.Linear(width, width)  # the only trainable part, outside the blocks
            self.blocks = torch.nn.ModuleList(Block() for _ in range(depth))
            self.blocks.requires_grad_(False)

        def forward(self, x):
            x = self.lora(x)
            for block in self.blocks:
                if torch.is_grad_enabled() and getattr(block, "checkpointed", True):
                    x = ckpt.checkpoint(block, x, use_reentrant=True)
                else:
                    x = block(x)
            return x

    return Stack()


def half_streamed(memory_plan, depth: int):
    """Every other block streamed (the copies alternate with resident compute), none kept."""
    blocks = [memory_plan.BlockPlan(f"blocks.{i}", memory_plan.STREAMED if i % 2 else memory_plan.RESIDENT,
                                    memory_plan.RECOMPUTED) for i in range(depth)]
    return memory_plan.MemoryPlan(budget_bytes=0, blocks=blocks)


def one_step(model, x):
    model.zero_grad()
    out = model(x)
    out.float().square().mean().backward()
    return out.detach(), model.lora.weight.grad.clone()


def child(trainer: Path, seconds: float) -> dict:
    """Overlapped against serialized on the same weights, then overlapped steps for `seconds`."""
    import copy

    sys.path.insert(0, str(trainer))
    import torch
    from toolkit import block_streaming, int4_linear
    from flux2_contract import memory_plan

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = GPU_SHAPE if device == "cuda" else CPU_SHAPE
    torch.manual_seed(0)
    base = block_stack(torch, int4_linear, shape["width"], shape["depth"]).to(torch.bfloat16)
    models = {}
    for mode in (block_streaming.SERIALIZED, block_streaming.OVERLAPPED):
        models[mode] = copy.deepcopy(base).to(device)
        block_streaming.BlockStreamer(models[mode], half_streamed(memory_plan, shape["depth"]), device, mode)
    x = torch.randn(1, shape["tokens"], shape["width"], dtype=torch.bfloat16, device=device)
    want = one_step(models[block_streaming.SERIALIZED], x)
    got = one_step(models[block_streaming.OVERLAPPED], x)
    # GPU kernels may sum in another order from call to call: a wrong or stale block is far off
    matches = all(float((a.float() - b.float()).abs().max()) <= TOLERANCE * float(a.float().abs().max()) + 1e-6
                  for a, b in zip(want, got))
    steps, began = 1, time.monotonic()
    while time.monotonic() - began < seconds:
        one_step(models[block_streaming.OVERLAPPED], x)
        steps += 1
    if device == "cuda":
        torch.cuda.synchronize()
    return {"device": device, "matches_serialized": matches, "steps": steps,
            "seconds": round(time.monotonic() - began, 2), **shape}


def not_on_amd() -> dict:
    """The check is not run on a ROCm GPU. A hang of the HIP driver may not end with the child
    process (a GPU reset, or the whole machine), a 20 s trial cannot show the absence of a deadlock
    that came during training, and what overlapping would save there is small: the streamed bytes
    at PCIe speed, about 0.3-0.6 s of a multi-second step on a 16 GB card (docs/amd.md)."""
    return {"passed": False, "completed": False, "skipped": True,
            "reason": "not run on AMD GPUs: a HIP driver hang can take the machine down (wall 5), and overlap "
                      "would save little there (docs/amd.md); set stream_mode: overlapped in a preset to try it"}


def check(trainer: Path, log, seconds: float = RUN_SECONDS, deadline: float = DEADLINE_SECONDS) -> dict:
    """Run the child; {"passed", "device", ...} or {"passed": False, "reason"} on a hang or an error."""
    log(f"overlapped block streaming for {seconds:.0f} s (deadline {deadline:.0f} s)")
    command = [sys.executable, "-m", "launcher.in_trainer.selftest.streaming", "--trainer", str(trainer),
               "--seconds", str(seconds)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, encoding="utf-8", errors="replace", timeout=deadline)
    except subprocess.TimeoutExpired:
        reason = f"overlapped streaming did not finish within its {deadline:.0f} s deadline (a driver hang: wall 5)"
        log(f"  FAIL: {reason}")
        return {"passed": False, "completed": False, "reason": reason}
    try:
        report = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        reason = f"overlapped streaming stopped with exit code {result.returncode}: {result.stderr.strip()[-300:]}"
        log(f"  FAIL: {reason}")
        return {"passed": False, "completed": False, "reason": reason}
    passed = bool(report["matches_serialized"])
    report.update(passed=passed, completed=True)
    if not passed:
        report["reason"] = "overlapped streaming gave other outputs or gradients than serialized streaming"
    log(f"  {'pass' if passed else 'FAIL'}: {report['steps']} steps in {report['seconds']} s on the {report['device']}")
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=RUN_SECONDS)
    args = parser.parse_args(argv)
    print(json.dumps(child(args.trainer.resolve(), args.seconds)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
