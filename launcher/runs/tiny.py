"""The embedded tiny FLUX.2, from the launcher's side: build it once per workdir and seed.

The assets themselves are built by `launcher.in_trainer.tiny_assets` under the trainer's
interpreter (it needs torch and the fork's classes); this module starts that build and reads
its manifest, resolving the manifest's relative names against the assets folder. A tiny preset
of arch flux2_klein_4b gets the tiny FLUX.2 klein 4B instead, in a folder of its own.
"""

from pathlib import Path

from launcher.envs.trainer_python import run_module
from launcher.errors import LauncherError
from launcher.in_trainer import tiny_assets
from launcher.progress import step

DEFAULT_SEED = tiny_assets.DEFAULT_SEED
FOLDERS = {"flux2": "tiny", "flux2_klein_4b": "tiny_klein"}
"""The arches a tiny model is built for, each with its folder under the workdir's assets."""


def read_manifest(out: Path, seed: int) -> dict | None:
    """The manifest with absolute paths, or None when the assets are stale or absent."""
    manifest = tiny_assets.read_manifest(out, seed)
    if manifest is None:
        return None
    root = out.resolve()
    kwargs = dict(manifest["model_kwargs"])
    kwargs["text_encoder_path"] = inside(root, kwargs["text_encoder_path"])
    return {**manifest, "name_or_path": inside(root, manifest["name_or_path"]),
            "dataset": inside(root, manifest["dataset"]), "model_kwargs": kwargs}


def inside(root: Path, name: str) -> str:
    """A manifest entry as an absolute path; it must stay in the assets folder."""
    path = (root / name).resolve()
    if path != root and root not in path.parents:
        raise LauncherError(f"{root / tiny_assets.MANIFEST_NAME} names {name!r}, outside {root}; "
                            f"delete {root} and run again to rebuild the tiny FLUX.2")
    return str(path)


def ensure_for_arch(assets: Path, arch, trainer: Path, python: Path, seed: int = DEFAULT_SEED) -> dict:
    """The tiny model of a tiny preset's `arch`, built once in its own folder under `assets`."""
    if arch not in FOLDERS:
        raise LauncherError(f"a tiny preset's model.arch is {arch!r}; the tiny model exists for "
                            f"{' and '.join(sorted(FOLDERS))}: set model.arch to one of them")
    return ensure_assets(assets / FOLDERS[arch], trainer, python, seed, klein=arch != "flux2")


def ensure_assets(out: Path, trainer: Path, python: Path, seed: int = DEFAULT_SEED, klein: bool = False) -> dict:
    """Build the tiny FLUX.2 (or klein 4B) into `out` once per seed, with the trainer's
    interpreter; its manifest."""
    manifest = read_manifest(out, seed)
    if manifest is not None:
        return manifest
    what = "the tiny FLUX.2 klein 4B" if klein else "the tiny FLUX.2"
    with step(f"building {what}"):
        result = run_module(python, "tiny_assets", "--trainer", str(trainer.resolve()),
                            "--out", str(out.resolve()), "--seed", str(seed), *(["--klein"] if klein else []))
    manifest = read_manifest(out, seed)
    if result.returncode != 0 or manifest is None:
        raise LauncherError(f"building {what} in {out} failed (exit {result.returncode}); see above")
    return manifest
