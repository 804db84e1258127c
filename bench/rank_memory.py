#!/usr/bin/env python3
"""Host memory of each rank of `launcher run --gpus N`, against one rank (Linux: reads /proc).

Runs PRESET once per rank count of `--gpus` (default 1 and 2), each into a fresh output folder
of OUT with fresh caches, and samples every trainer process (the ones running `run.py`; with N
ranks, torchrun's agent is sampled apart) every 0.2 s from /proc/PID/smaps_rollup: the peaks of
its anonymous bytes (heap, and pinned host memory on a GPU), its file-backed resident bytes
(libraries, the quantized cache read through mmap), its share of them (Pss: a page N processes
map counts 1/N to each) and the peak of the sum of Pss over the tree, which is what the machine
pays. One JSON row per process and launch:

    python -m bench.rank_memory --workdir W --out OUT [--preset presets/tiny.yaml] [--gpus 1,2]
    python -m bench.rank_memory --workdir W --out OUT -- --dataset D      # more `launcher run` arguments

With no GPU the ranks train on the CPU over gloo, the model's weights in each rank's anonymous
memory; on a GPU they would be on the card, and only the streamed blocks stay on the host. What a
GPU adds to every process's host memory (the CUDA or HIP runtime, its kernels and handles) is
measured apart, on the GPU machine, by a process that does what a rank's first step does (a
bf16 matmul, attention, a convolution, a backward pass):

    python -m bench.rank_memory --gpu-runtime
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench._children import descendants

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
FIELDS = {"Anonymous:": "anon", "Pss:": "pss", "Rss:": "rss", "Pss_File:": "pss_file", "Shmem:": "shmem"}


def rollup(pid: int) -> dict:
    """The smaps_rollup figures of FIELDS in bytes, plus the file-backed resident bytes."""
    figures = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        parts = line.split()
        if parts and parts[0] in FIELDS:
            figures[FIELDS[parts[0]]] = int(parts[1]) * 1024
    figures["file"] = figures["rss"] - figures["anon"] - figures.get("shmem", 0)
    return figures


def role(pid: int) -> str | None:
    """"rank R" for a trainer process (its RANK variable, 0 without one), "agent" for torchrun's."""
    command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    if b"torch.distributed.run" in command:
        return "agent"
    if b"run.py" not in command:
        return None
    variables = dict(item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item)
    return f"rank {int(variables.get(b'RANK', b'0'))}"


def sample(child: subprocess.Popen) -> tuple[dict, int]:
    """Peak figures per role while `child` runs, and the peak of the tree's summed Pss."""
    peaks: dict[str, dict] = {}
    roles: dict[int, str | None] = {}
    tree_peak = 0
    while child.poll() is None:
        tree = 0
        for pid in descendants(child.pid):
            try:
                roles.setdefault(pid, role(pid))
                figures = rollup(pid)
            except (OSError, KeyError, ValueError):
                continue
            tree += figures["pss"]
            if roles[pid]:
                peak = peaks.setdefault(roles[pid], {})
                for key, value in figures.items():
                    peak[key] = max(peak.get(key, 0), value)
        tree_peak = max(tree_peak, tree)
        time.sleep(0.2)
    return peaks, tree_peak


def launch(workdir: Path, preset: Path, output: Path, gpus: int, extra: list[str]) -> list[dict]:
    """One run of `preset` with `gpus` ranks and caches of its own; a row per sampled process."""
    data = yaml.safe_load(preset.read_text(encoding="utf-8"))
    kwargs = data["config"]["process"][0]["model"].setdefault("model_kwargs", {})
    kwargs.update(quantized_cache_dir=str(output / "caches" / "quantized"),
                  text_embedding_cache_dir=str(output / "caches" / "text"))
    own = output / preset.name
    own.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    command = [sys.executable, "-m", "launcher", "run", str(own), "--workdir", str(workdir), "--output",
               str(output / "runs"), "--gpus", str(gpus), *extra]
    started = time.monotonic()
    log = (output / "launcher.log").open("w", encoding="utf-8")
    with log:
        child = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        peaks, tree_peak = sample(child)
    wall = round(time.monotonic() - started, 1)
    rows = [{"gpus": gpus, "process": name, "rc": child.returncode, "wall_s": wall,
             **{f"peak_{key}_gib": round(value / GIB, 3) for key, value in sorted(figures.items())}}
            for name, figures in sorted(peaks.items())]
    return rows + [{"gpus": gpus, "process": "all (sum of Pss)", "rc": child.returncode, "wall_s": wall,
                    "peak_pss_gib": round(tree_peak / GIB, 3)}]


def gpu_runtime() -> dict:
    """Anonymous and resident bytes of this process before and after the GPU runtime's first use."""
    import torch

    before = rollup(os.getpid())
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q = torch.randn(1, 24, 1024, 128, device="cuda", dtype=torch.bfloat16)
    image = torch.randn(1, 128, 256, 256, device="cuda", dtype=torch.bfloat16)
    conv = torch.nn.Conv2d(128, 128, 3, padding=1).to("cuda", torch.bfloat16)
    loss = (x @ x).float().mean() + torch.nn.functional.scaled_dot_product_attention(q, q, q).float().mean()
    loss = loss + conv(image).float().mean()
    loss.backward()
    torch.cuda.synchronize()
    after = rollup(os.getpid())
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            **{f"{key}_gib": round((after[key] - before[key]) / GIB, 3) for key in ("anon", "file", "rss")}}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--gpu-runtime"]:
        print(json.dumps(gpu_runtime()))
        return 0
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True, help="a workdir made by `launcher setup`")
    parser.add_argument("--out", type=Path, required=True, help="a new folder for the runs and rows.jsonl")
    parser.add_argument("--preset", type=Path, default=REPO / "presets" / "tiny.yaml")
    parser.add_argument("--gpus", default="1,2", help="rank counts to run, comma-separated")
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    rows = []
    for gpus in (int(count) for count in args.gpus.split(",")):
        folder = args.out / f"gpus{gpus}"
        folder.mkdir(parents=True, exist_ok=False)
        rows += launch(args.workdir.resolve(), args.preset.resolve(), folder, gpus, extra)
        print("\n".join(json.dumps(row) for row in rows if row["gpus"] == gpus), flush=True)
    (args.out / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return max(row["rc"] for row in rows)


if __name__ == "__main__":
    sys.exit(main())
