"""Crash-safe checkpoints: the LoRA, its optimizer state and its step are saved as one set.

A save stages each file under a temporary name in the save folder (written, flushed, fsynced),
then commits the set by atomically replacing `checkpoint.json`, a small manifest naming the
staged files and the step, and only then renames the staged files into place. A kill -9 or
a power loss at any moment leaves either the previous manifest with its files untouched, or
the new manifest with each of its files under its final or its staged name: resume finishes
the renames ("rolls forward"), so it always finds a LoRA whose optimizer state and step
belong to it, and deletes leftover temporary files.

Temporary names start with a dot and contain `.aitk-tmp`, so the trainer's own globs
(`<job>*.safetensors`, `<job>_*`) never see them. They keep the final extension because
writers pick the file format from it.
"""

import glob
import json
import os
import time
import uuid

from flux2_contract.files import CHECKPOINT_MANIFEST

FORMAT = 1
TEMP_MARK = ".aitk-tmp"


def temp_name(final_name: str, token: str) -> str:
    root, ext = os.path.splitext(final_name)
    return f".{root}.{token}{TEMP_MARK}{ext}"


def fsync_file(path: str) -> None:
    # Windows only flushes a handle opened for writing
    fd = os.open(path, os.O_RDWR | getattr(os, "O_BINARY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(folder: str) -> None:
    """Make renames in `folder` durable (POSIX; Windows cannot open a folder for this)."""
    if os.name == "nt":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointSave:
    """One save: `stage()` each file, then `commit()` the set."""

    def __init__(self, folder: str):
        self.folder = folder
        self.token = uuid.uuid4().hex[:12]
        self.files = {}  # role -> {"name": final, "staged": temporary, "size": bytes}

    def stage(self, role: str, path: str, write, *args, **kwargs) -> None:
        """Write `path` as `write(temporary_path, *args, **kwargs)`; it appears at `path` on commit."""
        name = os.path.basename(path)
        staged = os.path.join(self.folder, temp_name(name, self.token))
        try:
            write(staged, *args, **kwargs)
            fsync_file(staged)
        except BaseException:
            remove(staged)
            raise
        self.files[role] = {"name": name, "staged": os.path.basename(staged), "size": os.path.getsize(staged)}

    def commit(self, training_info: dict, manifest: bool = True) -> None:
        """Replace the manifest (the commit point), then rename the staged files into place.

        Without `manifest` the files are only renamed, each on its own (saves that resume
        does not read from a manifest).
        """
        if manifest and self.files:
            fsync_dir(self.folder)
            record = {"format": FORMAT, "time": time.time(), **training_info, "files": self.files}
            staged = os.path.join(self.folder, temp_name(CHECKPOINT_MANIFEST, self.token))
            try:
                with open(staged, "w", encoding="utf-8") as handle:
                    json.dump(record, handle, indent=2)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(staged, os.path.join(self.folder, CHECKPOINT_MANIFEST))
            except BaseException:
                remove(staged)
                raise
            fsync_dir(self.folder)
        publish(self.folder, self.files)


def publish(folder: str, files: dict) -> bool:
    """Rename staged files into place; True when every file is present at its final name."""
    complete = True
    for entry in files.values():
        final = os.path.join(folder, entry["name"])
        staged = os.path.join(folder, entry["staged"])
        if os.path.exists(staged):
            try:
                os.replace(staged, final)
            except FileNotFoundError:
                pass  # another process of this run renamed it first
        if not (os.path.isfile(final) and os.path.getsize(final) == entry["size"]):
            complete = False
    fsync_dir(folder)
    return complete


def remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def find_checkpoint(folder: str, clean: bool = True):
    """The committed checkpoint in `folder`: {"step", "epoch", "files": {role: path}}, or None.

    None when the folder has no manifest (a new run, or one saved by an unpatched trainer:
    the caller then resumes as upstream does) or when files it names were deleted.
    Leftover temporary files are deleted when `clean` (one process per run only).
    """
    path = os.path.join(folder, CHECKPOINT_MANIFEST)
    record = None
    try:
        with open(path, encoding="utf-8") as handle:
            record = json.load(handle)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as error:
        print(f"Ignoring unreadable {path}: {error}", flush=True)
    found = None
    if record is not None:
        if publish(folder, record["files"]):
            files = {role: os.path.join(folder, entry["name"]) for role, entry in record["files"].items()}
            found = {"step": record.get("step"), "epoch": record.get("epoch"), "files": files}
        else:
            print(f"Ignoring {path}: files it names are missing", flush=True)
    if clean:
        for leftover in glob.glob(os.path.join(glob.escape(folder), f".*{TEMP_MARK}*")):
            print(f"Removing unfinished save: {leftover}", flush=True)
            remove(leftover)
    return found
