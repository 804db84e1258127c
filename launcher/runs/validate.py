"""Checks on a rendered run, before anything heavy starts; each failure says how to fix it.

Known config keys are read from the trainer's own source (the `kwargs.get('key'` of each
config class in toolkit/config_modules.py and the `get_conf('key'` of the train processes),
so the list follows whatever commit the lock pins.
"""

import json
import os
import re
import struct
from pathlib import Path

from launcher.envs.hostinfo import free_disk_gib
from launcher.errors import LauncherError
from launcher.progress import say
from launcher.runs.files import TEXT_ENCODER_RECORD
from launcher.suggest import did_you_mean

TRANSFORMER_FILE = "flux2-dev.safetensors"
VAE_FILE = "ae.safetensors"
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp"}
MAX_HEADER_BYTES = 100 * 2**20
# The quantized transformer cache (~18 GB for the 32B model) plus latents and checkpoints.
FULL_MODEL_BYTES = 30 * 2**30
FREE_DISK_NEEDED_GIB = 25

SECTION_CLASSES = {
    "model": "ModelConfig",
    "train": "TrainConfig",
    "network": "NetworkConfig",
    "save": "SaveConfig",
    "sample": "SampleConfig",
    "logging": "LoggingConfig",
    "datasets": "DatasetConfig",
}
PROCESS_SOURCES = (
    "jobs/process/BaseProcess.py",
    "jobs/process/BaseTrainProcess.py",
    "jobs/process/BaseSDTrainProcess.py",
    "extensions_built_in/sd_trainer/SDTrainer.py",
)
PROCESS_EXTRA = {"type"}  # read by the job to pick the process class


def known_keys(trainer: Path) -> dict[str, set[str]]:
    """{section: keys the trainer reads}; section "process" is the process level."""
    source = (trainer / "toolkit" / "config_modules.py").read_text(encoding="utf-8")
    classes = {
        match.group(1): match.start() for match in re.finditer(r"^class (\w+)", source, re.M)
    }
    bounds = sorted(classes.values()) + [len(source)]
    keys: dict[str, set[str]] = {}
    for section, name in SECTION_CLASSES.items():
        start = classes[name]
        body = source[start : bounds[bounds.index(start) + 1]]
        keys[section] = set(re.findall(r"kwargs\.get\(\s*['\"](\w+)['\"]", body))
    process: set[str] = set(PROCESS_EXTRA)
    for relative in PROCESS_SOURCES:
        path = trainer / relative
        if path.is_file():
            text = path.read_text(encoding="utf-8")
            process |= set(re.findall(r"get_conf\(\s*['\"](\w+)", text))
    keys["process"] = process
    return keys


def unknown_keys(config: dict, known: dict[str, set[str]]) -> list[str]:
    """Messages for keys the trainer would silently ignore, each with the closest known key."""
    messages = []
    for index, process in enumerate(config["config"]["process"]):
        where = f"config.process[{index}]"
        messages += _check(process, known["process"], where)
        for section, section_keys in known.items():
            value = process.get(section)
            if section == "process" or value is None:
                continue
            for item_index, item in enumerate(value if isinstance(value, list) else [value]):
                label = f"{where}.{section}" + (f"[{item_index}]" if isinstance(value, list) else "")
                if isinstance(item, dict):
                    messages += _check(item, section_keys, label)
    return messages


def _check(block: dict, known: set[str], where: str) -> list[str]:
    messages = []
    for key in block:
        if key not in known:
            messages.append(f"{where}: unknown key `{key}`{did_you_mean(key, known)}")
    return messages


def safetensors_header(path: Path) -> dict:
    """The JSON header of a .safetensors file, checked against the file's size."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise LauncherError(f"{path} is {size} bytes: too small to be a safetensors file; download it again")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise LauncherError(
                f"{path}: header length {length} does not fit the file ({size} bytes); the file is "
                "truncated or not a safetensors file: download it again"
            )
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise LauncherError(f"{path}: unreadable safetensors header ({error}); download it again") from None
    ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    if not ends:
        raise LauncherError(f"{path} holds no tensors")
    if 8 + length + max(ends) != size:
        raise LauncherError(
            f"{path}: the header describes {8 + length + max(ends)} bytes but the file has {size}; "
            "it is truncated or still downloading: finish or repeat the download"
        )
    return header


def check_model_dir(model_dir: Path, full_size: bool) -> None:
    if not model_dir.is_dir():
        raise LauncherError(
            f"model folder {model_dir} does not exist; pass --model-dir (or FLUX2_MODEL_DIR) pointing at "
            f"the folder holding {TRANSFORMER_FILE} and {VAE_FILE}"
        )
    for name in (TRANSFORMER_FILE, VAE_FILE):
        if not (model_dir / name).is_file():
            raise LauncherError(
                f"{model_dir / name} is missing; download {name} from the root of the FLUX.2-dev model "
                "repository (the single file, not the diffusers transformer/ folder) into that folder"
            )
        safetensors_header(model_dir / name)
    if full_size and (model_dir / TRANSFORMER_FILE).stat().st_size < FULL_MODEL_BYTES:
        raise LauncherError(
            f"{model_dir / TRANSFORMER_FILE} is {(model_dir / TRANSFORMER_FILE).stat().st_size / 2**30:.1f} GiB; "
            "FLUX.2 [dev] is about 64 GB: is this another model, or an incomplete download?"
        )


def check_text_encoder(path_or_id: str, text_cache: Path | None = None) -> None:
    """A local folder with config, processor and complete weight shards, or a hub id already in the
    local cache, or a folder gone whose prompts the text phase may all have cached (`text_cache`)."""
    local = Path(path_or_id)
    if local.is_dir():
        missing = [name for name in ("config.json",) if not (local / name).is_file()]
        if not any((local / name).is_file() for name in ("tokenizer.json", "tekken.json", "tokenizer.model")):
            missing.append("tokenizer.json (or tekken.json)")
        if not any((local / name).is_file() for name in ("processor_config.json", "preprocessor_config.json")):
            missing.append("processor_config.json / preprocessor_config.json")
        if missing:
            raise LauncherError(
                f"text encoder folder {local} lacks {', '.join(missing)}; it must hold the Mistral3 model "
                "and its processor (a snapshot of mistralai/Mistral-Small-3.1-24B-Instruct-2503)"
            )
        check_weight_shards(local)
        return
    if "/" in path_or_id and not local.exists() and _hub_cached(path_or_id):
        return
    if text_cache is not None and _remembered(text_cache, local):
        say(f"note: text encoder folder {local} not found; the text phase will use the embeddings cached "
            f"from it in {text_cache}, and stops with a clear error if a prompt is not there")
        return
    raise LauncherError(
        f"text encoder {path_or_id!r} is neither a local folder nor in the Hugging Face cache; pass "
        "--text-encoder (or FLUX2_TEXT_ENCODER) with a local snapshot of "
        "mistralai/Mistral-Small-3.1-24B-Instruct-2503"
    )


def check_weight_shards(folder: Path) -> None:
    """Every shard the index names is present and as long as its header says."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        if not (folder / "model.safetensors").is_file():
            raise LauncherError(f"text encoder folder {folder} holds neither model.safetensors.index.json nor "
                                "model.safetensors; download the model's safetensors weights into it")
        safetensors_header(folder / "model.safetensors")
        return
    try:
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    except (ValueError, KeyError, TypeError) as error:
        raise LauncherError(f"{index} is not a safetensors index ({error}); download it again") from None
    absent = [name for name in shards if not (folder / name).is_file()]
    if absent:
        raise LauncherError(f"text encoder folder {folder} lacks {len(absent)} of the {len(shards)} weight shards "
                            f"its index names ({', '.join(absent[:3])}); download them again")
    for name in shards:
        safetensors_header(folder / name)


def _remembered(text_cache: Path, folder: Path) -> bool:
    """Whether the text phase recorded an encoder at this folder (files.TEXT_ENCODER_RECORD)."""
    wanted = str(folder.resolve())
    for record in text_cache.glob(TEXT_ENCODER_RECORD.format("*")):
        try:
            if json.loads(record.read_text(encoding="utf-8")).get("path") == wanted:
                return True
        except (OSError, ValueError, AttributeError):
            continue
    return False


def _hub_cached(repo_id: str) -> bool:
    hub = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub")
    snapshots = hub / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    return any(snapshots.glob("*/config.json"))


def check_dataset(folder: Path, caption_ext: str) -> int:
    """Number of captioned images; errors name the folder and the first uncaptioned images."""
    if not folder.is_dir():
        raise LauncherError(f"dataset folder {folder} does not exist; pass --dataset (or FLUX2_DATASET)")
    images = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not images:
        raise LauncherError(f"dataset folder {folder} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    uncaptioned = [p.name for p in images if not p.with_suffix(f".{caption_ext}").is_file()]
    if uncaptioned:
        raise LauncherError(
            f"{len(uncaptioned)} of {len(images)} images in {folder} have no .{caption_ext} caption, e.g. "
            f"{', '.join(uncaptioned[:3])}; write one caption file per image with the same name"
        )
    return len(images)


def check_resolutions(config: dict) -> None:
    for process in config["config"]["process"]:
        for dataset in process.get("datasets", []):
            for resolution in dataset.get("resolution", []):
                if int(resolution) % 16:
                    raise LauncherError(
                        f"dataset resolution {resolution} is not a multiple of 16 (FLUX.2 packs 16x16 pixel "
                        f"patches); use {int(resolution) // 16 * 16} or {int(resolution) // 16 * 16 + 16}"
                    )


def network_warnings(config: dict) -> list[str]:
    """Networks ComfyUI cannot load: they train and save without complaint, and ComfyUI then
    skips every tensor of them with only a log line (see launcher/runs/lora_check.py)."""
    messages = []
    for index, process in enumerate(config["config"]["process"]):
        kind = str((process.get("network") or {}).get("type", "lora"))  # the trainer's default is lora
        if kind.lower() != "lora":
            messages.append(
                f"config.process[{index}].network.type is {kind!r}: ComfyUI's FLUX.2 loader loads only "
                f"`lora` networks and would silently apply none of this one; use `network: {{type: lora}}` "
                "to try the result in ComfyUI"
            )
    return messages


def check_free_disk(path: Path, needed_gib: float = FREE_DISK_NEEDED_GIB) -> None:
    free = free_disk_gib(path)
    if free < needed_gib:
        raise LauncherError(
            f"only {free} GiB free at {path}; the quantized cache, latent cache and checkpoints need about "
            f"{needed_gib} GiB: free some space or choose another --output"
        )
