"""Run the self-test: the trainer side under the trainer venv's interpreter, then the sampling
check and the compile check, each in a process of its own, side by side; stamp the result with
this launcher, the trainer build and the GPU driver, and keep it in `<workdir>/selftest.json`,
replaced whole.
"""

import json
import subprocess
import time
from pathlib import Path

from launcher import __version__
from launcher.envs.hostinfo import gpu_driver_version
from launcher.envs.trainer_python import run_module, start_module
from launcher.envs.workdir import Workdir, venv_python
from launcher.errors import LauncherError
from launcher.in_trainer.selftest import compiled
from launcher.progress import say
from launcher.runs import tiny
from launcher.runs.presets import load_preset
from launcher.selftest.verdict import trainer_build
from launcher.writer import replace_own

TEXT_TOKENS = 512
"""Text tokens per sample in FLUX.2 training (the bench and the trainer's cached embeddings)."""
SAMPLING_LIMIT_S = 600
"""The sampling check's time limit: the tiny model loads and samples in well under a minute; a
process still running after this is what the HIP driver's sampling deadlock looks like."""


def token_spec(preset_name: str | None) -> tuple[str, int]:
    """("image,text;..." token counts per sample, batch size) for the preset's resolutions."""
    if not preset_name:
        return f"{(512 // 16) ** 2},{TEXT_TOKENS}", 1
    config = load_preset(preset_name).config
    process = config["config"]["process"][0]
    sizes = sorted({int(r) for d in process.get("datasets", []) for r in (d.get("resolution") or [512])})
    batch = int((process.get("train") or {}).get("batch_size", 1))
    return ";".join(f"{(size // 16) ** 2},{TEXT_TOKENS}" for size in sizes or [512]), batch


def run(workdir: Workdir, preset: str | None) -> dict:
    """The stamped report, once it is stored in `workdir.selftest`."""
    python = venv_python(workdir.venv)
    if not python.is_file() or not (workdir.trainer / "toolkit").is_dir():
        raise LauncherError(f"{workdir.root} has no trainer checkout or venv: run `python -m launcher setup` first")
    tokens, batch = token_spec(preset)
    partial = workdir.selftest.with_suffix(".partial.json")
    env = {"TRITON_CACHE_DIR": str(workdir.triton_cache), "TRITON_CACHE_AUTOTUNING": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(workdir.inductor_cache)}
    say(f"self-test with {python} (Triton's kernels and autotuning results are kept in {workdir.triton_cache})")
    result = run_module(python, "selftest.runner", "--trainer", str(workdir.trainer), "--out", str(partial),
                        "--tokens", tokens, "--batch", str(batch), env=env)
    if result.returncode != 0 or not partial.is_file():
        raise LauncherError(f"the self-test stopped with exit code {result.returncode}; its output is above. "
                            f"Nothing was written to {workdir.selftest}")
    report = json.loads(partial.read_text(encoding="utf-8"))
    compiling = start_compile_check(workdir, python, env, report)
    report["sampling"] = sampling_check(workdir, python, env)
    report["compile"] = finish_compile_check(compiling)
    report.update(launcher=__version__, trainer=trainer_build(workdir), driver=gpu_driver_version())
    partial.unlink(missing_ok=True)
    replace_own(workdir.selftest, json.dumps(report, indent=2) + "\n")  # a reader never sees half a verdict
    return report


def sampling_check(workdir: Workdir, python: Path, env: dict) -> dict:
    """Sample the tiny 4-bit FLUX.2 in a process of its own, killed after SAMPLING_LIMIT_S."""
    manifest = tiny.ensure_assets(workdir.assets / "tiny", workdir.trainer, python)
    folder = workdir.root / "cache" / "selftest-sampling"
    folder.mkdir(parents=True, exist_ok=True)
    caches = {"quantized_cache_dir": str(folder / "quantized"), "text_embedding_cache_dir": str(folder / "text")}
    replace_own(folder / "tiny.json", json.dumps({**manifest, "model_kwargs": {**manifest["model_kwargs"], **caches}}))
    out = folder / "result.json"
    out.unlink(missing_ok=True)
    say(f"sampling check: the tiny FLUX.2 at 4 bits, at most {SAMPLING_LIMIT_S} s")
    try:
        run_module(python, "selftest.sampling", "--trainer", str(workdir.trainer), "--assets", str(folder / "tiny.json"),
                   "--out", str(out), env=env, timeout=SAMPLING_LIMIT_S)
    except subprocess.TimeoutExpired:
        return {"passed": False, "error": f"did not finish in {SAMPLING_LIMIT_S} s (a driver deadlock looks like this)"}
    try:
        return json.loads(out.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"passed": False, "error": "the sampling check stopped without a result; its output is above"}


def start_compile_check(workdir: Workdir, python: Path, env: dict, report: dict):
    """Start the compile check (launcher/in_trainer/selftest/compiled.py) with the fastest candidate;
    returns (process, when it started), or the result when it cannot run here."""
    reason = compiled.applicable(report)
    if reason:
        return {"passed": False, "reason": reason}
    candidate = compiled.candidate_from(report["fastest"])
    say(f"compile check: a small FLUX.2 with {candidate['name']}, its blocks compiled against uncompiled, "
        f"at most {compiled.DEADLINE_SECONDS:.0f} s, beside the sampling check")
    process = start_module(python, "selftest.compiled", "--trainer", str(workdir.trainer),
                           "--candidate", json.dumps(candidate), env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, encoding="utf-8",
                           errors="replace")
    return process, time.monotonic()


def finish_compile_check(compiling) -> dict:
    """Wait for the compile check up to its deadline; its verdict, said in one line."""
    if isinstance(compiling, dict):
        return compiling
    process, began = compiling
    try:
        stdout, stderr = process.communicate(timeout=max(1.0, compiled.DEADLINE_SECONDS - (time.monotonic() - began)))
        result = compiled.verdict(stdout, process.returncode, stderr)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        result = {"passed": False, "reason": f"compiling did not finish within {compiled.DEADLINE_SECONDS:.0f} s"}
    if "x_eager" in result:
        say(f"compile check: {'pass' if result['passed'] else 'FAIL'}, {result['compiled_ms']} ms compiled against "
            f"{result['eager_ms']} ms uncompiled ({result['x_eager']:.2f}x), difference "
            f"{result['max_relative_difference']:.1e}, {result['compile_s']:.0f} s to compile"
            + ("" if result["passed"] else f"; {result['reason']}"))
    elif not result["passed"]:
        say(f"compile check: FAIL, {result['reason']}")
    return result
