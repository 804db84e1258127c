"""The dataset, checked before the model loads: every image readable and big enough, every
caption UTF-8 text.

The trainer walks the dataset folder (subfolders included, `_controls` left out) for .jpg,
.jpeg, .png and .webp files and reads `<image>.<caption_ext>` as UTF-8. Both are read here through
launcher/user_files.py: regular files only, a size cap, and UTF-8 only (a caption saved as UTF-16,
with or without its byte-order mark, or holding NUL bytes would reach the text encoder as noise). A file it cannot use
today either crashes it after minutes of loading, or is dropped without a word. Here each bad
file is named with the reason. With `launcher: {skip_bad_images: true}` the run trains on the
good files only: they are listed in a dataset file in the run folder (the trainer's
`dataset_path`, a JSON object keyed by image path) and the skipped ones go into run.json.
"""

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from launcher.errors import LauncherError
from launcher.runs.images import PIL_MAX_PIXELS, BadImage, image_size
from launcher.user_files import UserFileError, read_text

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")  # the trainer's image_extensions
DEFAULT_BUCKET_TOLERANCE = 64  # DatasetConfig's default: buckets are multiples of this
SHOWN = 10
CHECK_THREADS = 4  # images checked at once (each is read whole: a few files in memory at a time)
CAPTION_TOKENS = 512  # the FLUX.2 pipeline's max_sequence_length, prompt template included
CHARS_PER_TOKEN = 4  # English text with Mistral's tokenizer, roughly
LONG_CAPTION_CHARS = (CAPTION_TOKENS - 100) * CHARS_PER_TOKEN  # ~100 tokens for the template


@dataclass
class DatasetCheck:
    folder: Path
    good: list[Path] = field(default_factory=list)
    bad: list[tuple[Path, str]] = field(default_factory=list)
    long_captions: list[tuple[Path, int]] = field(default_factory=list)
    """Captions likely longer than the text encoder reads: (caption file, characters)."""
    empty_captions: list[Path] = field(default_factory=list)
    """Caption files with no text: those images train without a prompt."""

    def skipped(self) -> list[dict]:
        return [{"file": str(path), "reason": reason} for path, reason in self.bad]


def dataset_images(folder: Path) -> list[Path]:
    """The images the trainer would train on, in a stable order."""
    found = []
    for root, _, files in os.walk(folder):
        if Path(root).name == "_controls":
            continue
        found += [Path(root) / name for name in files if name.lower().endswith(IMAGE_SUFFIXES)]
    return sorted(found)


def caption_path(image: Path, caption_ext: str) -> Path:
    return image.with_name(image.stem + "." + caption_ext.lstrip("."))


def read_caption(image: Path, caption_ext: str) -> str:
    """The caption of an image as the trainer reads it; UserFileError naming the caption when it cannot."""
    return read_text(caption_path(image, caption_ext), "caption")


def problem_with(image: Path, caption_ext: str, minimum: int) -> str | None:
    """Why the trainer cannot use this image and its caption, or None."""
    try:
        width, height = image_size(image)
    except BadImage as error:
        return str(error)
    if width * height > 2 * PIL_MAX_PIXELS:
        return (f"is {width}x{height} px ({width * height / 1e6:,.0f} Mpx); the trainer's PIL refuses images over "
                f"{2 * PIL_MAX_PIXELS / 1e6:.0f} Mpx (DecompressionBombError): scale it down")
    if min(width, height) < minimum:
        return (f"is {width}x{height} px; both sides must be at least {minimum} px "
                f"(the dataset's bucket_tolerance) to fit a training bucket")
    caption = caption_path(image, caption_ext)
    try:
        read_caption(image, caption_ext)
    except UserFileError as error:
        if not (caption.exists() or caption.is_symlink()):
            return f"has no caption file {caption.name}"
        return f"has a caption {caption.name} that {error.reason}"
    return None


def check_dataset(folder: Path, caption_ext: str = "txt", minimum: int = DEFAULT_BUCKET_TOLERANCE,
                  skip_bad: bool = False) -> DatasetCheck:
    """Check every image and caption; raise with the bad files unless `skip_bad` leaves good ones."""
    if not folder.is_dir():
        raise LauncherError(f"dataset folder {folder} does not exist; pass --dataset (or FLUX2_DATASET)")
    images = dataset_images(folder)
    if not images:
        raise LauncherError(f"dataset folder {folder} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    result = DatasetCheck(folder)
    # zlib lets go of the GIL while it inflates a PNG's pixels, the bulk of the check: a few threads
    with ThreadPoolExecutor(max_workers=min(CHECK_THREADS, os.cpu_count() or 1)) as pool:
        reasons = list(pool.map(lambda image: problem_with(image, caption_ext, minimum), images))
    for image, reason in zip(images, reasons):
        if reason is None:
            result.good.append(image)
            caption = caption_path(image, caption_ext)
            text = read_caption(image, caption_ext)
            if len(text) > LONG_CAPTION_CHARS:
                result.long_captions.append((caption, len(text)))
            if not text.strip():
                result.empty_captions.append(caption)
        else:
            result.bad.append((image, reason))
    if result.bad and (not skip_bad or not result.good):
        raise LauncherError(bad_files_message(result, skip_bad))
    return result


def long_caption_warnings(result: DatasetCheck) -> list[str]:
    """One line per caption the text encoder probably cuts off, and one for the empty captions."""
    lines = [f"{path} is {length:,} characters (about {length // CHARS_PER_TOKEN} tokens); the text encoder reads "
             f"at most {CAPTION_TOKENS} tokens with its prompt template, so the end of it is cut off"
             for path, length in result.long_captions]
    if result.empty_captions:
        shown = ", ".join(str(path) for path in result.empty_captions[:3])
        more = f" and {len(result.empty_captions) - 3} more" if len(result.empty_captions) > 3 else ""
        lines.append(f"{len(result.empty_captions)} caption file(s) are empty ({shown}{more}): those images train "
                     "without a prompt; write a caption into each, or leave them empty on purpose")
    return lines


def bad_files_message(result: DatasetCheck, skip_bad: bool) -> str:
    lines = [f"  {path.relative_to(result.folder)} {reason}" for path, reason in result.bad[:SHOWN]]
    if len(result.bad) > SHOWN:
        lines.append(f"  ... and {len(result.bad) - SHOWN} more")
    total = len(result.bad) + len(result.good)
    if skip_bad:
        advice = "No usable image is left; fix the files above."
    else:
        advice = ("Fix or remove these files, or add `launcher: {skip_bad_images: true}` to the preset to "
                  "train without them (run.json then lists what was skipped).")
    return (f"{len(result.bad)} of {total} images in the dataset {result.folder} cannot be used:\n"
            + "\n".join(lines) + "\n" + advice)
