"""Checks on the files a rendered run points at, before anything heavy starts; each failure
says how to fix it. (The preset itself is checked by launcher/runs/schema.py, the dataset by
launcher/runs/dataset.py.)"""

import os
import re
from pathlib import Path

from flux2_contract import safetensors_header as reader
from flux2_contract.files import TEXT_ENCODER_RECORD
from flux2_contract.families import DEFAULT_ARCH, FLUX2_DEV, Family, family_of
from launcher.errors import LauncherError
from launcher.user_files import UserFileError, load_json, open_regular

VAE_FILE = "ae.safetensors"
# Smaller than FLUX.2 [dev]'s 64 GB checkpoint: another model or an incomplete download.
FULL_MODEL_BYTES = 30 * 2**30


def safetensors_header(path: Path) -> dict:
    """The JSON header of a .safetensors file, checked by the trainer's own reader.

    The reader is `flux2_contract/safetensors_header.py` (stdlib only, imported without
    torch), the one the streamed loader validates the checkpoint with, so a file the trainer
    would refuse minutes into a launch is refused here, by the same rules, before anything starts.
    The file is untrusted: whatever its bytes, the only exception is a LauncherError naming it.
    """
    try:
        with open_regular(path) as handle:  # a FIFO or device there is refused, never read
            header = reader.read_header(handle, os.fstat(handle.fileno()).st_size, str(path))
    except OSError as error:
        raise LauncherError(f"{path} cannot be read ({error.strerror or error})") from None
    except reader.SafetensorsHeaderError as error:
        raise LauncherError(f"{error}; the file is damaged, truncated or still downloading: finish or repeat "
                            "the download") from None
    if not header.entries:
        raise LauncherError(f"{path} holds no tensors")
    return {**({"__metadata__": header.metadata} if header.metadata else {}),
            **{entry.name: {"dtype": entry.dtype, "shape": list(entry.shape), "data_offsets": [entry.begin, entry.end]}
               for entry in header.entries.values()}}


def reshapes(flux2_params) -> bool:
    """Whether `flux2_params` gives a transformer other than FLUX.2 [dev] (`{}` is FLUX.2 [dev] itself)."""
    return isinstance(flux2_params, dict) and any(FLUX2_DEV.shape.get(key) != value for key, value in flux2_params.items())


def check_block_counts(path: Path, header: dict, flux2_params: dict) -> None:
    """The transformer file holds the blocks `flux2_params` says (when its tensors are named by block); an
    unset key is the trainer's default Flux2Params, FLUX.2 [dev]'s shape."""
    for prefix, key in (("double_blocks", "depth"), ("single_blocks", "depth_single_blocks")):
        found = {int(m.group(1)) for name in header if (m := re.search(rf"(?:^|\.){prefix}\.(\d+)\.", name))}
        wanted = flux2_params.get(key, FLUX2_DEV.shape[key])
        if found and len(found) != wanted:
            raise LauncherError(f"{path} holds {len(found)} {prefix} where model_kwargs flux2_params gives {key} {wanted}; "
                                f"set flux2_params to the file's shape, or point --model-dir at the model it describes")


def check_model_dir(model_dir: Path, full_size: bool, flux2_params: dict | None = None, arch: str = DEFAULT_ARCH) -> None:
    """The model folder holds the family's transformer file (FLUX.2 [dev] full size unless the run reshapes
    it) and the VAE, each with a header the trainer's reader accepts."""
    family = family_of(arch)
    dev_file = FLUX2_DEV.transformer_file
    if model_dir.exists() and not model_dir.is_dir():
        raise LauncherError(f"model folder {model_dir} is a file, not a folder; pass --model-dir (or FLUX2_MODEL_DIR) "
                            f"the folder holding {family.transformer_file} and {VAE_FILE}")
    if not model_dir.is_dir():
        raise LauncherError(
            f"model folder {model_dir} does not exist; pass --model-dir (or FLUX2_MODEL_DIR) pointing at "
            f"the folder holding {family.transformer_file} and {VAE_FILE}"
        )
    for name in (family.transformer_file, VAE_FILE):
        if not (model_dir / name).is_file():
            other = (f" (the folder holds {dev_file}, FLUX.2 [dev]'s transformer, not {family.label}'s)"
                     if name != dev_file and (model_dir / dev_file).is_file() else "")
            raise LauncherError(
                f"{model_dir / name} is missing{other}; download {name} from the root of the {family.label} model "
                "repository (the single file, not the diffusers transformer/ folder) into that folder"
            )
        header = safetensors_header(model_dir / name)
        if name == family.transformer_file and isinstance(flux2_params, dict):
            check_block_counts(model_dir / name, header, flux2_params)
    if full_size and (model_dir / dev_file).stat().st_size < FULL_MODEL_BYTES:
        raise LauncherError(
            f"{model_dir / dev_file} is {(model_dir / dev_file).stat().st_size / 2**30:.1f} GiB; "
            "FLUX.2 [dev] is about 64 GB: is this another model, or an incomplete download?"
        )


def check_text_encoder(path_or_id: str, text_cache: Path | None = None, arch: str = DEFAULT_ARCH) -> str | None:
    """A local folder with config, tokenizer (and for FLUX.2 [dev] processor) and complete weight
    shards, or a hub id already in the local cache, or a folder gone whose prompts the text phase
    may all have cached (`text_cache`): then the note `run` says of it."""
    family = family_of(arch)
    encoder = family.text_encoder
    local = Path(path_or_id)
    if local.is_dir():
        missing = [name for name in ("config.json",) if not (local / name).is_file()]
        if encoder.processor:
            if not any((local / name).is_file() for name in ("tokenizer.json", "tekken.json", "tokenizer.model")):
                missing.append("tokenizer.json (or tekken.json)")
            if not any((local / name).is_file() for name in ("processor_config.json", "preprocessor_config.json")):
                missing.append("processor_config.json / preprocessor_config.json")
        elif not (local / "tokenizer.json").is_file() and not all((local / name).is_file()
                                                                 for name in ("vocab.json", "merges.txt")):
            missing.append("tokenizer.json (or vocab.json and merges.txt)")
        if missing:
            raise LauncherError(
                f"text encoder folder {local} lacks {', '.join(missing)}; it must hold the {encoder.kind} model "
                f"and its {'processor' if encoder.processor else 'tokenizer'} (a snapshot of {encoder.hub_id})"
            )
        check_model_type(local / "config.json", family)
        check_weight_shards(local)
        return None
    if "/" in path_or_id and not local.exists() and _hub_cached(path_or_id):
        return None
    if text_cache is not None and _remembered(text_cache, local):
        return (f"note: text encoder folder {local} not found; the text phase will use the embeddings cached "
                f"from it in {text_cache}, and stops with a clear error if a prompt is not there")
    raise LauncherError(
        f"text encoder {path_or_id!r} is neither a local folder nor in the Hugging Face cache; pass "
        f"--text-encoder (or FLUX2_TEXT_ENCODER) with a local snapshot of {encoder.hub_id}"
    )


def check_model_type(config: Path, family: Family) -> None:
    """The encoder's config.json names the model class the trainer loads for this arch."""
    encoder = family.text_encoder
    if encoder.model_type is None:
        return
    data = load_json(config, "model_json")
    if not isinstance(data, dict):
        raise LauncherError(f"{config} is not a model config (a JSON {type(data).__name__}, not an object); "
                            "download it again")
    found = data.get("model_type")
    if found != encoder.model_type:
        raise LauncherError(f"{config} says model_type {found!r}, but {family.label} reads a {encoder.kind} encoder "
                            f"({encoder.model_type!r}); pass --text-encoder a snapshot of {encoder.hub_id}")


def check_weight_shards(folder: Path) -> None:
    """Every shard the index names is present and as long as its header says."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        if not (folder / "model.safetensors").is_file():
            raise LauncherError(f"text encoder folder {folder} holds neither model.safetensors.index.json nor "
                                "model.safetensors; download the model's safetensors weights into it")
        safetensors_header(folder / "model.safetensors")
        return
    shards = index_shards(index)
    absent = [name for name in shards if not (folder / name).is_file()]
    if absent:
        raise LauncherError(f"text encoder folder {folder} lacks {len(absent)} of the {len(shards)} weight shards "
                            f"its index names ({', '.join(absent[:3])}); download them again")
    for name in shards:
        safetensors_header(folder / name)


def index_shards(index: Path) -> list[str]:
    """The shard files a safetensors index maps its tensors to: file names in the index's own folder
    (an entry like `../../x` or `/etc/x` would have the launcher read files outside it)."""
    data = load_json(index, "model_json")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise LauncherError(f"{index} is not a safetensors index (it needs a weight_map of tensor names to shard "
                            "files); download it again")
    names = list(weight_map.values())
    strange = next((name for name in names if not isinstance(name, str) or not _plain_shard_name(name)), None)
    if strange is not None:
        shown = repr(strange) if isinstance(strange, str) and len(strange) <= 80 else f"a {type(strange).__name__}"
        raise LauncherError(f"{index} maps a tensor to {shown}, not a .safetensors file beside the index; "
                            "download the index again")
    return sorted(set(names))


def _plain_shard_name(name: str) -> bool:
    return (name.endswith(".safetensors") and "/" not in name and "\\" not in name and ":" not in name
            and name not in (".", ".."))


def _remembered(text_cache: Path, folder: Path) -> bool:
    """Whether the text phase recorded an encoder at this folder (files.TEXT_ENCODER_RECORD)."""
    wanted = str(folder.resolve())
    for record in text_cache.glob(TEXT_ENCODER_RECORD.format("*")):
        try:
            data = load_json(record, "model_json")
        except UserFileError:
            continue
        if isinstance(data, dict) and data.get("path") == wanted:
            return True
    return False


def _hub_cached(repo_id: str) -> bool:
    hub = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub")
    snapshots = hub / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    return any(snapshots.glob("*/config.json"))


def network_warnings(config: dict) -> list[str]:
    """Networks ComfyUI cannot load: they train and save without complaint, and ComfyUI then
    skips every tensor of them with only a log line (see launcher/comfy/lora_check.py)."""
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
