"""On-disk cache of prompt embeddings, so a relaunch never opens the text encoder.

One file per prompt: `<folder>/<key hash>.temb.safetensors`, a plain safetensors file with a
single tensor `embeds` and JSON metadata (`aitk_temb`: format, the full key, the prompt, the
tensor's sha256). The key is the encoder's identity (config, shard headers, tokenizer files),
the prompt template (chat messages, max length, hidden layers), the dtype and the prompt
itself, so an embedding from another encoder or template is never found, only rebuilt.

Files are written to a temporary name, fsynced and renamed into place, so a crash leaves no
half-written entry under a real name; a file that is truncated, altered or keyed otherwise is
reported, set aside (`.corrupt`) and computed again. No pickle is ever read.

A record per encoder folder (TEXT_ENCODER_RECORD) remembers the last identity seen
there, so a relaunch whose prompts are all cached runs even with the folder gone.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Callable, Dict, Optional

import torch
from safetensors.torch import save as safetensors_bytes

from flux2_contract import settings
from flux2_contract.files import TEXT_ENCODER_RECORD
from toolkit.streamed_safetensors import SafetensorsHeaderError, StreamedSafetensors

FORMAT = 1
SUFFIX = ".temb.safetensors"
META_KEY = "aitk_temb"
TENSOR = "embeds"


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def key_digest(key: dict) -> str:
    """A short name for a cache key (encoder, template, dtype)."""
    return _digest(key)[:16]


def _tensor_sha256(tensor: torch.Tensor) -> str:
    raw = tensor.detach().contiguous().cpu().view(torch.uint8)
    return hashlib.sha256(memoryview(raw.numpy()).cast("B")).hexdigest()


def write_atomically(path: Path, data: bytes) -> None:
    """Temp file in the same folder, fsync, rename: readers see the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if os.name != "nt":  # a directory fsync makes the rename durable; Windows has none
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


class TextEmbeddingCache:
    """Prompt -> embedding files under one folder, for one encoder + template key."""

    def __init__(self, folder: Path, key: dict, log: Callable[[str], None] = print):
        self.folder = Path(folder)
        self.key = {"format": FORMAT, **key}
        self.log = log

    def path_for(self, prompt: str) -> Path:
        return self.folder / (_digest({"key": self.key, "prompt": prompt})[:40] + SUFFIX)

    def has(self, prompt: str) -> bool:
        """Whether a sound entry exists: header and metadata checked, a bad one set aside.
        The tensor bytes are checked against their sha256 when loaded."""
        path = self.path_for(prompt)
        if not path.is_file():
            return False
        try:
            with StreamedSafetensors(path) as st:
                self._check_meta(st, prompt)
            return True
        except (OSError, SafetensorsHeaderError, ValueError) as e:
            self._set_aside(path, str(e))
            return False

    def save(self, prompt: str, embeds: torch.Tensor) -> None:
        embeds = embeds.detach().contiguous().cpu()
        meta = {"format": FORMAT, "key": self.key, "prompt": prompt, "sha256": _tensor_sha256(embeds)}
        data = safetensors_bytes({TENSOR: embeds}, metadata={META_KEY: json.dumps(meta, ensure_ascii=False)})
        write_atomically(self.path_for(prompt), data)

    def load(self, prompt: str) -> Optional[torch.Tensor]:
        """The cached embedding, or None when absent or unusable (then it is set aside)."""
        path = self.path_for(prompt)
        if not path.is_file():
            return None
        try:
            return self._read_checked(path, prompt)
        except (OSError, SafetensorsHeaderError, ValueError) as e:
            self._set_aside(path, str(e))
            return None

    def _read_checked(self, path: Path, prompt: str) -> torch.Tensor:
        with StreamedSafetensors(path) as st:
            meta = self._check_meta(st, prompt)
            embeds = st.read(TENSOR)
        if _tensor_sha256(embeds) != meta.get("sha256"):
            raise ValueError("tensor bytes do not match their sha256")
        return embeds

    def _check_meta(self, st: StreamedSafetensors, prompt: str) -> dict:
        meta = json.loads(st.metadata.get(META_KEY, "null"))
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"no {META_KEY} metadata of format {FORMAT}")
        if meta.get("key") != self.key or meta.get("prompt") != prompt:
            raise ValueError("written for another encoder, template or prompt")
        if list(st.keys()) != [TENSOR]:
            raise ValueError(f"holds {st.keys()}, expected [{TENSOR!r}]")
        return meta

    def _set_aside(self, path: Path, why: str) -> None:
        aside = path.with_name(path.name + ".corrupt")
        self.log(f"[text cache] {path} is unusable ({why}); set aside as {aside.name}, computing it again")
        os.replace(path, aside)


def cache_folder(model_kwargs: Dict, training_folder: Optional[str]) -> Optional[Path]:
    """model_kwargs.text_embedding_cache_dir, else <training_folder>/../text_cache; None when neither is known."""
    return settings.cache_folder(model_kwargs, "text_embedding_cache_dir", training_folder, "text_cache")


def _record_path(folder: Path, encoder_folder: Path) -> Path:
    return folder / TEXT_ENCODER_RECORD.format(_digest(str(Path(encoder_folder).resolve()))[:16])


def remember_encoder(folder: Path, encoder_folder: Path, facts: dict) -> None:
    """Note which encoder (identity, widths) was last seen at this folder."""
    record = {"path": str(Path(encoder_folder).resolve()), **facts}
    write_atomically(_record_path(folder, encoder_folder), json.dumps(record, indent=1).encode("utf-8"))


def recall_encoder(folder: Path, encoder_folder: Path) -> Optional[dict]:
    """What remember_encoder noted for this folder, or None."""
    path = _record_path(folder, encoder_folder)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("path") == str(Path(encoder_folder).resolve()) else None
