"""Read .safetensors files with plain file reads, one tensor or one block at a time.

safetensors' own loader maps the whole file into memory. On a 64 GB checkpoint
that can kill the process without a message (seen on Windows), and the mapped
pages count against the host while the model is built. This reader validates
the header first, then copies each tensor's byte range into a fresh buffer
with ordinary reads, so the caller decides how much is alive at once.

load_blockwise() builds a model that was created on the meta device block by
block: it reads the tensors of one block (``double_blocks.3.``), assigns them,
hands the block to a callback (cast, quantize, ...) and drops the reader's
references before the next block, so the peak is about one block plus what
the callback kept.
"""

import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

MAX_HEADER_BYTES = 100 * 1024 * 1024
_READ_CHUNK = 64 * 1024 * 1024

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
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
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


def read_header(f, file_size: int, source: str) -> Header:
    """Read and validate the header from a binary file object positioned anywhere."""
    if file_size < 8:
        raise SafetensorsHeaderError(
            f"{source}: {file_size} bytes is too short for a safetensors file"
        )
    f.seek(0)
    length = int.from_bytes(_read_exact(f, 8, source), "little")
    if length > MAX_HEADER_BYTES or length > file_size - 8:
        raise SafetensorsHeaderError(
            f"{source}: header length {length} is not plausible for a file of "
            f"{file_size} bytes (limit {MAX_HEADER_BYTES}); truncated or not safetensors"
        )
    raw = _read_exact(f, length, source)
    return parse_header(raw, file_size - 8 - length, source)


def _read_exact(f, n: int, source: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise SafetensorsHeaderError(f"{source}: unexpected end of file")
    return data


def _torch_dtype(name: str) -> torch.dtype:
    attr = _DTYPES[name][0]
    dtype = getattr(torch, attr, None)
    if dtype is None:
        raise SafetensorsHeaderError(f"dtype {name} is not supported by this torch build")
    return dtype


class StreamedSafetensors:
    """A safetensors file read with plain reads. Use as a context manager."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self._f = open(self.path, "rb", buffering=0)
        try:
            self.header = read_header(self._f, os.fstat(self._f.fileno()).st_size, self.path)
        except BaseException:
            self._f.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self._f.close()

    def keys(self) -> List[str]:
        return list(self.header.entries)

    @property
    def metadata(self) -> Dict[str, str]:
        return self.header.metadata

    def read(self, name: str) -> torch.Tensor:
        """A new CPU tensor holding the named tensor; nothing else stays referenced."""
        entry = self.header.entries[name]
        buf = torch.empty(entry.nbytes, dtype=torch.uint8)
        self._read_into(buf, entry.begin, name)
        return self._typed(buf, entry).reshape(entry.shape)

    def read_rows(self, name: str, rows: Sequence[int]) -> torch.Tensor:
        """Rows of a tensor (indices into its first dimension), read without the rest.

        An embedding table of a 24B text encoder is ~1.3 GB, of which a prompt set uses a
        few hundred rows; the result has shape (len(rows), *shape[1:]) in the order given.
        """
        entry = self.header.entries[name]
        if not entry.shape:
            raise ValueError(f"{self.path}: tensor {name!r} is a scalar; it has no rows")
        count = entry.shape[0]
        row_bytes = entry.nbytes // count if count else 0
        out = torch.empty((len(rows), row_bytes), dtype=torch.uint8)
        for i, row in enumerate(rows):
            if not 0 <= row < count:
                raise IndexError(f"{self.path}: row {row} of tensor {name!r} with {count} rows")
            self._read_into(out[i], entry.begin + row * row_bytes, name)
        return self._typed(out, entry).reshape((len(rows), *entry.shape[1:]))

    def _read_into(self, buf: torch.Tensor, begin: int, name: str) -> None:
        """Fill a contiguous uint8 tensor from data offset `begin` with plain reads."""
        size = buf.numel()
        if not size:
            return
        view = memoryview(buf.numpy()).cast("B")
        self._f.seek(self.header.data_start + begin)
        done = 0
        while done < size:
            got = self._f.readinto(view[done : min(size, done + _READ_CHUNK)])
            if not got:
                raise SafetensorsHeaderError(
                    f"{self.path}: unexpected end of file in tensor {name!r}"
                )
            done += got

    @staticmethod
    def _typed(buf: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
        tensor = buf.view(_torch_dtype(entry.dtype))
        if sys.byteorder != "little" and tensor.element_size() > 1:
            raise NotImplementedError("big-endian hosts are not supported")
        return tensor

    def read_many(self, names: Iterable[str]) -> Dict[str, torch.Tensor]:
        # file order keeps the reads sequential
        ordered = sorted(names, key=lambda n: self.header.entries[n].begin)
        return {name: self.read(name) for name in ordered}


def load_file(path, device: str = "cpu") -> Dict[str, torch.Tensor]:
    """Drop-in for safetensors.torch.load_file without memory mapping."""
    with StreamedSafetensors(path) as st:
        out = st.read_many(st.keys())
    if str(device) != "cpu":
        out = {k: v.to(device) for k, v in out.items()}
    return out


def group_keys(keys: Iterable[str], block_lists: Iterable[str]) -> Dict[str, List[str]]:
    """Group tensor names by block prefix ('double_blocks.0'); the rest under ''."""
    pattern = re.compile(
        r"^((?:%s)\.\d+)\." % "|".join(re.escape(b) for b in block_lists)
    )
    groups: Dict[str, List[str]] = {}
    for key in keys:
        match = pattern.match(key)
        groups.setdefault(match.group(1) if match else "", []).append(key)
    return groups


def _block_sort_key(prefix: str):
    name, _, index = prefix.rpartition(".")
    return name, int(index)


def load_blockwise(
    model: torch.nn.Module,
    path,
    block_lists: List[str],
    on_block: Optional[Callable[[str, torch.nn.Module], None]] = None,
    on_rest: Optional[Callable[[torch.nn.Module], None]] = None,
    dtype: Optional[torch.dtype] = None,
    log: Callable[[str], None] = print,
) -> None:
    """Fill a meta-device model from path, one transformer block at a time.

    block_lists names the ModuleLists of blocks (e.g. ["double_blocks",
    "single_blocks"]). For every block: read its tensors, cast to dtype, assign
    them, call on_block(prefix, block), release. Then the remaining tensors
    are assigned and on_rest(model) is called. The checkpoint must hold
    exactly the model's state dict keys.
    """
    with StreamedSafetensors(path) as st:
        expected = set(model.state_dict().keys())
        present = set(st.keys())
        if expected != present:
            missing = sorted(expected - present)
            unexpected = sorted(present - expected)
            raise ValueError(
                f"{st.path} does not match the model: {len(missing)} missing "
                f"(e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]}); "
                "check the model shape settings (flux2_params) and the file"
            )
        groups = group_keys(st.keys(), block_lists)
        rest = groups.pop("", [])
        prefixes = sorted(groups, key=_block_sort_key)
        for i, prefix in enumerate(prefixes, start=1):
            log(f" - block {i}/{len(prefixes)}: {prefix}")
            block = model.get_submodule(prefix)
            cut = len(prefix) + 1
            tensors = st.read_many(groups[prefix])
            state = {k[cut:]: _cast(v, dtype) for k, v in tensors.items()}
            del tensors
            block.load_state_dict(state, assign=True)
            del state
            _check_loaded(block, st.path, prefix + ".")
            if on_block is not None:
                on_block(prefix, block)
            del block
        log(f" - remaining tensors ({len(rest)})")
        tensors = st.read_many(rest)
        state = {k: _cast(v, dtype) for k, v in tensors.items()}
        del tensors
        model.load_state_dict(state, assign=True, strict=False)
        del state
        # blocks were checked as they loaded; on_block may have placed them on the meta device
        _check_loaded(model, st.path, "", skip=tuple(p + "." for p in prefixes))
        if on_rest is not None:
            on_rest(model)


def _check_loaded(module: torch.nn.Module, path, prefix: str, skip: Tuple[str, ...] = ()) -> None:
    left = [prefix + n for n, p in module.named_parameters() if p.is_meta and not n.startswith(skip)]
    if left:
        raise ValueError(f"{path}: parameters left unloaded: {left[:5]}")


def _cast(tensor: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    if dtype is None or tensor.dtype == dtype or not tensor.is_floating_point():
        return tensor
    return tensor.to(dtype)
