"""`python -m launcher selftest`: test the 4-bit kernels on this machine's GPU and keep the verdict.

Runs `launcher.in_trainer.selftest` with the trainer venv's interpreter: every 4-bit kernel
path against its plain-PyTorch reference, the 8-bit-activation quality gate, three LoRA steps
on the tiny FLUX.2 per path, the block-Linear time of one step at the preset's shapes,
bf16 weights against each path, a bounded sampling run (wall 6: the tiny 4-bit FLUX.2
samples finite images in a process of its own, within SAMPLING_LIMIT_S), and the overlapped
block streaming under a deadline (wall 5). The result goes to `<workdir>/selftest.json`, which presets
with `qtype: auto` follow (`run`) and `doctor` shows; the printed report is what a bug report
needs. Without a GPU only the reference path runs, and the report says so.
"""

import argparse
import json
import os
import subprocess
from pathlib import Path

from launcher import __version__
from launcher.envs.hostinfo import gpu_driver_version
from launcher.envs.selftest import trainer_build
from launcher.envs.trainer_python import run_module
from launcher.runs import tiny
from launcher.envs.workdir import DEFAULT_WORKDIR, Workdir, venv_python
from launcher.errors import LauncherError
from launcher.progress import say
from launcher.runs.presets import load_preset

TEXT_TOKENS = 512
"""Text tokens per sample in FLUX.2 training (the bench and the trainer's cached embeddings)."""
SAMPLING_LIMIT_S = 600
"""The sampling check's time limit: the tiny model loads and samples in well under a minute; a
process still running after this is what the HIP driver's sampling deadlock looks like."""


EXAMPLES = """examples:
  python -m launcher selftest                # kernels, quality gate, tiny steps, timings; writes selftest.json
  python -m launcher selftest --preset 7900xtx_768 --json
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser("selftest", help="test the 4-bit kernels on this GPU; `qtype: auto` follows it",
                                   description=__doc__.splitlines()[0],
                                   epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="default: .aitk")
    parser.add_argument("--preset", help="time at this preset's resolutions and batch (default: 512 px, batch 1)")
    parser.add_argument("--json", action="store_true", help="print the JSON result instead of the report")
    parser.set_defaults(handler=run_selftest)


def token_spec(preset_name: str | None) -> tuple[str, int]:
    """("image,text;..." token counts per sample, batch size) for the preset's resolutions."""
    if not preset_name:
        return f"{(512 // 16) ** 2},{TEXT_TOKENS}", 1
    config = load_preset(preset_name).config
    process = config["config"]["process"][0]
    sizes = sorted({int(r) for d in process.get("datasets", []) for r in (d.get("resolution") or [512])})
    batch = int((process.get("train") or {}).get("batch_size", 1))
    return ";".join(f"{(size // 16) ** 2},{TEXT_TOKENS}" for size in sizes or [512]), batch


def run_selftest(args) -> int:
    workdir = Workdir(args.workdir.resolve())
    python = venv_python(workdir.venv)
    if not python.is_file() or not (workdir.trainer / "toolkit").is_dir():
        raise LauncherError(f"{workdir.root} has no trainer checkout or venv: run `python -m launcher setup` first")
    tokens, batch = token_spec(args.preset)
    partial = workdir.selftest.with_suffix(".partial.json")
    env = {"TRITON_CACHE_DIR": str(workdir.triton_cache), "TRITON_CACHE_AUTOTUNING": "1"}
    say(f"self-test with {python} (Triton's kernels and autotuning results are kept in {workdir.triton_cache})")
    result = run_module(python, "selftest", "--trainer", str(workdir.trainer), "--out", str(partial),
                        "--tokens", tokens, "--batch", str(batch), env=env)
    if result.returncode != 0 or not partial.is_file():
        raise LauncherError(f"the self-test stopped with exit code {result.returncode}; its output is above. "
                            f"Nothing was written to {workdir.selftest}")
    report = json.loads(partial.read_text(encoding="utf-8"))
    report["sampling"] = sampling_check(workdir, python, env)
    report.update(launcher=__version__, trainer=trainer_build(workdir), driver=gpu_driver_version())
    partial.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    os.replace(partial, workdir.selftest)  # a reader never sees half a verdict
    if args.json:
        print(json.dumps(report, indent=2), flush=True)
    else:
        print("\n".join(format_report(report, workdir.selftest)), flush=True)
    return 0


def sampling_check(workdir: Workdir, python: Path, env: dict) -> dict:
    """Sample the tiny 4-bit FLUX.2 in a process of its own, killed after SAMPLING_LIMIT_S."""
    manifest = tiny.ensure_assets(workdir.assets / "tiny", workdir.trainer, python)
    folder = workdir.root / "cache" / "selftest-sampling"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiny.json").write_text(json.dumps(manifest), encoding="utf-8")
    out = folder / "result.json"
    out.unlink(missing_ok=True)
    say(f"sampling check: the tiny FLUX.2 at 4 bits, at most {SAMPLING_LIMIT_S} s")
    env = {**env, "AITK_QUANT_CACHE_DIR": str(folder / "quantized"), "AITK_TEXT_CACHE_DIR": str(folder / "text")}
    try:
        run_module(python, "selftest_sampling", "--trainer", str(workdir.trainer), "--assets", str(folder / "tiny.json"),
                   "--out", str(out), env=env, timeout=SAMPLING_LIMIT_S)
    except subprocess.TimeoutExpired:
        return {"passed": False, "error": f"did not finish in {SAMPLING_LIMIT_S} s (a driver deadlock looks like this)"}
    try:
        return json.loads(out.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"passed": False, "error": "the sampling check stopped without a result; its output is above"}


def format_report(report: dict, path: Path) -> list[str]:
    """The self-test as plain text, meant to be pasted whole into a bug report."""
    env = report["environment"]
    trainer = report.get("trainer") or {}
    backend = f"HIP {env['hip']}" if env.get("hip") else f"CUDA {env.get('cuda')}"
    lines = [
        f"flux2-24gb self-test (launcher {report.get('launcher')}), {report.get('created')}",
        f"machine   {env['platform']}, Python {env['python']}",
        f"torch     {env['torch']} ({backend}), Triton {env.get('triton') or 'does not import: ' + env.get('triton_error', '?')}",
        gpu_line(env, report.get("driver")),
        f"trainer   {trainer.get('target')} {str(trainer.get('commit'))[:10]} + {trainer.get('patch_count')} patches, "
        f"overlay {str(trainer.get('overlay'))[:10]}",
    ]
    lines += section("kernels against the plain-PyTorch reference", [c for c in report["checks"] if "candidate" in c])
    lines += section("8-bit activations against bf16 activations (reference path)",
                     [c for c in report["checks"] if "check" in c])
    lines.append("  (`qtype: auto` never picks a format that fails here; naming int4_w4a8 and\n"
                 "   INT4_W4A8_ACT in a preset still uses it)")
    lines += training_lines(report, on_gpu=env.get("gpu") is not None)
    lines += timing_lines(report)
    lines += sampling_lines(report)
    lines += streaming_lines(report.get("streaming"))
    lines += [""] + verdict_lines(report) + [f"written to {path}"]
    return lines


def gpu_line(env: dict, driver: str | None) -> str:
    gpu = env.get("gpu")
    if not gpu:
        return "gpu       NONE: torch sees no GPU, so only the reference path (CPU) was checked; nothing was timed"
    fp8 = "yes" if env.get("fp8_units") else "no (8-bit paths use int8)"
    return f"gpu       {gpu['name']}, {gpu['vram_gib']} GiB, {gpu['arch']}, driver {driver or 'unknown'}, FP8 units: {fp8}"


def section(title: str, checks: list) -> list[str]:
    lines = ["", title] + ([] if checks else ["  not run (they need a GPU and Triton)"])
    for check in checks:
        name = check.get("candidate") or check["check"]
        verdict = "pass" if check["passed"] else "FAIL"
        detail = (f"max relative error {check['max_relative_error']:.1e} (limit {check['tolerance']:.0e})"
                  if "max_relative_error" in check else check.get("error", ""))
        lines.append(f"  {name:<34} {verdict}  {detail}")
    return lines


def training_lines(report: dict, on_gpu: bool) -> list[str]:
    lines = ["", f"3 LoRA steps on the tiny FLUX.2 ({'GPU' if on_gpu else 'CPU, reference path'})"]
    for row in report.get("training", []):
        losses = row.get("losses") or []
        detail = f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else row.get("error", "")
        lines.append(f"  {row['candidate']:<34} {'pass' if row['passed'] else 'FAIL'}  {detail}")
    return lines


def sampling_lines(report: dict) -> list[str]:
    sampling = report.get("sampling")
    if sampling is None:
        return ["", "sampling (wall 6): not checked by this self-test"]
    detail = (f"{sampling.get('size')} px, {sampling.get('steps')} steps, strengths 0 and 1 on the "
              f"{sampling.get('device')} in {sampling.get('seconds')} s" if "seconds" in sampling else sampling.get("error", ""))
    return ["", "sampling the tiny 4-bit FLUX.2 (wall 6; `sample_every` in training needs a pass)",
            f"  {'pass' if sampling.get('passed') else 'FAIL'}  {detail}"]


def timing_lines(report: dict) -> list[str]:
    lines = []
    for shape in report.get("timing", []):
        lines += ["", f"FLUX.2 [dev] block Linears of one step at {shape['image_tokens']} image + "
                      f"{shape['text_tokens']} text tokens x batch {shape['batch']} (2 forwards + 1 input gradient each)"]
        base = next((r["step_ms"] for r in shape["results"] if r["candidate"] == "bf16"), None)
        for row in shape["results"]:
            ratio = f"{row['step_ms'] / base:.2f}x bf16" if base else ""
            lines.append(f"  {row['candidate']:<34} {row['step_ms']:8.1f} ms  {row['tflops']:6.1f} TFLOP/s  {ratio}")
    return lines


def streaming_lines(streaming: dict | None) -> list[str]:
    lines = ["", "overlapped block streaming (copies on a side stream during kernels: wall 5)"]
    if not streaming:
        return lines + ["  not run"]
    if not streaming.get("completed"):
        return lines + [f"  FAIL  {streaming.get('reason')}", "  presets with `stream_mode: auto` stream serialized"]
    verdict = "pass" if streaming.get("passed") else "FAIL"
    lines.append(f"  {verdict}  {streaming['steps']} steps in {streaming['seconds']} s on the {streaming['device']}"
                 f"{'' if streaming.get('passed') else ': ' + str(streaming.get('reason'))}")
    uses = "overlapped" if streaming.get("passed") and streaming.get("device") == "cuda" else "serialized"
    return lines + [f"  presets with `stream_mode: auto` stream {uses}"]


def verdict_lines(report: dict) -> list[str]:
    fastest = report.get("fastest") or {}
    if fastest.get("qtype"):
        ratio = f", {fastest['x_bf16']:.2f}x the bf16 time" if fastest.get("x_bf16") else ""
        env = " ".join(f"{k}={v}" for k, v in (fastest.get("env") or {}).items())
        return [f"fastest that passed: {fastest['qtype']} ({fastest['candidate']}){ratio}",
                f"presets with `qtype: auto` use it{' with ' + env if env else ''}"]
    return [f"fastest that passed: none ({fastest.get('reason')})",
            "presets with `qtype: auto` use uint4 (the fork's torchao path)"]
