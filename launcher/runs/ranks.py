"""`run --gpus N`: one trainer process per GPU, started by torchrun, data-parallel LoRA training.

torchrun (`python -m torch.distributed.run`, part of the trainer venv's torch) starts the ranks
and sets what accelerate reads to join them (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT);
its agent stops every rank when one fails and names the one that failed first. The trainer side
is toolkit/data_parallel.py. Checked here, before anything starts: the platform has a backend and
there are N visible GPUs (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES respected); with no GPU at
all the N ranks run on the CPU over gloo (what the tests do).
"""

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from launcher.errors import LauncherError

VISIBLE_VARIABLES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
WINDOWS = ("--gpus {n}: no multi-GPU backend on Windows (PyTorch has no NCCL there: "
           "https://pytorch.org/docs/stable/distributed.html; ROCm on Windows is PyTorch only, no RCCL: "
           "https://rocm.docs.amd.com/projects/radeon-ryzen/en/docs-7.1/docs/limitations/limitationsryz.html); "
           "give --gpus 1, or train on Linux")


@dataclass(frozen=True)
class Ranks:
    count: int
    device: str  # "cuda", "rocm" or "cpu"
    lines: tuple[str, ...] = ()
    cards: tuple[dict, ...] = ()  # the GPUs the ranks use, as the trainer's torch reports them

    @property
    def backend(self) -> str:
        return {"cuda": "NCCL", "rocm": "RCCL", "cpu": "gloo"}[self.device]

    def env(self) -> dict[str, str]:
        """ACCELERATE_USE_CPU makes accelerate join CPU ranks over gloo (it looks for a GPU otherwise)."""
        return {"ACCELERATE_USE_CPU": "true"} if self.count > 1 and self.device == "cpu" else {}

    def command(self, python: Path, config: Path) -> list[str]:
        """The trainer's command line: run.py directly for one rank, torchrun for more."""
        if self.count == 1:
            return [str(python), "-u", "run.py", str(config)]
        return [str(python), "-u", "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.count}",
                "--max-restarts=0", "run.py", str(config)]


def visible_limit(env: dict[str, str]) -> int | None:
    """How many GPUs CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES leave (the fewer), None when unset."""
    counts = [len([item for item in env[name].split(",") if item.strip()]) for name in VISIBLE_VARIABLES
              if env.get(name) is not None]
    return min(counts) if counts else None


def plan(count: int, torch_info: dict, env: dict[str, str], platform: str = sys.platform) -> Ranks:
    """The ranks of a run, or one line saying why not, before anything starts."""
    if count == 1:
        return Ranks(1, "cpu")
    if platform == "win32":
        raise LauncherError(WINDOWS.format(n=count))
    if torch_info.get("error"):
        raise LauncherError(f"--gpus {count}: the trainer's torch could not be asked for its GPUs: {torch_info['error']}")
    gpus = torch_info.get("gpus") or []
    limit = visible_limit(env)
    seen = len(gpus) if limit is None else min(limit, len(gpus))
    if not gpus:
        return Ranks(count, "cpu", (f"--gpus {count}: no GPU visible, {count} ranks on the CPU over gloo",))
    if count > seen:
        hidden = "" if limit is None else f" ({', '.join(n for n in VISIBLE_VARIABLES if n in env)} leaves {limit})"
        raise LauncherError(f"--gpus {count}: only {seen} GPU(s) visible{hidden}; give --gpus {seen} or fewer")
    device = "rocm" if torch_info.get("hip") else "cuda"
    cards = gpus[:count]
    lines = [f"--gpus {count}: {count} ranks over {Ranks(count, device).backend}, one per GPU; each plans its own card"]
    if len({(card.get("name"), card.get("vram_total_gib")) for card in cards}) > 1:
        named = ", ".join(f"GPU {i} {card.get('name')} {card.get('vram_total_gib')} GiB" for i, card in enumerate(cards))
        lines.append(f"the cards differ ({named}): each streams what its own plan says, and every step waits "
                     "for the slowest card")
    return Ranks(count, device, tuple(lines), tuple(cards))


ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*"
                        r"exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)", re.S)


def first_failure(log_tail: str) -> str | None:
    """One line naming the rank whose exit stopped the others, from torchrun's failure report."""
    found = ROOT_CAUSE.search(log_tail)
    if not found:
        return None
    rank, local, code, pid = found.groups()
    how = f"signal {-int(code)}" if int(code) < 0 else f"exit code {code}"
    return f"rank {rank} (local rank {local}, pid {pid}) ended with {how}; torchrun stopped the other ranks"
