"""The quantized cache's file: a safetensors file read and written without executing code.

File format: a plain safetensors file (8-byte little-endian header length, JSON
header, raw tensor bytes) written (toolkit/qcache_codecs.py) and read (here) with ordinary file I/O
(no mmap, no pickle, no torch.load). It holds the inner tensors of every quantized
weight (packed data, scales, zero points) and every unquantized parameter/buffer.
The header's __metadata__ carries:

  aitk_qcache          JSON: format version, cache key, and
                         entries  one per parameter/buffer: how to rebuild it (plain
                                  tensor, or a torchao tensor subclass tree: class name
                                  from a fixed allow-list, its JSON-encoded attributes,
                                  its inner tensors);
                         modules  one per module the quantizer put in place of an
                                  nn.Linear (a kind from a fixed allow-list, today only
                                  int4_linear, its JSON meta and tensor names);
                         ostris   one per OstrisLinear (the upstream trainer's own
                                  backends, toolkit/util/ostris_quant.py): qtype, weight
                                  dtype, buffer names and scalar attributes;
                       and a sha256 per stored tensor.
  aitk_qcache_sha256   sha256 over aitk_qcache and the tensor index, so any change to
                       the header is detected.

Loading validates everything (header, offsets, sizes, checksums, names, shapes) before
a single tensor is assigned into the model; a bad file is reported, renamed aside
and the caller quantizes again. A load onto the GPU goes through a few bounded staging
buffers (toolkit/staged_load.py), so host RAM never holds the whole model. Writes go to a temp file, are fsynced, then moved
into place with os.replace.

How model state becomes entries and back: toolkit/qcache_codecs.py, toolkit/qcache_rebuild.py;
when a cache is used: toolkit/quantized_cache.py.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from flux2_contract.qcache_index import CACHE_SUFFIX, FORMAT_NAME, MAX_HEADER_BYTES, META_KEY, META_SHA_KEY  # noqa: F401
from flux2_contract.safetensors_header import SafetensorsHeaderError, load_json, read_json_header
from toolkit.staged_load import StagedReadError, TensorSpan, read_spans

# bump when the file layout or the meaning of an entry changes: old caches go stale
# 2: "modules" entries for replaced modules (Int4Linear)
# 3: one layout for both trainers: "modules" and "ostris" (OstrisLinear records) always present
FORMAT_VERSION = 3

_CHUNK = 64 * 1024 * 1024
_ALIGN = 8

_DTYPES: Dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class CacheError(Exception):
    """The cache file is unusable (corrupt, truncated, or not ours)."""


def _corrupt_on_error(what: str):
    """Any exception but a read error while interpreting `what` means a corrupt cache.

    The file is untrusted input: a header nested deeper than the JSON parser can follow
    (RecursionError), an attribute of the wrong type (TypeError), a constructor that
    refuses its arguments... each is a CacheError, so the loader sets the file aside
    and quantizes again instead of crashing at every launch. The model is not touched
    before these checks pass, so nothing is half-loaded. Running out of device memory
    while filling the model is not the file's fault and is passed on."""

    def wrap(function):
        @functools.wraps(function)
        def checked(*args, **kwargs):
            try:
                return function(*args, **kwargs)
            except (CacheError, OSError, torch.OutOfMemoryError):
                raise
            except Exception as e:
                raise CacheError(f"malformed {what} ({type(e).__name__}: {e})") from None

        return checked

    return wrap


def _short(value: Any, limit: int = 120) -> str:
    """repr() cut to a readable length: metadata values come from an untrusted file."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _say(msg: str) -> None:
    print(f"[quantized cache] {msg}", flush=True)


def _int_list(v: Any) -> List[int]:
    if not isinstance(v, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v
    ):
        raise CacheError(f"bad shape {v!r}")
    return v


# ---------------------------------------------------------------------------
# raw file access


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy())


def _header_bytes(index: Dict[str, Any]) -> bytes:
    raw = json.dumps(index, separators=(",", ":"), sort_keys=True).encode()
    raw += b" " * ((-(8 + len(raw))) % _ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def _meta_digest(meta_json: str, tensor_index: Dict[str, Any]) -> str:
    h = hashlib.sha256(meta_json.encode())
    h.update(json.dumps(tensor_index, separators=(",", ":"), sort_keys=True).encode())
    return h.hexdigest()


def _tensor_index(tensors: Dict[str, torch.Tensor]) -> Tuple[Dict[str, Any], int]:
    """The safetensors index (dtype, shape, offsets) in name order, and the data size."""
    index: Dict[str, Any] = {}
    offset = 0
    for n in sorted(tensors):
        t = tensors[n]
        if t.dtype not in _DTYPE_NAMES:
            raise TypeError(f"{n}: dtype {t.dtype} cannot be stored")
        nbytes = t.numel() * t.element_size()
        index[n] = {
            "dtype": _DTYPE_NAMES[t.dtype],
            "shape": [int(x) for x in t.shape],
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    return index, offset


def _header(key: Dict[str, Any], sections: Dict[str, Any], tensor_index: Dict[str, Any],
            checksums: Dict[str, str]) -> bytes:
    """The complete file header: tensor index plus the signed aitk_qcache metadata."""
    meta = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "key": key,
        "checksum": "sha256",
        "checksums": checksums,
        **sections,
    }
    meta_json = json.dumps(meta, separators=(",", ":"), sort_keys=True)
    index = dict(tensor_index)
    index["__metadata__"] = {
        "format": FORMAT_NAME,
        META_KEY: meta_json,
        META_SHA_KEY: _meta_digest(meta_json, tensor_index),
    }
    return _header_bytes(index)


def _fsync_dir(d: Path) -> None:
    if os.name == "nt":
        return
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _read_header(f, file_size: int) -> Tuple[Dict[str, Any], int]:
    """The safetensors header as a dict, and where the data starts."""
    try:
        return read_json_header(f, file_size, "cache file", MAX_HEADER_BYTES)
    except SafetensorsHeaderError as e:
        raise CacheError(str(e)) from None


@_corrupt_on_error("cache header")
def read_meta(path: Path) -> Dict[str, Any]:
    """Read and verify only the header; cheap. Raises CacheError."""
    path = Path(path)
    with open(path, "rb") as f:
        index, _ = _read_header(f, os.fstat(f.fileno()).st_size)
    return _verify_meta(index)[0]


def _verify_meta(index: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(aitk_qcache, tensor index) once the header checksum holds. Only what every format
    version has is checked here, so an old cache reads as stale, not as corrupt."""
    md = index.get("__metadata__")
    if not isinstance(md, dict) or md.get("format") != FORMAT_NAME:
        raise CacheError("not a quantized-transformer cache (no aitk metadata)")
    meta_json = md.get(META_KEY)
    if not isinstance(meta_json, str):
        raise CacheError("cache metadata missing")
    tensor_index = {k: v for k, v in index.items() if k != "__metadata__"}
    if md.get(META_SHA_KEY) != _meta_digest(meta_json, tensor_index):
        raise CacheError("header checksum mismatch (header was modified or damaged)")
    try:
        meta = load_json(meta_json)
    except SafetensorsHeaderError as e:
        raise CacheError(f"cache metadata: {e}") from None
    except json.JSONDecodeError as e:
        raise CacheError(f"cache metadata is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise CacheError("cache metadata has the wrong format name")
    if meta.get("checksum") != "sha256":
        raise CacheError(f"unknown checksum kind {meta.get('checksum')!r}")
    for k in ("key", "checksums", "entries"):
        if not isinstance(meta.get(k), dict):
            raise CacheError(f"cache metadata lacks {k!r}")
    return meta, tensor_index


def _check_sections(meta: Dict[str, Any]) -> None:
    """The sections of this format version are there (called once the key matched)."""
    if meta.get("format_version") != FORMAT_VERSION:
        raise CacheError(f"format version {meta.get('format_version')!r}, this trainer reads {FORMAT_VERSION}")
    for k in ("modules", "ostris"):
        if not isinstance(meta.get(k), dict):
            raise CacheError(f"cache metadata lacks {k!r}")


def _tensor_layout(tensor_index: Dict[str, Any], data_start: int, file_size: int) -> List[tuple]:
    """(begin, end, name, dtype, shape) of every tensor in file order, checked to tile the
    bytes after the header exactly."""
    layout = []
    for name, info in tensor_index.items():
        if not isinstance(info, dict):
            raise CacheError(f"bad index entry for {name!r}")
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CacheError(f"{name}: unsupported dtype {info.get('dtype')!r}")
        shape = _int_list(info.get("shape"))
        offs = _int_list(info.get("data_offsets"))
        if len(offs) != 2:
            raise CacheError(f"{name}: bad data_offsets")
        numel = 1
        for s in shape:
            numel *= s
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offs[1] - offs[0] != numel * itemsize:
            raise CacheError(f"{name}: {offs[1] - offs[0]} bytes stored, shape {shape} needs {numel * itemsize}")
        layout.append((offs[0], offs[1], name, dtype, shape))
    layout.sort()
    pos = 0
    for begin, end, name, _, _ in layout:
        if begin != pos:
            raise CacheError(f"{name}: data does not follow the previous tensor")
        pos = end
    if data_start + pos != file_size:
        raise CacheError(f"file is {file_size} bytes, header describes {data_start + pos} (truncated or padded)")
    return layout


def _read_tensors(f, layout, data_start: int, checksums: Dict[str, str], device,
                  staging: Optional[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
    """Read every tensor onto `device` (or, a function of its name, its own) with plain reads, each
    checked against its sha256 (toolkit/staged_load.py: a GPU target through bounded staging buffers)."""
    spans = [
        TensorSpan(name, data_start + begin, data_start + end, dtype, tuple(shape), checksums.get(name))
        for begin, end, name, dtype, shape in layout
    ]
    try:
        return read_spans(f, spans, device, log=_say, **(staging or {}))
    except StagedReadError as e:
        raise CacheError(str(e)) from None


@_corrupt_on_error("cache file")
def read_cache(
    path: Path, device=torch.device("cpu"), staging: Optional[Dict[str, Any]] = None
) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """Read the whole file with plain reads onto `device` (or, a function of a tensor's name, each
    tensor onto its own) and verify every byte; a GPU target goes through bounded staging buffers
    (options in `staging`), so host RAM never holds the model. Raises CacheError."""
    path = Path(path)
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        index, data_start = _read_header(f, file_size)
        meta, tensor_index = _verify_meta(index)
        _check_sections(meta)
        checksums = meta["checksums"]
        if set(checksums) != set(tensor_index):
            raise CacheError("checksum list does not match the stored tensors")
        layout = _tensor_layout(tensor_index, data_start, file_size)
        tensors = _read_tensors(f, layout, data_start, checksums, device, staging)
    return meta, tensors


