"""What `doctor` and `report` gather about this machine for a bug report: platform, the trainer
venv's torch and GPUs, the allocator's settings, memory, disk, the stored self-test, and the
settings known to break training here, each with what to do instead."""

import os
import platform

from launcher import __version__
from launcher.envs.hostinfo import free_disk_gib, memory_gib
from launcher.envs.probe import probe_with
from launcher.envs.rocm_windows_toolchain import ENV_FILE, INTEGRATED_ARCHS, Host, doctor_facts
from launcher.envs.workdir import Workdir, venv_python
from launcher.selftest.verdict import load_result, rocm_runtime, staleness, summary_line

ALLOCATOR_VARIABLES = ("PYTORCH_HIP_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
# HIP runtimes on which Tensor.to() hangs in hsaKmtMemoryVaMap with expandable segments
# (pytorch/pytorch#192259: seen with 7.14, not with 7.2).
EXPANDABLE_SEGMENTS_HANG_HIP = ("7.14",)
MIN_FREE_DISK_GIB = 40  # quantized cache (~18 GB) + latent/text-embedding caches + checkpoints


def collect(workdir: Workdir) -> dict:
    torch_info = probe_torch(workdir)
    report = {
        "launcher": __version__,
        "platform": {"system": platform.system(), "release": platform.release(), "machine": platform.machine(),
                     "python": platform.python_version()},
        "workdir": str(workdir.root),
        "torch": torch_info,
        "allocator": {name: os.environ.get(name) for name in ALLOCATOR_VARIABLES},
        "memory_gib": memory_gib(),
        "free_disk_gib": free_disk_gib(workdir.root),
        "selftest": selftest_state(workdir),
    }
    if torch_info.get("hip") and report["platform"]["system"] == "Windows":
        report["rocm_windows"] = doctor_facts(workdir.venv, Host.this())
    report["warnings"] = known_problems(report)
    return report


def selftest_state(workdir: Workdir) -> dict:
    """The stored self-test in one line, and whether it still describes this workdir."""
    result = load_result(workdir)
    return {"summary": summary_line(result), "stale": staleness(result, workdir) if result else None,
            "fastest": (result or {}).get("fastest"), **rocm_runtime(result)}


def probe_torch(workdir: Workdir) -> dict:
    """Ask the trainer venv's torch, in-process, what it sees (wall 10)."""
    python = venv_python(workdir.venv)
    if not python.is_file():
        return {"error": f"no trainer venv at {workdir.venv}; run `python -m launcher setup`"}
    return probe_with(python)


def known_problems(report: dict) -> list[str]:
    """Settings known to break training on this platform, each with what to do instead."""
    problems = []
    hip = report["torch"].get("hip")
    windows = report["platform"]["system"] == "Windows"
    if hip and windows:
        problems.append(
            "ROCm on Windows: keep `layer_offloading: false` (block swap deadlocks the HIP driver, wall 5) "
            "and `disable_sampling: true` (wall 6); the shipped 7900 XTX presets do"
        )
    allocator = " ".join(value or "" for value in report["allocator"].values())
    if hip and any(str(hip).startswith(bad) for bad in EXPANDABLE_SEGMENTS_HANG_HIP):
        problems.append(
            f"HIP {hip}: Tensor.to() can hang with expandable_segments (pytorch/pytorch#192259); "
            "`run` sets it for wall 7, so set `launcher: {allocator: default}` in the preset or use another ROCm release"
            + (" (it is set in this shell now)" if "expandable_segments:True" in allocator else "")
        )
    problems += rocm_windows_problems(report)
    if report["torch"].get("torch") and not report["torch"].get("gpu_available"):
        problems.append("torch sees no GPU: training will run on the CPU (only the tiny preset is meant for that)")
    if report["selftest"]["stale"]:
        problems.append(f"selftest.json is stale ({report['selftest']['stale']}): `qtype: auto` presets train on "
                        "uint4 until `python -m launcher selftest` runs again")
    if report["selftest"].get("convolution_failed"):
        problems.append("the self-test's VAE-sized convolution failed in MIOpen/cuDNN (ROCm/ROCm#5941 on Windows): "
                        "the first launch's VAE encode retries without it, slower, and says so in one line")
    if report["free_disk_gib"] < MIN_FREE_DISK_GIB:
        problems.append(
            f"only {report['free_disk_gib']} GiB free at {report['workdir']}; a full FLUX.2 run needs about "
            f"{MIN_FREE_DISK_GIB} GiB for the quantized cache, the latent cache and checkpoints"
        )
    memory = report["memory_gib"]
    if memory.get("ram_total") and memory["ram_total"] + (memory.get("swap_total") or 0) < 48:
        problems.append(
            "RAM + swap/pagefile is under 48 GiB: loading the 24B text encoder may run out of host memory; "
            "grow the pagefile/swap"
        )
    return problems


def rocm_windows_problems(report: dict) -> list[str]:
    """One line per Windows ROCm pitfall of Triton (docs/amd.md), each with its fix."""
    facts = report.get("rocm_windows")
    if not facts:
        return []
    problems = []
    if not facts["build_tools"][0]:
        problems.append(facts["build_tools"][1])
    if not facts["stored_env"]:
        problems.append(f"no {ENV_FILE} in the trainer venv: Triton gets no ROCM_HOME, clang-cl or GPU pick; "
                        "run `python -m launcher setup` again")
    elif facts["missing_folders"]:
        problems.append(f"the stored ROCm toolchain names folders that are gone ({', '.join(facts['missing_folders'])}); "
                        "run `python -m launcher setup` again")
    if facts["startup_triton"]:
        problems.append(f"{', '.join(facts['startup_triton'])} imports triton at every Python start, before torch "
                        "(TheRock's ROCm then fails to load torch's HIP DLLs, triton-windows#35): remove that line")
    integrated = [gpu for gpu in report["torch"].get("gpus") or [] if str(gpu.get("arch", "")).split(":")[0]
                  in INTEGRATED_ARCHS]
    if integrated:
        how = (f"{', '.join(f'{k}={v}' for k, v in facts['user_devices'].items())} in this shell still shows it: "
               "set it to the discrete card's index" if facts["user_devices"]
               else "run `python -m launcher setup` again (it sets HIP_VISIBLE_DEVICES) or set HIP_VISIBLE_DEVICES "
                    "to the discrete card's index")
        problems.append(f"the integrated GPU {integrated[0]['name']} is visible to the trainer (its kernels fail "
                        f"with hipErrorInvalidImage when it is device 0, ROCm/TheRock#5543): {how}")
    return problems
