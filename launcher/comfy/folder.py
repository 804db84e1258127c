"""A user's ComfyUI folder: recognise it, put the LoRA into models/loras, name the models it lacks."""

import hashlib
import re
import shutil
from pathlib import Path

from launcher.errors import LauncherError
from launcher.progress import warn
from launcher.user_files import UserFileError, open_regular, read_text
from launcher.writer import link_new, new_file

MODEL_FOLDERS = {
    # the folder a template names -> the folders ComfyUI searches for it (the older names too)
    "diffusion_models": ("diffusion_models", "unet"),
    "text_encoders": ("text_encoders", "clip"),
}
MIN_VERSION = (0, 19, 0)
"""The first ComfyUI release that loads the template's VAE, FLUX.2's small decoder
(full_encoder_small_decoder.safetensors; ComfyUI's changelog for v0.19.0, April 2026: "support
for small flux.2 decoder"). Older releases stop at the VAE loader with a size mismatch on
decoder.conv_in.weight (384 vs 512 channels)."""
VERSION_LINE = re.compile(r"""^__version__\s*=\s*["']([^"']+)["']""", re.MULTILINE)
VERSION_NUMBERS = re.compile(r"v?(\d+)(?:\.(\d+))?(?:\.(\d+))?(?:[-+.]?[0-9A-Za-z][0-9A-Za-z.+-]*)?")
"""0.19, 0.19.0, v0.19.2 (a suffix such as -rc1 or +git is fine); "nightly" or "master" is no release number."""
HUGGING_FACE_FILE = re.compile(r"^https://huggingface\.co/(?P<repo>[^/]+/[^/]+)/resolve/[^/]+/(?P<file>.+)$")


def check_comfy_dir(folder: Path) -> Path:
    """`folder` when it is a ComfyUI folder (models/ beside main.py or custom_nodes/)."""
    if _is_comfy_dir(folder):
        loras = folder / "models" / "loras"
        if loras.exists() and not loras.is_dir():
            raise LauncherError(f"{loras} is a file where ComfyUI keeps its LoRA folder; move it aside (ComfyUI "
                                "makes the folder again), then run again")
        return folder
    hint = f"Did you mean {folder / 'ComfyUI'}? " if _is_comfy_dir(folder / "ComfyUI") else ""
    raise LauncherError(
        f"{folder} is not a ComfyUI folder: it has no models/ folder beside main.py or custom_nodes/. {hint}"
        "Pass the folder that holds ComfyUI's models/ (in the portable build, the ComfyUI folder inside it; "
        "for the desktop app, its base path)"
    )


def version_note(folder: Path) -> str | None:
    """A warning when the ComfyUI folder's comfyui_version.py says a release too old for the template."""
    wanted = ".".join(map(str, MIN_VERSION))
    try:
        found = VERSION_LINE.search(read_text(folder / "comfyui_version.py", "notes"))
    except UserFileError:  # missing, not a plain file, not UTF-8: said below
        found = None
    if found is None:
        return (f"cannot tell the ComfyUI version ({folder / 'comfyui_version.py'} is missing or unreadable); the "
                f"workflow needs ComfyUI {wanted} or newer, the first to load the FLUX.2 small-decoder VAE")
    numbers = VERSION_NUMBERS.fullmatch(found.group(1).strip())
    if numbers is None:
        return (f"cannot tell the ComfyUI version: {folder / 'comfyui_version.py'} says {found.group(1)!r}, not a "
                f"release number; the workflow needs ComfyUI {wanted} or newer, the first to load the FLUX.2 "
                "small-decoder VAE (update ComfyUI if its VAE loader stops with a size mismatch)")
    release = tuple(int(part or 0) for part in numbers.groups())
    if release < MIN_VERSION:
        return (f"ComfyUI {found.group(1)} in {folder} is older than {wanted}, the first release that loads the "
                "template's FLUX.2 small-decoder VAE (full_encoder_small_decoder.safetensors): update ComfyUI, or "
                "the workflow stops at its VAE loader with a size mismatch")
    return None


def _is_comfy_dir(folder: Path) -> bool:
    return (folder / "models").is_dir() and ((folder / "main.py").is_file() or (folder / "custom_nodes").is_dir())


def place_lora(lora: Path, comfy_dir: Path, link: bool, force: bool) -> Path:
    """models/loras/<name>: a copy (or a link); a different file there is replaced only with `force`."""
    target = comfy_dir / "models" / "loras" / lora.name
    if target.exists() or target.is_symlink():
        if _same_content(lora, target):
            return target
        if not force:
            raise LauncherError(
                f"{target} already exists with other content; pass --force to replace it, or move it away"
            )
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    if link:
        try:
            return link_new(target, lora.resolve())
        except OSError as error:  # Windows without Developer Mode or admin rights, FAT drives
            warn(f"cannot link {target} to {lora} ({error}); copying instead")
    with lora.open("rb") as source, new_file(target) as copy:  # never a half-copied LoRA under the real name
        shutil.copyfileobj(source, copy, 2**20)
    return target


def _same_content(lora: Path, target: Path) -> bool:
    if not target.exists():
        return False  # a dangling link
    if target.resolve() == lora.resolve():
        return True
    return target.stat().st_size == lora.stat().st_size and _sha256(target) == _sha256(lora)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open_regular(path) as handle:  # a FIFO in models/loras is refused, not waited on
        for block in iter(lambda: handle.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def model_location(model: dict) -> str:
    """Where the template's model file goes and where it comes from."""
    source = HUGGING_FACE_FILE.match(model.get("url", ""))
    origin = (f"Hugging Face {source['repo']}, file {source['file']}" if source
              else model.get("url") or "the template names no source")
    return f"models/{model['directory']}/{model['name']} (from {origin})"


def find_model(comfy_dir: Path, model: dict) -> Path | None:
    """The template's model file in one of the folders ComfyUI searches for it, or None."""
    for folder in MODEL_FOLDERS.get(model["directory"], (model["directory"],)):
        path = comfy_dir / "models" / folder / model["name"]
        if path.is_file():
            return path
    return None
