"""Where things live inside a workdir (default `.aitk` in the current folder)."""

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_WORKDIR = Path(".aitk")


@dataclass(frozen=True)
class Workdir:
    root: Path

    @property
    def trainer(self) -> Path:
        """The patched checkout of the trainer."""
        return self.root / "trainer"

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    @property
    def runs(self) -> Path:
        """One folder per training run: rendered config, log, LoRA, checkpoints."""
        return self.root / "runs"

    @property
    def assets(self) -> Path:
        """Generated assets such as the embedded tiny FLUX.2."""
        return self.root / "assets"

    @property
    def quantized_cache(self) -> Path:
        """The quantized transformers (wall 8), reused by every run of this workdir."""
        return self.root / "cache" / "quantized"

    @property
    def text_cache(self) -> Path:
        """Prompt embeddings of the text phase (walls 3-4), reused by every run of this workdir."""
        return self.root / "cache" / "text"

    @property
    def state_file(self) -> Path:
        """What setup last applied (target, commit, patch hashes)."""
        return self.root / "setup-state.json"


def venv_python(venv: Path, windows: bool | None = None) -> Path:
    """The interpreter inside a venv: Scripts\\python.exe on Windows, bin/python elsewhere."""
    if windows is None:
        windows = os.name == "nt"
    return venv / "Scripts" / "python.exe" if windows else venv / "bin" / "python"
