"""Which quantized-cache file serves a (checkpoint, qtype), checked without torch.

The file's name, its metadata key and what makes it valid for a run: complete (the data the
header promises is all there), its key's qtype the one the run loads (through
flux2_contract/qtypes.py: int4_w4a8 loads int4_fused's file) and its key's source the very
checkpoint (flux2_contract/safetensors_header.py `source_fingerprint`). The trainer checks every byte
when it loads the file; the launcher imports this module without torch, to
count a valid cache as already written before a run (`launcher/runs/disk_budget.py`).
"""

import hashlib
from pathlib import Path
from typing import Any, Dict, Optional

from .qtypes import cache_qtype
from .safetensors_header import SafetensorsHeaderError, load_json, read_json_header, source_fingerprint

FORMAT_NAME = "aitk-quantized-cache"
META_KEY = "aitk_qcache"
META_SHA_KEY = "aitk_qcache_sha256"
CACHE_SUFFIX = ".qcache.safetensors"
MAX_HEADER_BYTES = 256 * 1024 * 1024


def cache_file_name(source_path: Path, qtype: str) -> str:
    """<checkpoint stem>-<cache qtype>-<hash of the checkpoint's absolute path><suffix>."""
    tag = hashlib.sha256(str(Path(source_path).resolve()).encode()).hexdigest()[:10]
    return f"{Path(source_path).stem}-{qtype}-{tag}{CACHE_SUFFIX}"


def read_key(path: Path) -> Optional[Dict[str, Any]]:
    """The cache key of a complete cache file, or None (not ours, truncated, unreadable)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            header, data_start = read_json_header(f, size, str(path), MAX_HEADER_BYTES)
        ends = [info["data_offsets"][1] for name, info in header.items() if name != "__metadata__"]
        if data_start + max(ends, default=0) != size:
            return None
        key = load_json(header["__metadata__"][META_KEY])["key"]
    except (OSError, SafetensorsHeaderError, KeyError, TypeError, ValueError, IndexError, RecursionError):
        return None
    return key if isinstance(key, dict) else None


def find_valid_cache(cache_dir: Path, checkpoint: Path, qtype: str) -> Optional[Path]:
    """A complete cache file in cache_dir made from this very checkpoint for this qtype, or None."""
    if not Path(cache_dir).is_dir() or not Path(checkpoint).is_file():
        return None
    wanted_qtype, source = cache_qtype(qtype), None
    for candidate in sorted(Path(cache_dir).glob(f"*{CACHE_SUFFIX}")):
        key = read_key(candidate)
        if key is None or key.get("qtype") != wanted_qtype:
            continue
        source = source or source_fingerprint(checkpoint)
        if key.get("source") == source:
            return candidate
    return None
