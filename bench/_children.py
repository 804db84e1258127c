"""Child processes of the compile benchmarks: fresh compile caches, and a time limit per child."""

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
