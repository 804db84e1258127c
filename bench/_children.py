"""Child processes of the benchmarks: fresh compile caches, a time limit per child, and the process
tree under a launch (Linux /proc)."""

import os
import signal
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def fresh_compile_caches(root: Path) -> dict[str, str]:
    """This environment with Inductor's and Triton's caches under `root` (autotuning results cached too)."""
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
            "TRITON_CACHE_DIR": str(root / "triton"), "TRITON_CACHE_AUTOTUNING": "1"}


def run_within(argv: list[str], env: dict[str, str], seconds: float) -> int | None:
    """Run `argv` from the repository in a process group of its own; its exit code, or None when
    `seconds` ran out and the group (the child and its Inductor compile workers) was killed."""
    process = subprocess.Popen(argv, cwd=REPO, env=env, start_new_session=True)
    try:
        return process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return None


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (those that exit while being listed are left out)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        try:
            for task in Path(f"/proc/{current}/task").iterdir():
                children = [int(child) for child in (task / "children").read_text().split()]
                found += children
                todo += children
        except OSError:
            continue
    return found
