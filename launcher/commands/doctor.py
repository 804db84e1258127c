"""`doctor`: what a bug report needs, and the settings known to break this platform."""

import argparse
import json
from pathlib import Path

from launcher.checkup import collect
from launcher.envs.workdir import DEFAULT_WORKDIR, Workdir
from launcher.runs.trainer_env import ALLOCATOR_VARIABLES as SET_BY_RUN
from launcher.runs.trainer_env import EXPANDABLE

EXAMPLES = """examples:
  python -m launcher doctor                  # platform, torch, GPU, memory, disk of .aitk
  python -m launcher doctor --workdir W --json   # one JSON object for a bug report or a program
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser("doctor", help="report platform, torch, GPU, memory, disk, known-bad settings",
                                   epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="default: .aitk")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run_doctor)


def run_doctor(args) -> int:
    report = collect(Workdir(args.workdir.resolve()))
    if args.json:
        print(json.dumps(report, indent=2), flush=True)
    else:
        print_report(report)
    return 0


def print_report(report: dict) -> None:
    torch_info = report["torch"]
    lines = [
        f"launcher        {report['launcher']}",
        f"platform        {report['platform']['system']} {report['platform']['release']} "
        f"{report['platform']['machine']}, Python {report['platform']['python']}",
        f"workdir         {report['workdir']}",
    ]
    if "error" in torch_info:
        lines.append(f"torch           {torch_info['error']}")
    else:
        backend = f"HIP {torch_info['hip']}" if torch_info.get("hip") else f"CUDA {torch_info.get('cuda')}"
        lines.append(f"torch           {torch_info['torch']} ({backend})")
        for gpu in torch_info["gpus"] or [{"name": "none visible"}]:
            vram = f", {gpu['vram_total_gib']} GiB ({gpu['vram_free_gib']} free, read in-process)" if "vram_total_gib" in gpu else ""
            lines.append(f"gpu             {gpu['name']}{vram}")
    for name, value in report["allocator"].items():
        unset = f"(unset; `run` sets {EXPANDABLE})" if name in SET_BY_RUN else "(unset; `run` leaves it unset)"
        lines.append(f"{name:<15} {value if value is not None else unset}")
    memory = report["memory_gib"]
    lines.append(f"host memory     {memory['ram_total']} GiB RAM ({memory['ram_available']} available), "
                 f"{memory['swap_total']} GiB swap/pagefile")
    lines.append(f"free disk       {report['free_disk_gib']} GiB")
    lines.append(f"selftest        {report['selftest']['summary']}")
    if report["selftest"].get("blas"):
        lines.append(f"  rocm_blas     {report['selftest']['blas']}")
    if report["selftest"].get("convolution"):
        lines.append(f"  VAE conv      {report['selftest']['convolution']}")
    lines += [f"warning         {problem}" for problem in report["warnings"]] or ["warnings        none"]
    print("\n".join(lines), flush=True)
