"""What torch sees in the trainer's venv, asked from the launcher (see `launcher.in_trainer.probe`)."""

import json
import subprocess
from pathlib import Path

from launcher.envs.trainer_python import run_module


def probe_with(python: Path, timeout: float = 300) -> dict:
    """Run the probe with the trainer venv's interpreter; {"error": ...} when it fails."""
    try:
        result = run_module(python, "probe", capture=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as error:
        return {"error": f"the probe could not run: {error}"}
    if result.returncode != 0:
        return {"error": f"the probe failed: {result.stderr.strip()[-500:]}"}
    return json.loads(result.stdout)
