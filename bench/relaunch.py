#!/usr/bin/env python3
"""Time to the first step of a launch and of a relaunch through `python -m launcher run` (Linux).

Runs PRESET (default: the tiny one) N times, each into a fresh output folder of OUT, so every
launch after the first finds the workdir's quantized cache and the dataset's latent and
caption caches: a relaunch. For each launch, one JSON row: the launcher's wall time, the
trainer's own figures from run.json (seconds from its start to the first step, peak host RSS),
the largest RSS summed over the trainer and its children (the dataloader workers), sampled
every 0.1 s from /proc, and how long the trainer's interpreter takes to import what the job
needs and build the job (`toolkit.job.get_job` on the launch's rendered config), in wall and
in CPU seconds (the latter moves less on a shared machine).

    python -m bench.relaunch --workdir W --out OUT [--preset presets/tiny.yaml] [--launches 2]
    python -m bench.relaunch --workdir W --out OUT -- --model-dir M --text-encoder T --dataset D

Arguments after `--` go to `launcher run` as they are.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench._children import descendants

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
IMPORT_PROBE = """
import sys, time
started = time.perf_counter()
sys.path.insert(0, ".")
sys.argv = ["run.py", sys.argv[1]]
import run
job = run.get_job(sys.argv[1])
print(round(time.perf_counter() - started, 2), round(time.process_time(), 2), len(sys.modules),
      type(job.process[0]).__name__)
"""


def launch(command: list[str]) -> tuple[int, float, int]:
    """Run the launcher; its exit code, wall seconds and the peak RSS of the trainer's process tree."""
    started = time.monotonic()
    child = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    peak = 0
    while child.poll() is None:
        peak = max(peak, sum(own_rss(pid) for pid in descendants(child.pid)))
        time.sleep(0.1)
    return child.returncode, time.monotonic() - started, peak


def own_rss(pid: int) -> int:
    """One process's RSS (0 for one that just exited)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024
    except (OSError, StopIteration, ValueError):
        return 0


def import_seconds(workdir: Path, config: Path, preset: Path) -> dict:
    """Seconds (and modules) from a fresh trainer interpreter to the built job, in its venv, with
    the preset's `launcher: env:` variables as `run` sets them."""
    from launcher.envs.torchenv import clean_env
    from launcher.envs.workdir import Workdir, venv_python
    from launcher.runs.presets import load_preset

    trainer = Workdir(workdir).trainer
    env = {**clean_env(), "HF_HUB_OFFLINE": "1", **load_preset(str(preset)).env}
    done = subprocess.run([str(venv_python(Workdir(workdir).venv)), "-c", IMPORT_PROBE, str(config)],
                          cwd=trainer, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return {"import_error": done.stderr.strip().splitlines()[-1:]}
    seconds, cpu, modules, process = done.stdout.split()[-4:]
    return {"imports_to_job_s": float(seconds), "imports_cpu_s": float(cpu), "modules": int(modules),
            "process": process}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="a folder for the launches' output folders")
    parser.add_argument("--preset", type=Path, default=REPO / "presets" / "tiny.yaml")
    parser.add_argument("--launches", type=int, default=2)
    parser.add_argument("extra", nargs="*", help="more `launcher run` arguments, after --")
    args = parser.parse_args(argv)
    for n in range(args.launches):
        output = args.out.resolve() / f"launch-{n + 1}"
        command = [sys.executable, "-m", "launcher", "run", str(args.preset.resolve()), "--workdir",
                   str(args.workdir.resolve()), "--output", str(output), *args.extra]
        rc, wall, peak = launch(command)
        run = next(output.glob("*/*/run.json"), None)
        load = json.loads(run.read_text(encoding="utf-8")).get("load", {}) if run else {}
        config = next(output.glob("*/config.yaml"), None)
        row = {"launch": n + 1, "rc": rc, "wall_s": round(wall, 1), "to_first_step_s": load.get("to_first_step_s"),
               "trainer_peak_rss_gib": load.get("host_peak_rss_gib"), "tree_peak_rss_gib": round(peak / GIB, 2),
               **(import_seconds(args.workdir.resolve(), config, args.preset) if config else {})}
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
