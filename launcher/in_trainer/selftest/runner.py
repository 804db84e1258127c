"""The self-test, trainer side: `python -m launcher.in_trainer.selftest.runner --trainer DIR --out FILE`.

Runs under the trainer venv's interpreter, where torch, Triton and the patched trainer's
4-bit modules are, and writes one JSON report (`launcher selftest` prints it for people):
  environment  Python, torch, CUDA/HIP, Triton, the GPU, FP8 matrix units or not;
  checks       each 4-bit kernel path against the plain-PyTorch reference on small shapes, and
               the 8-bit-activation error against bf16 activations (reference path);
  timing       the full-size FLUX.2 block Linears at the preset's token counts, bf16 weights
               against each 4-bit candidate: one step's forwards (2, as checkpointing
               recomputes them) and input gradients, in ms and TFLOP/s;
  training     3 LoRA steps on the tiny FLUX.2 per candidate, on the GPU;
  fastest      the fastest candidate whose checks and steps passed, or null with the reason;
  streaming    the overlapped block streaming run for a bounded time under a deadline: whether it
               completed and matched the serialized mode (`stream_mode: auto` follows it);
  blas         ROCm: hipBLAS against hipBLASLt at the 4-bit path's bf16 GEMMs, and the faster
               (`rocm_blas`, blas.py); skipped with the reason on NVIDIA and the CPU;
  convolution  one VAE-sized convolution through MIOpen / cuDNN, its first and second call timed
               (`miopen_find_mode`, convolution.py);
  attention    which SDPA backend runs at a FLUX.2 attention (`sdpa_kernels`, attention.py).
Without a GPU only the reference path can run: its checks and training steps run on the CPU,
nothing is timed, `fastest` is null and the report says so.
"""

import argparse
import importlib
import json
import platform
import sys
import time
from pathlib import Path

from launcher.in_trainer.selftest import attention, blas, convolution, kernels, streaming, training

SCHEMA = 1


def log(message: str) -> None:
    print(f"[selftest] {message}", flush=True)


def environment_report(m: kernels.Modules) -> dict:
    torch = m.torch
    report = {"python": platform.python_version(), "platform": f"{platform.system()} {platform.release()}",
              "torch": torch.__version__, "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
              "triton": None, "gpu": None, "fp8_units": False}
    try:
        import triton

        report["triton"] = triton.__version__
    except Exception as error:  # the 4-bit kernels need it; the report must say why they did not run
        report["triton_error"] = f"{type(error).__name__}: {error}"[:300]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        arch = props.gcnArchName if report["hip"] else f"sm_{props.major}{props.minor}"
        report["gpu"] = {"name": props.name, "vram_gib": round(props.total_memory / 2**30, 1), "arch": arch}
        report["fp8_units"] = m.qtypes.has_fp8_units(torch.device("cuda", 0))
    return report


def token_counts(text: str) -> list[tuple[int, int]]:
    """'1024,512;4096,512' -> [(image tokens, text tokens), ...]."""
    pairs = []
    for part in text.split(";"):
        image, txt = part.split(",")
        pairs.append((int(image), int(txt)))
    return pairs


def log_check(check: dict) -> None:
    label = check.get("candidate") or f"quality {check['check']}"
    detail = (f"max relative error {check['max_relative_error']:.1e} (limit {check['tolerance']:.0e})"
              if "max_relative_error" in check else check.get("error", ""))
    log(f"  {label}: {'pass' if check['passed'] else 'FAIL'}, {detail}")


def gpu_part(m: kernels.Modules, report: dict, args, device) -> None:
    """Kernel checks, training steps and timings on the GPU; picks the fastest that passed all."""
    env = report["environment"]
    cands = kernels.candidates(env["fp8_units"], bool(env["hip"]))
    for candidate in cands:
        report["checks"].append(kernels.check_candidate(m, candidate, device))
        log_check(report["checks"][-1])
    report["training"] = training.train_all(m, args.trainer, cands, device, log)
    kernel_ok = {c["candidate"] for c in report["checks"] if c.get("candidate") and c["passed"]}
    steps_ok = {t["candidate"] for t in report["training"] if t["passed"]}
    eligible = {c["name"] for c in cands if c["name"] in kernel_ok & steps_ok
                and kernels.quality_passed(report["checks"], c)}
    timed = [c for c in cands if c["name"] in kernel_ok & steps_ok]
    for image, txt in token_counts(args.tokens):
        cases = kernels.block_linear_cases(image * args.batch, txt * args.batch)
        log(f"timing the FLUX.2 block Linears at {image} image + {txt} text tokens x batch {args.batch}")
        rows = [kernels.time_candidate(m, None, cases, device, log)]
        rows += [kernels.time_candidate(m, c, cases, device, log) for c in timed]
        report["timing"].append({"image_tokens": image, "text_tokens": txt, "batch": args.batch, "results": rows})
    report["fastest"] = pick_fastest(report, cands, eligible)


def runtime_part(m: kernels.Modules, report: dict, args, device) -> None:
    """The runtime's libraries at the first timed shape: the BLAS library of the bf16 GEMMs (ROCm),
    the VAE convolution and the attention kernels."""
    importlib.import_module("torch.nn.attention")  # SDPBackend and sdpa_kernel, for attention.py
    torch, env = m.torch, report["environment"]
    hip, arch = bool(env["hip"]), (env["gpu"] or {}).get("arch", "")
    timer = lambda fn: kernels.timed_ms(torch, fn)  # noqa: E731
    image, txt = token_counts(args.tokens)[0]
    cases = kernels.block_linear_cases(image * args.batch, txt * args.batch)
    report["blas"] = blas.check(torch, hip, arch, cases, device, timer, log)
    log(f"  BLAS: {report['blas']['library']} ({report['blas']['reason']})")
    report["convolution"] = convolution.check(torch, device)
    check = report["convolution"]
    log(f"  VAE-sized convolution: {'not run' if not check['ran'] else 'pass' if check['passed'] else 'FAIL'}"
        f"{', ' + (check.get('error') or check.get('reason') or '') if not check.get('passed') else ''}"
        f"{', MIOpen find mode ' + check['find_mode'] + ': ' + check['reason'] if check.get('find_mode') else ''}")
    report["attention"] = attention.check(torch, hip, device, image + txt, timer, log)
    log(f"  attention kernels: {report['attention']['kernels']} ({report['attention']['reason']})")


def pick_fastest(report: dict, cands: list, eligible: set) -> dict:
    """The eligible candidate with the least block-Linear time summed over the timed shapes."""
    totals = {}
    for shape in report["timing"]:
        for row in shape["results"]:
            totals[row["candidate"]] = totals.get(row["candidate"], 0.0) + row["step_ms"]
    ranked = sorted((ms, name) for name, ms in totals.items() if name in eligible)
    if not ranked:
        return {"qtype": None, "reason": "no 4-bit kernel path passed its checks, quality gate and training steps"}
    ms, name = ranked[0]
    best = next(c for c in cands if c["name"] == name)
    return {"qtype": best["qtype"], "candidate": name, "kernel": best["kernel"], "step_ms": ms,
            "x_bf16": ms / totals["bf16"] if totals.get("bf16") else None}


def run(args) -> dict:
    sys.path.insert(0, str(args.trainer))
    m = kernels.Modules()
    report = {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "environment": environment_report(m), "checks": [], "training": [], "timing": []}
    env = report["environment"]
    log(f"torch {env['torch']}, Triton {env['triton'] or 'not importable'}, "
        f"GPU {env['gpu']['name'] if env['gpu'] else 'none'}")
    resets = blas.resets(env["gpu"]["arch"]) if env["hip"] and env["gpu"] else None
    if resets:  # every check below multiplies through hipBLAS, as `rocm_blas: auto` will train
        m.torch.backends.cuda.preferred_blas_library(blas.HIPBLAS)
        log(f"hipBLAS for the whole self-test: {resets}")
    for fmt in ("fp8", "int8"):
        for outliers in (False, True):
            report["checks"].append(kernels.check_quality(m, fmt, "cpu", outliers))
            log_check(report["checks"][-1])
    if env["gpu"] is None:
        report["training"] = training.train_all(m, args.trainer, kernels.reference_candidates(), "cpu", log)
        report["fastest"] = {"qtype": None, "reason": "torch saw no GPU, so only the reference path (CPU) was checked"}
    elif env["triton"] is None:
        report["fastest"] = {"qtype": None, "reason": "Triton does not import; the 4-bit kernels need it"}
    else:
        gpu_part(m, report, args, m.torch.device("cuda", 0))
    runtime_part(m, report, args, m.torch.device("cuda", 0) if env["gpu"] else None)
    # on the CPU only the mechanics are checked: a few steps are enough
    seconds = args.streaming_seconds if env["gpu"] else min(args.streaming_seconds, streaming.CPU_SECONDS)
    report["streaming"] = (streaming.not_on_amd() if env["hip"] and env["gpu"]
                           else streaming.check(args.trainer, log, seconds))
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", type=Path, required=True, help="the patched trainer checkout")
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON report")
    parser.add_argument("--tokens", default="1024,512", help="image,text tokens per sample; ';' between shapes")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--streaming-seconds", type=float, default=streaming.RUN_SECONDS,
                        help="how long the overlapped block streaming runs")
    args = parser.parse_args(argv)
    args.trainer = args.trainer.resolve()
    report = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
