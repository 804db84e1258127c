"""The safetensors header, read with plain file reads: one reader for the trainer and the launcher.

The streamed checkpoint reader (toolkit/streamed_safetensors.py) validates a header the way
safetensors.safe_open does (`read_header`); the quantized cache reads its own files' framing
and JSON (`read_json_header`) and checks the rest itself. Every header and the JSON kept in
its metadata go through one parser (`load_json`), which refuses a repeated key; both key a checkpoint by
`source_fingerprint`. Stdlib only: the launcher imports this module without torch, to check the model files
(`launcher/runs/validate.py`) and a cache (`launcher/runs/disk_budget.py`) before a run.
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

MAX_HEADER_BYTES = 100 * 1024 * 1024
FINGERPRINT_HEADER_LIMIT = 256 * 1024 * 1024  # what the quantized cache has always hashed up to
# safetensors dtype name -> (torch dtype attribute, item size in bytes)
_DTYPES = {
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "I16": ("int16", 2),
    "U16": ("uint16", 2),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I32": ("int32", 4),
    "U32": ("uint32", 4),
    "F32": ("float32", 4),
    "F64": ("float64", 8),
    "I64": ("int64", 8),
    "U64": ("uint64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}


class SafetensorsHeaderError(ValueError):
    """The file is not a well-formed safetensors file; the message names it."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: Tuple[int, ...]
    begin: int  # offsets relative to the start of the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    entries: Dict[str, TensorEntry]
    metadata: Dict[str, str]
    data_start: int  # absolute file offset of the data section


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _no_duplicates(pairs):
    result = {}
    for key, value in pairs:
        if key in result:
            raise SafetensorsHeaderError(f"duplicate key {key!r}")
        result[key] = value
    return result


def load_json(text) -> Any:
    """The one JSON parser for what a safetensors file holds (its header, JSON kept in its metadata).

    JSON allows a key twice and json.loads keeps the last copy, so a header with a bogus first
    copy of a tensor's entry would pass every check made on the parsed result while a reader
    that keeps the first copy sees another file: here a repeated key, at any depth, raises
    SafetensorsHeaderError("duplicate key ..."), a ValueError like every other JSON error."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        text = bytes(text).decode("utf-8")
    parsed = json.loads(text, object_pairs_hook=_no_duplicates)
    try:  # json.loads keeps an escaped lone UTF-16 surrogate ("\ud800"); safe_open refuses it
        json.dumps(parsed, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise SafetensorsHeaderError("a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair) "
                                     "in a string") from None
    return parsed


MAX_DIM = 2**63 - 1  # torch sizes are int64
MAX_ELEMENTS = 2**63 - 1


def parse_header(raw: bytes, data_size: int, source: str = "<memory>") -> Header:
    """Validate header JSON bytes against a data section of data_size bytes.

    Refuses everything safetensors.safe_open refuses: the header must be a JSON object,
    every tensor's byte range must follow the
    previous one with no gap, the ranges must cover the data section exactly (no
    uncovered trailing bytes), and shapes must describe a countable number of elements.
    """

    def fail(problem: str):
        raise SafetensorsHeaderError(f"{source}: malformed safetensors header: {problem}")

    try:
        doc = load_json(raw)
    except SafetensorsHeaderError as e:
        fail(str(e))
    except (ValueError, RecursionError) as e:  # includes UnicodeDecodeError
        fail(f"not valid UTF-8 JSON ({e.__class__.__name__}: {e})")
    if not isinstance(doc, dict):
        fail(f"top level is a JSON {type(doc).__name__}, expected an object")

    metadata = doc.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict) or not all(
        isinstance(v, str) for v in metadata.values()
    ):
        fail("__metadata__ must be an object of strings")

    entries = {name: _parse_entry(name, info, data_size, fail) for name, info in doc.items()}
    _check_layout(entries, data_size, fail)
    return Header(entries, metadata, 8 + len(raw))


def _parse_entry(name: str, info, data_size: int, fail) -> TensorEntry:
    """One tensor's entry: a known dtype, a sane shape, in-bounds offsets that match the size."""
    where = f"tensor {name!r}"
    if not isinstance(info, dict):
        fail(f"{where}: entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        fail(f"{where}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        fail(f"{where}: shape {shape!r} is not a list of non-negative integers")
    numel = 1
    for d in shape:
        numel *= d
        if d > MAX_DIM or numel > MAX_ELEMENTS:
            fail(f"{where}: shape {shape} is absurd (more than 2**63 elements)")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
    ):
        fail(f"{where}: data_offsets {offsets!r} is not a pair of integers")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        fail(
            f"{where}: data_offsets [{begin}, {end}] outside the data section "
            f"of {data_size} bytes (file truncated?)"
        )
    expected = numel * _DTYPES[dtype][1]
    if expected != end - begin:
        fail(
            f"{where}: shape {shape} x {dtype} needs {expected} bytes "
            f"but data_offsets cover {end - begin}"
        )
    return TensorEntry(name, dtype, tuple(shape), begin, end)


def _check_layout(entries: Dict[str, TensorEntry], data_size: int, fail) -> None:
    """Byte ranges in offset order must tile the data section: no overlap, no gap, no tail."""
    position, previous = 0, None
    for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin < position:
            fail(
                f"tensor {entry.name!r}: data_offsets [{entry.begin}, {entry.end}] "
                f"overlap tensor {previous.name!r} [{previous.begin}, {previous.end}]"
            )
        if entry.begin > position:
            fail(
                f"tensor {entry.name!r}: a gap of {entry.begin - position} bytes before its "
                f"data_offsets [{entry.begin}, {entry.end}] (the data before ends at {position})"
            )
        position, previous = entry.end, entry
    if position != data_size:
        fail(
            f"the tensors cover {position} of the {data_size} data bytes; the last "
            f"{data_size - position} bytes belong to no tensor (padded file or lost header entries)"
        )


def read_header_bytes(f, file_size: int, source: str, limit: Optional[int] = None) -> bytes:
    """The header's JSON bytes from a binary file object positioned anywhere: a plausible length
    (at most `limit`, default MAX_HEADER_BYTES, inside the file) and every byte present."""
    limit = MAX_HEADER_BYTES if limit is None else limit
    if file_size < 8:
        raise SafetensorsHeaderError(
            f"{source}: {file_size} bytes is too short for a safetensors file"
        )
    f.seek(0)
    length = int.from_bytes(_read_exact(f, 8, source), "little")
    if length > limit or length > file_size - 8:
        raise SafetensorsHeaderError(
            f"{source}: header length {length} is not plausible for a file of "
            f"{file_size} bytes (limit {limit}); truncated or not safetensors"
        )
    return _read_exact(f, length, source)


def read_header(f, file_size: int, source: str) -> Header:
    """Read and validate the header from a binary file object positioned anywhere."""
    raw = read_header_bytes(f, file_size, source)
    return parse_header(raw, file_size - 8 - len(raw), source)


def read_json_header(f, file_size: int, source: str, limit: Optional[int] = None) -> Tuple[Dict[str, Any], int]:
    """The header as a JSON object, and where the data starts; the entries are the caller's to check."""
    raw = read_header_bytes(f, file_size, source, limit)
    try:
        doc = load_json(raw)
    except SafetensorsHeaderError as e:
        raise SafetensorsHeaderError(f"{source}: malformed safetensors header: {e}") from None
    except (ValueError, RecursionError) as e:  # includes UnicodeDecodeError
        raise SafetensorsHeaderError(f"{source}: header is not valid UTF-8 JSON ({e.__class__.__name__}: {e})") from None
    if not isinstance(doc, dict):
        raise SafetensorsHeaderError(f"{source}: header is not a JSON object")
    return doc, 8 + len(raw)


def _read_exact(f, n: int, source: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise SafetensorsHeaderError(f"{source}: unexpected end of file")
    return data


FINGERPRINT_FALLBACK_BYTES = 1 << 20


def source_fingerprint(path: Path) -> Dict[str, Any]:
    """What keys a cache to its source checkpoint: name, size, mtime and a hash of the header
    bytes (of the first MiB when the file is not safetensors)."""
    path = Path(path)
    st = path.stat()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        first = f.read(8)
        digest.update(first)
        n = int.from_bytes(first, "little") if len(first) == 8 else 0
        limit = n if 0 < n <= FINGERPRINT_HEADER_LIMIT and 8 + n <= st.st_size else FINGERPRINT_FALLBACK_BYTES
        digest.update(f.read(limit))
    return {"name": path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "header_sha256": digest.hexdigest()}
