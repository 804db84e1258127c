"""The run's own prompt: its dataset's first caption with the trigger word put in as the trainer does.

`sample` (its default prompt list) and `comfy` (the workflow's prompt) both start from it. The
caption is the one the trainer pairs with the dataset's first image (`<image>.<caption_ext>`), read
through launcher/user_files.py: a notes file or a folder that merely ends in `.txt` is never a prompt.
"""

from pathlib import Path

from launcher.errors import LauncherError
from launcher.runs.dataset import dataset_images, read_caption
from launcher.user_files import UserFileError


def caption_prompt(config: dict) -> str | None:
    """The first non-empty caption of the run's dataset, with the trigger word put in as the trainer does.
    Captions that cannot be read are passed over; when no caption is left, the first such problem is said."""
    process = config["config"]["process"][0]
    unreadable = None
    for dataset in process.get("datasets") or []:
        folder = Path(dataset["folder_path"])
        for image in dataset_images(folder) if folder.is_dir() else []:
            caption = image.with_name(image.stem + "." + (dataset.get("caption_ext") or "txt"))
            if not (caption.exists() or caption.is_symlink()):
                continue  # an image without a caption: the dataset check names it at `run`
            try:
                text = read_caption(image, dataset.get("caption_ext") or "txt").strip()
            except UserFileError as error:
                unreadable = unreadable or error
                continue
            if text:
                return with_trigger(text, process.get("trigger_word"))
    if unreadable is not None:
        raise LauncherError(f"no usable caption in the run's dataset: {unreadable}; pass --prompt \"...\"")
    return None


def with_trigger(caption: str, trigger: str | None) -> str:
    """`[trigger]` / `[name]` replaced by the trigger word, which leads the prompt when absent."""
    for placeholder in ("[trigger]", "[name]"):
        caption = caption.replace(placeholder, trigger or "")
    caption = " ".join(caption.split())
    return f"{trigger} {caption}" if trigger and trigger not in caption else caption
