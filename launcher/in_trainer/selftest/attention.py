"""The self-test's attention check: which of PyTorch's attention kernels (the SDPA backends) runs
on this GPU at a FLUX.2 [dev] attention, forward and backward, and whether it agrees with the
math backend.

On the ROCm Windows wheels SDPA may have no flash or memory-efficient kernel for a card unless
TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1 (reported on gfx1200: unsloth PR 8821, 2026-08). PyTorch
reads that variable once, at the first attention of a process, so where only the math backend ran
here the check runs again in a child process with the variable set. The verdict is
`sdpa_kernels`: default, experimental (`run` sets the variable for the trainer) or math (the
memory plan holds the fp32 attention matrices the math backend materialises, heads x tokens^2 each,
4.1 GB at 1024 px: flux2_contract/memory_plan.py; launcher/step_prediction.py adds their memory
traffic to the predicted step). `python -m launcher.in_trainer.selftest.attention --tokens N` is the
child. Stdlib-only at module level: torch comes in as an argument.
"""

import argparse
import json
import os
import subprocess
import sys

VARIABLE = "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL"
ON = ("1", "ON", "YES", "TRUE", "Y")
"""The values PyTorch's c10::utils::check_env reads as true."""
HEADS, HEAD_DIM = 48, 128
"""FLUX.2 [dev]'s attention: 6144 hidden in 48 heads of 128 (flux2_contract/families.py FLUX2_DEV)."""
BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
"""torch.nn.attention.SDPBackend names, in the order PyTorch prefers them."""
MATH = "MATH"
TOLERANCE = 2e-2
"""Largest relative difference of a kernel's output from the math backend's: bf16 against fp32
sums; a wrong kernel is far off."""
DEADLINE_S = 300
"""The child's limit: it imports torch and runs each backend a few times at one shape."""
DEFAULT, EXPERIMENTAL = "default", "experimental"


def variable_on(environ=os.environ) -> bool:
    return environ.get(VARIABLE, "").strip().upper() in ON


def relative_difference(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def backends(torch, device, tokens: int, timer) -> dict:
    """{backend: {"ran": True, "ms", "difference"} or {"ran": False, "error"}} for one attention of
    `tokens` tokens: forward and backward timed by `timer(fn) -> ms`, the forward compared with the
    math backend's (run first: the reference)."""
    attention = torch.nn.attention
    g = torch.Generator(device=device).manual_seed(tokens)
    q, k, v = (torch.randn(1, HEADS, tokens, HEAD_DIM, device=device, generator=g, dtype=torch.bfloat16)
               .requires_grad_(True) for _ in range(3))

    def step():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        out.backward(torch.ones_like(out))

    found, reference = {}, None
    for name in reversed(BACKENDS):
        try:
            with attention.sdpa_kernel([getattr(attention.SDPBackend, name)]):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v).detach()
                ms = timer(step)
        except RuntimeError as error:  # "No available kernel": a finding, not a crash
            found[name] = {"ran": False, "error": f"{type(error).__name__}: {error}"[:300]}
            continue
        reference = out if reference is None else reference
        found[name] = {"ran": True, "ms": round(ms, 3), "difference": relative_difference(out, reference)}
    return {name: found[name] for name in BACKENDS}


def fastest_kernel(found: dict) -> str | None:
    """The first backend in PyTorch's order, other than math, that ran and agreed with math."""
    return next((name for name in BACKENDS[:-1] if (found.get(name) or {}).get("ran")
                 and found[name]["difference"] <= TOLERANCE), None)


def decide(here: dict, variable_was_on: bool, with_variable: dict | None) -> dict:
    """`sdpa_kernels` from the backends found in this process (the variable as it was) and, where
    only math ran, in a child with the variable set (None: not tried)."""
    kernel = fastest_kernel(here)
    if kernel:
        if variable_was_on:
            return {"kernels": EXPERIMENTAL, "backend": kernel, "reason": f"{kernel} ran with {VARIABLE}=1 set"}
        return {"kernels": DEFAULT, "backend": kernel, "reason": f"{kernel} ran"}
    math = here.get(MATH) or {}
    kernel = fastest_kernel(with_variable or {})
    if kernel:
        return {"kernels": EXPERIMENTAL, "backend": kernel,
                "reason": f"only math ran ({math.get('ms')} ms); with {VARIABLE}=1 {kernel} ran "
                          f"({with_variable[kernel]['ms']} ms) and agreed with it"}
    if math.get("ran"):
        tried = f", also with {VARIABLE}=1" if with_variable is not None or variable_was_on else ""
        return {"kernels": MATH.lower(), "backend": MATH, "reason": f"only math ran ({math['ms']} ms){tried}"}
    return {"kernels": DEFAULT, "backend": None, "reason": f"no attention backend ran: {math.get('error')}"}


def child(tokens: int, timeout: float = DEADLINE_S) -> dict | None:
    """The backends found by a child process with the variable set; None where it gave no result."""
    command = [sys.executable, "-m", "launcher.in_trainer.selftest.attention", "--tokens", str(tokens)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, encoding="utf-8", errors="replace",
                                timeout=timeout, env={**os.environ, VARIABLE: "1"})
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def check(torch, hip: bool, device, tokens: int, timer, log, probe=child) -> dict:
    """The attention part of the report; on ROCm, where only math ran, `probe(tokens)` (the child)
    tries again with the variable set."""
    if device is None or not torch.cuda.is_available():
        return {"ran": False, "kernels": DEFAULT, "reason": "no GPU: attention runs on the CPU"}
    log(f"which attention kernels run at {HEADS} heads x {tokens} tokens x {HEAD_DIM}")
    here, was_on = backends(torch, device, tokens, timer), variable_on()
    with_variable = None
    if hip and not was_on and not fastest_kernel(here):
        log(f"  only math ran: trying again in a child process with {VARIABLE}=1")
        with_variable = probe(tokens)
    return {"ran": True, "tokens": tokens, "heads": HEADS, "backends": here, "variable_was_on": was_on,
            "with_variable": with_variable, **decide(here, was_on, with_variable)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, required=True)
    args = parser.parse_args(argv)
    import torch.nn.attention

    from launcher.in_trainer.selftest.kernels import timed_ms

    found = backends(torch, torch.device("cuda", 0), args.tokens, lambda fn: timed_ms(torch, fn))
    print(json.dumps(found), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
