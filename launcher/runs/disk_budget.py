"""What a run will still write to disk, on which volume, counting what already exists.

A run writes the quantized transformer cache (~18 GB for the 32B model, once per workdir),
the latent and text-embedding caches next to the dataset images, and its checkpoints. A
relaunch that finds a valid quantized cache for the same checkpoint, or cached latents, needs
none of that space again: refusing it because the cache it would reuse "needs" 18 GB is wrong.
Each part is counted on the volume it goes to; a volume short of space is named with the parts.
"""

import os
from dataclasses import dataclass
from pathlib import Path

from flux2_contract import qcache_index
from flux2_contract.families import family_of
from launcher.envs.hostinfo import free_disk_gib
from launcher.errors import LauncherError
from launcher.runs.dataset import dataset_images

GIB = 2**30
# 4-bit weights + group scales/zeros: 17.8 GiB for the 64.4 GB bf16 file (bench/RESULTS.md)
QUANTIZED_FRACTION = 0.28
# FLUX.2 VAE latent, 32 channels at 1/8 scale, float32 (generous) per image and resolution
LATENT_BYTES_PER_PIXEL = 32 * 4 / 64
# Mistral embeddings the pipeline keeps: 3 hidden states x 5120 x 512 tokens, bf16
TEXT_EMBEDDING_BYTES = 3 * 5120 * 512 * 2
# LoRA parameters per unit of rank on every FLUX.2 [dev] block Linear (195 M at rank 32)
LORA_PARAMS_PER_RANK = 6.1e6


@dataclass(frozen=True)
class Need:
    what: str
    path: Path
    gib: float  # still to be written
    already: str = ""  # what exists and counts, when it does


def valid_quantized_cache(cache_dir: Path, checkpoint: Path, qtype: str) -> Path | None:
    """A complete cache file in cache_dir made from this very checkpoint for this qtype, or None.

    Asked from the trainer's own cache code (`flux2_contract/qcache_index.py`, stdlib only,
    imported here without torch), so the file name, key, checkpoint fingerprint and the
    qtype whose file a qtype loads (int4_w4a8 -> int4_fused) are the trainer's, not a copy. The
    trainer still checks every byte when it loads the file.
    """
    return qcache_index.find_valid_cache(cache_dir, checkpoint, qtype)


def _dataset_needs(dataset: dict, text_embeddings: bool) -> list[Need]:
    folder = Path(dataset["folder_path"])
    images = dataset_images(folder) if folder.is_dir() else []  # subfolders too, as the trainer walks them
    needs = []
    parts = []
    if dataset.get("cache_latents_to_disk"):
        pixels = sum(int(r) ** 2 for r in dataset.get("resolution", [512]))
        parts.append(("latent cache", "_latent_cache", pixels * LATENT_BYTES_PER_PIXEL))
    if text_embeddings:
        parts.append(("text-embedding cache", "_t_e_cache", TEXT_EMBEDDING_BYTES))
    for what, subfolder, per_image in parts:
        cached = sum(1 for image in images if any((image.parent / subfolder).glob(f"{image.stem}_*.safetensors")))
        missing = len(images) - cached
        needs.append(Need(what, folder, missing * per_image / GIB,
                          f"{cached} of {len(images)} images cached" if cached else ""))
    return needs


def _checkpoint_need(process: dict, run_root: Path) -> Need:
    rank = int(process.get("network", {}).get("linear") or 16)
    optimizer = str(process.get("train", {}).get("optimizer", "adamw")).lower()
    params = rank * LORA_PARAMS_PER_RANK
    # bf16 LoRA + two optimizer moments (8-bit, or float32)
    per_save = params * (2 + (2 if "8bit" in optimizer else 8))
    keep = int(process.get("save", {}).get("max_step_saves_to_keep") or 4)
    saved = [*run_root.rglob("*.safetensors"), *run_root.rglob("*.pt")] if run_root.is_dir() else []
    existing = sum(p.stat().st_size for p in saved)
    gib = max(per_save, (keep + 1) * per_save - existing) / GIB
    return Need(f"checkpoints ({keep} kept)", run_root, gib, f"{existing / GIB:.1f} GiB there" if existing else "")


def run_needs(config: dict, run_root: Path, cache_dir: Path) -> list[Need]:
    """Every part a full-size run will write, with what already exists subtracted."""
    needs = []
    for process in config["config"]["process"]:
        model = process["model"]
        checkpoint = Path(model["name_or_path"]) / family_of(model.get("arch")).transformer_file
        if model.get("quantize") and model.get("model_kwargs", {}).get("quantized_cache", True):
            found = valid_quantized_cache(cache_dir, checkpoint, str(model.get("qtype", "qfloat8")))
            size = checkpoint.stat().st_size * QUANTIZED_FRACTION / GIB if checkpoint.is_file() else 18.0
            needs.append(Need("quantized transformer cache", cache_dir, 0.0 if found else size,
                              f"valid cache {found.name}" if found else ""))
        text_embeddings = bool(process.get("train", {}).get("cache_text_embeddings"))
        for dataset in process.get("datasets", []):
            needs += _dataset_needs(dataset, text_embeddings)
        needs.append(_checkpoint_need(process, run_root))
    return needs


def _volume(path: Path):
    for candidate in [path, *path.parents]:
        if candidate.exists():
            return os.stat(candidate).st_dev
    return None


def check_free_disk(needs: list[Need], margin_gib: float = 1.0) -> None:
    """Refuse, before anything starts, a volume that cannot hold what will be written to it."""
    volumes: dict = {}
    for need in needs:
        volumes.setdefault(_volume(need.path), []).append(need)
    for group in volumes.values():
        total = sum(n.gib for n in group)
        free = free_disk_gib(group[0].path)
        if free < total + margin_gib:
            parts = "; ".join(
                f"{n.what} at {n.path}: {n.gib:.1f} GiB" + (f" ({n.already})" if n.already else "") for n in group
            )
            raise LauncherError(
                f"only {free} GiB free on the volume of {group[0].path}, and this run still has to write about "
                f"{total:.1f} GiB there ({parts}). Free some space, or put the output (--output), the quantized "
                "cache (AITK_QUANT_CACHE_DIR) or the dataset on another volume"
            )
