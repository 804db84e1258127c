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

import os
import re
import sys
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from flux2_contract.safetensors_header import (  # noqa: F401  (names this module's users import from it)
    _DTYPES,
    MAX_HEADER_BYTES,
    Header,
    SafetensorsHeaderError,
    TensorEntry,
    parse_header,
    read_header,
)

_READ_CHUNK = 64 * 1024 * 1024


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

    torch's random generators are left as they were: optimum-quanto's quantize
    draws from them, and a run's training_seed must give the same LoRA
    initialisation, noise and timesteps whatever the qtype.
    """
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        _load_blockwise(model, path, block_lists, on_block, on_rest, dtype, log)


def _load_blockwise(model, path, block_lists, on_block, on_rest, dtype, log) -> None:
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
        _load_into_owners(model, state)
        del state
        # blocks were checked as they loaded; on_block may have placed them on the meta device
        _check_loaded(model, st.path, "", skip=tuple(p + "." for p in prefixes))
        if on_rest is not None:
            on_rest(model)


def _load_into_owners(model: torch.nn.Module, state: Dict[str, torch.Tensor]) -> None:
    """Assign each tensor to the module that owns it, never through the whole model: a block
    already quantized by optimum-quanto (qint8, qfloat8) would look for its packed weight in this
    partial state dict and fail on the missing key. Each owner loads as `load_state_dict(...,
    assign=True)` loads it, without recursing into its children."""
    owners: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        owner, _, name = key.rpartition(".")
        owners.setdefault(owner, {})[name] = tensor
    for owner, tensors in owners.items():
        errors: List[str] = []
        model.get_submodule(owner)._load_from_state_dict(
            tensors, "", {"assign_to_params_buffers": True}, True, [], [], errors)
        if errors:
            raise ValueError(f"{owner or 'the model'}: {'; '.join(errors)}")


def _check_loaded(module: torch.nn.Module, path, prefix: str, skip: Tuple[str, ...] = ()) -> None:
    left = [prefix + n for n, p in module.named_parameters() if p.is_meta and not n.startswith(skip)]
    if left:
        raise ValueError(f"{path}: parameters left unloaded: {left[:5]}")


def _cast(tensor: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    if dtype is None or tensor.dtype == dtype or not tensor.is_floating_point():
        return tensor
    return tensor.to(dtype)
