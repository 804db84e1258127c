"""The embedded tiny FLUX.2, from the launcher's side: build it once per workdir and seed.

The assets themselves are built by `launcher.in_trainer.tiny_assets` under the trainer's
interpreter (it needs torch and the fork's classes); this module starts that build and reads
its manifest, resolving the manifest's relative names against the assets folder. A tiny preset
of another family gets that family's tiny recipe (flux2_contract/families.py), in a folder of its own.
"""

from pathlib import Path

from flux2_contract import families
from flux2_contract.families import TinyRecipe
from launcher.envs.trainer_python import run_module
from launcher.errors import LauncherError
from launcher.in_trainer import tiny_assets
from launcher.progress import step

DEFAULT_SEED = tiny_assets.DEFAULT_SEED


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
    """The tiny model of a tiny preset's `arch` (its family's recipe), built once in its own folder under `assets`."""
    family = families.FAMILIES.get(arch) if isinstance(arch, str) else None
    if family is None or family.tiny is None:
        tiny_arches = sorted(name for name, known in families.FAMILIES.items() if known.tiny is not None)
        raise LauncherError(f"a tiny preset's model.arch is {arch!r}; the tiny model exists for "
                            f"{' and '.join(tiny_arches)}: set model.arch to one of them")
    return ensure_assets(assets / family.tiny.folder, trainer, python, seed, family.tiny)


def ensure_assets(out: Path, trainer: Path, python: Path, seed: int = DEFAULT_SEED,
                  recipe: TinyRecipe = families.FLUX2_DEV.tiny) -> dict:
    """Build the tiny model of `recipe` (the tiny FLUX.2 unless told) into `out` once per seed, with the
    trainer's interpreter; its manifest."""
    manifest = read_manifest(out, seed)
    if manifest is not None:
        return manifest
    with step(f"building {recipe.label}"):
        result = run_module(python, "tiny_assets", "--trainer", str(trainer.resolve()),
                            "--out", str(out.resolve()), "--seed", str(seed), "--builder", recipe.builder)
    manifest = read_manifest(out, seed)
    if result.returncode != 0 or manifest is None:
        raise LauncherError(f"building {recipe.label} in {out} failed (exit {result.returncode}); see above")
    return manifest
