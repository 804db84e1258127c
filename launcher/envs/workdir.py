"""Where things live inside a workdir (default `.aitk` in the current folder)."""

import os
from dataclasses import dataclass
from pathlib import Path

from launcher.errors import LauncherError
from launcher.user_files import load_json_state

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
    def triton_cache(self) -> Path:
        """Triton's compiled kernels and autotuning results, kept across processes (TRITON_CACHE_DIR)."""
        return self.root / "cache" / "triton"

    @property
    def inductor_cache(self) -> Path:
        """torch.compile's compiled blocks (compile_blocks), kept across launches (TORCHINDUCTOR_CACHE_DIR)."""
        return self.root / "cache" / "inductor"

    @property
    def selftest(self) -> Path:
        """What `selftest` found on this machine; `qtype: auto` reads it."""
        return self.root / "selftest.json"

    @property
    def state_file(self) -> Path:
        """What setup last applied (target, commit, patch hashes)."""
        return self.root / "setup-state.json"


    @property
    def qtypes_cache(self) -> Path:
        """The qtypes the trainer accepts, asked from it once per checkout HEAD."""
        return self.root / "trainer-qtypes.json"

    def folders(self) -> list[Path]:
        """The folders the launcher makes directly inside the workdir."""
        return [self.trainer, self.trainer.with_name("trainer.partial"), self.venv, self.runs, self.assets,
                self.root / "cache", self.root / "rebase"]

    def files(self) -> list[Path]:
        """The files the launcher writes directly inside the workdir."""
        return [self.state_file, self.root / "constraints.txt", self.qtypes_cache]

    def check_is_folder(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise LauncherError(f"the workdir {self.root} is a file; give a folder (--workdir), it is created if missing")

    def check_contained(self) -> None:
        """Refuse a workdir whose entries are links (or junctions) leading out of it, or files
        where a folder belongs: setup would otherwise write, or remove, what they point at."""
        self.check_is_folder()
        root = self.root.resolve()
        for entry in self.folders() + self.files():
            if (entry.is_symlink() or entry.exists()) and root not in entry.resolve().parents:
                raise LauncherError(
                    f"{entry} leads out of the workdir (to {entry.resolve()}); the launcher only writes inside "
                    f"{self.root}. Replace the link by a real folder or file, or choose another --workdir."
                )
        for entry in self.folders():
            if entry.exists() and not entry.is_dir():
                raise LauncherError(f"{entry} is a file where the launcher keeps a folder; move it aside and run again")


def venv_python(venv: Path, windows: bool | None = None) -> Path:
    """The interpreter inside a venv: Scripts\\python.exe on Windows, bin/python elsewhere."""
    if windows is None:
        windows = os.name == "nt"
    return venv / "Scripts" / "python.exe" if windows else venv / "bin" / "python"


def read_state(state_file: Path) -> dict:
    """The recorded state; {} when the file is missing or damaged (setup then rewrites it).
    Here, not in launcher.patching, so that code the trainer's venv imports needs no gitpython."""
    return load_json_state(state_file)
