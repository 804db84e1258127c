"""On-disk cache of a quantized transformer that can never execute code when loaded.

Quantizing the FLUX.2 transformer to 4 bit takes minutes at every launch. After the
first quantization the result is written here once and later launches load it in
seconds.

File format: a plain safetensors file (8-byte little-endian header length, JSON
header, raw tensor bytes) written and read by this module with ordinary file reads
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

One file serves both trainers: the AMD fork (torchao uint2..uint8 and float8, and
int4_fused: Int4Linear block Linears) and upstream ai-toolkit (torchao int8/float8,
and uint2..uint8, orbit, ... as OstrisLinear). The OstrisLinear code is imported only
when a model or a cache has such modules, so the fork, which has none, never needs it.
optimum-quanto qtypes (qint4, qfloat8, ...) are skipped: their packed layout depends
on the device they were quantized on.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import os
import re
import shutil
import struct
import time
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from toolkit.staged_load import STAGING_BUFFER_BYTES, STAGING_BUFFERS, StagedReadError, TensorSpan, read_spans

FORMAT_NAME = "aitk-quantized-cache"
# bump when the file layout or the meaning of an entry changes: old caches go stale
# 2: "modules" entries for replaced modules (Int4Linear)
# 3: one layout for both trainers: "modules" and "ostris" (OstrisLinear records) always present
FORMAT_VERSION = 3
META_KEY = "aitk_qcache"
META_SHA_KEY = "aitk_qcache_sha256"
CACHE_SUFFIX = ".qcache.safetensors"
ENV_CACHE_DIR = "AITK_QUANT_CACHE_DIR"
ENV_FORK_COMMIT = "AITK_FORK_COMMIT"

_MAX_HEADER_BYTES = 256 * 1024 * 1024
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


# ---------------------------------------------------------------------------
# allow-lists: the only classes a cache file can ask for


def _torchao_classes() -> Tuple[Dict[str, type], Dict[str, type]]:
    """(tensor subclasses, attribute value classes) a cache may name."""
    from torchao.dtypes.affine_quantized_tensor import AffineQuantizedTensor
    from torchao.dtypes.uintx.plain_layout import PlainAQTTensorImpl
    from torchao.dtypes.uintx.uintx_layout import (
        UintxAQTTensorImpl,
        UintxLayout,
        UintxTensor,
    )
    from torchao.dtypes.utils import PlainLayout
    from torchao.quantization.quant_primitives import ZeroPointDomain

    tensors = {
        "AffineQuantizedTensor": AffineQuantizedTensor,
        "PlainAQTTensorImpl": PlainAQTTensorImpl,
        "UintxAQTTensorImpl": UintxAQTTensorImpl,
        "UintxTensor": UintxTensor,
    }
    values = {
        "PlainLayout": PlainLayout,
        "UintxLayout": UintxLayout,
        "ZeroPointDomain": ZeroPointDomain,
    }
    try:
        from torchao.dtypes.floatx.float8_layout import (
            Float8AQTTensorImpl,
            Float8Layout,
        )
        from torchao.float8.inference import Float8MMConfig

        tensors["Float8AQTTensorImpl"] = Float8AQTTensorImpl
        values["Float8Layout"] = Float8Layout
        values["Float8MMConfig"] = Float8MMConfig
    except ImportError:
        pass
    return tensors, values


def _module_kinds() -> Dict[str, type]:
    """Module classes a quantizer puts in place of nn.Linear, by the kind name a cache uses.
    Each provides to_tensors(prefix) -> (tensors, meta) and from_tensors(tensors, meta, prefix)."""
    from toolkit.int4_linear import Int4Linear

    return {"int4_linear": Int4Linear}


_OSTRIS_MODULE = "toolkit.util.ostris_quant"


def _ostris_api():
    """The trainer's OstrisLinear module, or None where the trainer has none (the AMD fork).
    Imported on demand: only upstream ai-toolkit has it, and only its qtypes need it."""
    import importlib

    try:
        return importlib.import_module(_OSTRIS_MODULE)
    except ModuleNotFoundError as e:
        if e.name != _OSTRIS_MODULE:
            raise  # the module exists but one of its own imports is missing
        return None


def _encode_value(v: Any, values: Dict[str, type]) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        if isinstance(v, float) and not (v == v and abs(v) != float("inf")):
            return {"t": "float", "v": repr(v)}
        return v
    if isinstance(v, torch.dtype):
        return {"t": "dtype", "v": str(v).replace("torch.", "")}
    if isinstance(v, torch.Size):
        return {"t": "size", "v": [int(x) for x in v]}
    if isinstance(v, enum.Enum):
        name = type(v).__name__
        if values.get(name) is not type(v):
            raise TypeError(f"enum {type(v)!r} is not in the cache allow-list")
        return {"t": "enum", "cls": name, "v": v.name}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        name = type(v).__name__
        if values.get(name) is not type(v):
            raise TypeError(f"{type(v)!r} is not in the cache allow-list")
        fields = {
            f.name: _encode_value(getattr(v, f.name), values)
            for f in dataclasses.fields(v)
        }
        return {"t": "obj", "cls": name, "v": fields}
    if isinstance(v, tuple) and hasattr(v, "_fields"):
        name = type(v).__name__
        if values.get(name) is not type(v):
            raise TypeError(f"{type(v)!r} is not in the cache allow-list")
        fields = {f: _encode_value(getattr(v, f), values) for f in v._fields}
        return {"t": "obj", "cls": name, "v": fields}
    if isinstance(v, tuple):
        return {"t": "tuple", "v": [_encode_value(x, values) for x in v]}
    if isinstance(v, list):
        return {"t": "list", "v": [_encode_value(x, values) for x in v]}
    raise TypeError(f"cannot store attribute of type {type(v)!r} in the cache")


def _decode_value(v: Any, values: Dict[str, type]) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if not isinstance(v, dict) or "t" not in v:
        raise CacheError(f"bad attribute encoding {v!r}")
    t = v["t"]
    if t == "float":
        return float(v["v"])
    if t == "dtype":
        dt = getattr(torch, str(v["v"]), None)
        if not isinstance(dt, torch.dtype):
            raise CacheError(f"unknown dtype {v['v']!r}")
        return dt
    if t == "size":
        return torch.Size(_int_list(v["v"]))
    if t in ("tuple", "list"):
        items = [_decode_value(x, values) for x in v["v"]]
        return tuple(items) if t == "tuple" else items
    if t in ("enum", "obj"):
        cls = values.get(v.get("cls"))
        if cls is None:
            raise CacheError(f"class {v.get('cls')!r} is not in the cache allow-list")
        if t == "enum":
            if not issubclass(cls, enum.Enum):
                raise CacheError(f"{v['cls']} is not an enum")
            try:
                return cls[v["v"]]
            except KeyError:
                raise CacheError(f"unknown {v['cls']} member {v['v']!r}") from None
        if not isinstance(v.get("v"), dict):
            raise CacheError(f"bad fields for {v['cls']}")
        fields = {str(k): _decode_value(x, values) for k, x in v["v"].items()}
        try:
            return cls(**fields)
        except TypeError as e:
            raise CacheError(f"cannot rebuild {v['cls']}: {e}") from None
    raise CacheError(f"unknown attribute kind {t!r}")


def _int_list(v: Any) -> List[int]:
    if not isinstance(v, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v
    ):
        raise CacheError(f"bad shape {v!r}")
    return v


# ---------------------------------------------------------------------------
# turning a model's parameters into (entries, tensors) and back


def _flatten(t: torch.Tensor, base: str, tensors: Dict[str, torch.Tensor], allowed):
    """Describe tensor `t` as a JSON tree; store its plain leaves in `tensors`."""
    tensor_classes, values = allowed
    cls = type(t)
    if cls in (torch.Tensor, torch.nn.Parameter):
        tensors[base] = t
        return {"tensor": base}
    name = cls.__name__
    if tensor_classes.get(name) is not cls:
        raise TypeError(
            f"{base}: tensor class {cls.__module__}.{name} is not supported by the cache"
        )
    inner_names, attrs = t.__tensor_flatten__()
    inner = []
    for n in inner_names:
        inner.append([n, _flatten(getattr(t, n), f"{base}.{n}", tensors, allowed)])
    return {
        "subclass": name,
        "attrs": [_encode_value(a, values) for a in attrs],
        "inner": inner,
        "size": [int(x) for x in t.shape],
        "stride": [int(x) for x in t.stride()],
    }


def _unflatten(node: Any, tensors: Dict[str, torch.Tensor], allowed, used: set):
    tensor_classes, values = allowed
    if not isinstance(node, dict):
        raise CacheError("bad entry in cache metadata")
    if "tensor" in node:
        name = node["tensor"]
        if name not in tensors:
            raise CacheError(f"missing tensor {name!r}")
        used.add(name)
        return tensors[name]
    cls = tensor_classes.get(node.get("subclass"))
    if cls is None:
        raise CacheError(
            f"tensor class {node.get('subclass')!r} is not in the cache allow-list"
        )
    inner = node.get("inner")
    if not isinstance(inner, list):
        raise CacheError("bad inner tensor list")
    inner_dict = {}
    for item in inner:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
            raise CacheError("bad inner tensor list")
        inner_dict[item[0]] = _unflatten(item[1], tensors, allowed, used)
    attrs = [_decode_value(a, values) for a in node.get("attrs", [])]
    size = torch.Size(_int_list(node.get("size")))
    stride = tuple(_int_list(node.get("stride")))
    try:
        out = cls.__tensor_unflatten__(inner_dict, attrs, size, stride)
    except CacheError:
        raise
    except Exception as e:  # a wrong attribute list makes the constructor throw
        raise CacheError(f"cannot rebuild {node.get('subclass')}: {e}") from None
    if tuple(out.shape) != tuple(size):
        raise CacheError(f"rebuilt {node.get('subclass')} has shape {tuple(out.shape)}, expected {tuple(size)}")
    return out


def _named_state(model: torch.nn.Module, swaps: Optional[Dict[str, torch.nn.Module]] = None):
    """(name, tensor, is_param, requires_grad) for every parameter and buffer, aliases kept;
    modules named in `swaps` count as replaced by the given ones."""
    out = []
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        if swaps and mod_name in swaps:
            mod = swaps[mod_name]
        prefix = f"{mod_name}." if mod_name else ""
        for n, p in mod._parameters.items():
            if p is not None:
                out.append((prefix + n, p, True, bool(p.requires_grad)))
        for n, b in mod._buffers.items():
            if b is not None:
                out.append((prefix + n, b, False, False))
    seen = set()
    uniq = []
    for item in out:
        if item[0] not in seen:
            seen.add(item[0])
            uniq.append(item)
    return uniq


def _replaced_modules(model: torch.nn.Module) -> Dict[str, Tuple[str, torch.nn.Module]]:
    """{module name: (kind, module)} for every module a cache stores as a module entry."""
    by_class = {cls: kind for kind, cls in _module_kinds().items()}
    return {
        name: (by_class[type(mod)], mod)
        for name, mod in model.named_modules()
        if name and type(mod) in by_class
    }


def _ostris_modules(model: torch.nn.Module) -> Dict[str, torch.nn.Module]:
    """{name: module} of every OstrisLinear: a Linear whose weight became backend buffers
    in place (class swap). Found by its marker, so no import is needed to look."""
    return {n: m for n, m in model.named_modules() if getattr(m, "is_ostris_quantized", False)}


# OstrisLinear attributes that are the module's own, never restored from a record
_OSTRIS_FIXED = ("training", "in_features", "out_features", "ostris_quantizer", "ostris_orig_dtype")
_OSTRIS_DTYPES = ("bfloat16", "float16", "float32")


def _ostris_entry(module: torch.nn.Module) -> Dict[str, Any]:
    """What rebuilds an OstrisLinear from its buffers: qtype, weight dtype, scalar attributes."""
    qtype = getattr(module.ostris_quantizer, "qtype", None)
    if qtype is None:
        raise TypeError(f"{type(module.ostris_quantizer).__name__} has no qtype recorded")
    attrs = {
        k: v for k, v in vars(module).items()
        if not k.startswith("_") and k not in _OSTRIS_FIXED and isinstance(v, (bool, int, float, str))
    }
    return {
        "qtype": qtype,
        "dtype": str(module.ostris_orig_dtype).replace("torch.", ""),
        "buffers": sorted(n for n, b in module._buffers.items() if b is not None),
        "attrs": attrs,
    }


def _names_as_built(model: torch.nn.Module) -> set:
    """The parameter/buffer names of `model` as a freshly built (meta) model has them:
    a replaced module counts as the nn.Linear it replaced, an OstrisLinear's buffers as
    its weight."""
    replaced = _replaced_modules(model)
    ostris = _ostris_modules(model)
    names = set()
    for n, _, _, _ in _named_state(model):
        owner, _, leaf = n.rpartition(".")
        if owner in replaced or (owner in ostris and leaf in ostris[owner]._buffers):
            continue  # counted below as the Linear's weight (and bias)
        names.add(n)
    for name, (_, mod) in replaced.items():
        names.add(f"{name}.weight")
        if getattr(mod, "bias", None) is not None:
            names.add(f"{name}.bias")
    names.update(f"{name}.weight" for name in ostris)
    return names


def model_signature(model: torch.nn.Module) -> str:
    """Hash of the parameter/buffer names and shapes (dtype left out: meta models are fp32)."""
    h = hashlib.sha256()
    for name, t, is_param, _ in sorted(_named_state(model), key=lambda x: x[0]):
        h.update(f"{name}|{tuple(t.shape)}|{int(is_param)};".encode())
    return h.hexdigest()


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


def _collect_state(model: torch.nn.Module) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """(the aitk_qcache sections, the plain tensors to store) for `model`."""
    allowed = _torchao_classes()
    tensors: Dict[str, torch.Tensor] = {}
    entries: Dict[str, Any] = {}
    modules: Dict[str, Any] = {}
    for mod_name, (kind, mod) in _replaced_modules(model).items():
        mod_tensors, mod_meta = mod.to_tensors(prefix=f"{mod_name}.")
        tensors.update(mod_tensors)
        modules[mod_name] = {"kind": kind, "meta": mod_meta, "tensors": sorted(mod_tensors)}
    by_id: Dict[int, str] = {}
    for name, t, is_param, rg in _named_state(model):
        if name.rpartition(".")[0] in modules:
            continue  # stored by its module entry
        if id(t) in by_id:
            entries[name] = {"alias_of": by_id[id(t)], "param": is_param}
            continue
        by_id[id(t)] = name
        tree = _flatten(t, name, tensors, allowed)
        entries[name] = {"param": is_param, "requires_grad": rg, "tree": tree}
    ostris = {n: _ostris_entry(m) for n, m in _ostris_modules(model).items()}
    return {"entries": entries, "modules": modules, "ostris": ostris}, tensors


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


def write_cache(path: Path, model: torch.nn.Module, key: Dict[str, Any]) -> int:
    """Write `model`'s quantized state to `path` atomically. Returns bytes written.

    The checksums are fixed-width hex: a placeholder header is written, the data is
    streamed while hashing, then the header is rewritten in place (same length)."""
    path = Path(path)
    sections, tensors = _collect_state(model)
    tensor_index, data_size = _tensor_index(tensors)
    names = list(tensor_index)
    placeholder = _header(key, sections, tensor_index, {n: "0" * 64 for n in names})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.time_ns()}.tmp")
    checksums: Dict[str, str] = {}
    try:
        with open(tmp, "wb") as f:
            f.write(placeholder)
            for n in names:
                data = _tensor_bytes(tensors[n])
                checksums[n] = hashlib.sha256(data).hexdigest()
                for start in range(0, len(data), _CHUNK):
                    f.write(data[start : start + _CHUNK])
            final = _header(key, sections, tensor_index, checksums)
            if len(final) != len(placeholder):
                raise RuntimeError("cache header changed size while writing")
            f.seek(0)
            f.write(final)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)
    return len(placeholder) + data_size


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
    if file_size < 8:
        raise CacheError(f"file is {file_size} bytes, too short for a header")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > _MAX_HEADER_BYTES or 8 + n > file_size:
        raise CacheError(f"header length {n} does not fit a {file_size}-byte file")
    raw = f.read(n)
    if len(raw) != n:
        raise CacheError("file ends inside the header")
    try:
        index = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CacheError(f"header is not valid JSON ({e})") from None
    if not isinstance(index, dict):
        raise CacheError("header is not a JSON object")
    return index, 8 + n


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
        meta = json.loads(meta_json)
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


def _read_tensors(f, layout, data_start: int, checksums: Dict[str, str], device: torch.device,
                  staging: Optional[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
    """Read every tensor onto `device` with plain reads, each checked against its sha256
    (toolkit/staged_load.py: a GPU target through bounded staging buffers)."""
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
    path: Path, device: torch.device = torch.device("cpu"), staging: Optional[Dict[str, Any]] = None
) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """Read the whole file with plain reads onto `device` and verify every byte; a GPU target
    goes through bounded staging buffers (options in `staging`), so host RAM never holds the
    model. Raises CacheError."""
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


def rebuild_modules(
    meta: Dict[str, Any], tensors: Dict[str, torch.Tensor], model: torch.nn.Module, used: set
) -> Dict[str, torch.nn.Module]:
    """Rebuild every replaced module (e.g. Int4Linear) from its tensors, checked against the
    nn.Linear it replaces in `model` (may live on meta). Returns {name: module}; `model`
    is not changed."""
    kinds = _module_kinds()
    swaps: Dict[str, torch.nn.Module] = {}
    for name, entry in meta["modules"].items():
        if not (isinstance(entry, dict) and isinstance(entry.get("meta"), dict)
                and isinstance(entry.get("tensors"), list)):
            raise CacheError(f"bad module entry for {name!r}")
        cls = kinds.get(entry.get("kind"))
        if cls is None:
            raise CacheError(f"module kind {entry.get('kind')!r} is not in the cache allow-list")
        try:
            target = model.get_submodule(name) if name else None
        except AttributeError:
            target = None
        if not isinstance(target, torch.nn.Linear):
            raise CacheError(f"module entry {name!r} does not name a Linear of the model")
        info = entry["meta"]
        has_bias = target.bias is not None
        if (info.get("in_features"), info.get("out_features"), info.get("bias")) != (
            target.in_features, target.out_features, has_bias
        ):
            raise CacheError(
                f"{name}: cached {info.get('in_features')}->{info.get('out_features')} "
                f"bias={info.get('bias')}, model has {target.in_features}->{target.out_features} bias={has_bias}"
            )
        want = {f"{name}.{n}" for n in ("qweight", "scale", "zero")} | ({f"{name}.bias"} if has_bias else set())
        if set(entry["tensors"]) != want or not want <= set(tensors):
            raise CacheError(f"{name}: module tensors {sorted(entry['tensors'])[:5]}, expected {sorted(want)}")
        for n in ("scale", "bias") if has_bias else ("scale",):
            if not tensors[f"{name}.{n}"].is_floating_point():
                raise CacheError(f"{name}.{n} is not floating point")
        if has_bias and tuple(tensors[f"{name}.bias"].shape) != (target.out_features,):
            raise CacheError(f"{name}.bias has shape {tuple(tensors[f'{name}.bias'].shape)}")
        try:
            swaps[name] = cls.from_tensors(tensors, info, prefix=f"{name}.")
        except (ValueError, KeyError, TypeError) as e:
            raise CacheError(f"cannot rebuild {name}: {e}") from None
        used.update(want)
    return swaps


def _check_ostris(meta: Dict[str, Any], model: torch.nn.Module, swaps: Dict[str, torch.nn.Module]) -> Dict[str, Any]:
    """Validate the cache's OstrisLinear records against `model` before anything changes;
    returns them. A trainer without OstrisLinear cannot use a cache that has some."""
    records = meta["ostris"]
    if not records:
        return records
    api = _ostris_api()
    if api is None:
        first = next(iter(records.values()))
        qtype = first.get("qtype") if isinstance(first, dict) else None
        raise CacheError(
            f"the cache holds OstrisLinear modules (qtype {qtype!r}), but this trainer has no "
            f"{_OSTRIS_MODULE}; it was written by another ai-toolkit"
        )
    qtype = _ostris_record_qtype(meta["key"].get("qtype"))
    for mod_name, rec in records.items():
        if mod_name in swaps:
            raise CacheError(f"{mod_name}: both a module entry and an ostris record")
        _check_ostris_record(api, mod_name, rec, model, qtype)
    return records


def _ostris_record_qtype(cache_qtype: Optional[str]) -> Optional[str]:
    """The qtype a cache's OstrisLinear records carry: the cache's own, or for int4_fused (Int4Linear
    block Linears) the uint4 backend its qtype quantizes the rest of the model with."""
    from toolkit.util import quantize

    try:
        quantizer = getattr(quantize.get_qtype(cache_qtype), "quantizer", None)
    except Exception:  # not a qtype this trainer knows: the records' check reports it
        return cache_qtype
    return getattr(quantizer, "qtype", None) or cache_qtype


def _check_ostris_record(api, mod_name: str, rec: Any, model: torch.nn.Module, qtype: Optional[str]) -> None:
    """One record: names a plain Linear of the model, this cache's qtype, a float dtype,
    and only buffer/attribute names that cannot shadow the module's own."""
    if not isinstance(rec, dict) or not mod_name:
        raise CacheError(f"bad ostris record for {mod_name!r}")
    try:
        mod = model.get_submodule(mod_name)
    except AttributeError:
        raise CacheError(f"{mod_name}: no such module in the model") from None
    if not isinstance(mod, torch.nn.Linear) or getattr(mod, "is_ostris_quantized", False):
        raise CacheError(f"{mod_name}: not a plain Linear in the freshly built model")
    if rec.get("qtype") != qtype or api.get_ostris_quantizer(str(rec.get("qtype"))) is None:
        raise CacheError(f"{mod_name}: qtype {rec.get('qtype')!r} is not this cache's {qtype!r}")
    if rec.get("dtype") not in _OSTRIS_DTYPES:
        raise CacheError(f"{mod_name}: weight dtype {rec.get('dtype')!r} not allowed")
    buffers, attrs = rec.get("buffers"), rec.get("attrs")
    if not isinstance(buffers, list) or not isinstance(attrs, dict):
        raise CacheError(f"{mod_name}: bad buffer or attribute list")
    for name in list(buffers) + list(attrs):
        if (not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name)
                or name in _OSTRIS_FIXED or hasattr(api.OstrisLinear, name)):
            raise CacheError(f"{mod_name}: attribute name {name!r} not allowed")
    if not all(isinstance(v, (bool, int, float, str)) for v in attrs.values()):
        raise CacheError(f"{mod_name}: attribute values must be scalars")


def _expected_state(
    model: torch.nn.Module, swaps: Dict[str, torch.nn.Module], ostris: Dict[str, Any]
) -> Dict[str, Tuple[Optional[torch.Tensor], bool]]:
    """{name: (reference tensor or None, is_param)} the cache's entries must cover: the
    model's own, less what module entries store, with each OstrisLinear's weight as its
    backend buffers (their shapes are the backend's business)."""
    expected = {
        name: (t, is_param)
        for name, t, is_param, _ in _named_state(model, swaps)
        if name.rpartition(".")[0] not in swaps
    }
    for mod_name, rec in ostris.items():
        expected.pop(f"{mod_name}.weight", None)
        for buf in rec["buffers"]:
            expected[f"{mod_name}.{buf}"] = (None, False)
    return expected


class Rebuilt(NamedTuple):
    """What rebuild_state checked and assign_state puts in place."""

    state: Dict[str, Tuple[torch.Tensor, bool, bool]]  # name -> (tensor, is_param, requires_grad)
    swaps: Dict[str, torch.nn.Module]  # module name -> replacement (Int4Linear)
    ostris: Dict[str, Any]  # module name -> OstrisLinear record


@_corrupt_on_error("cache metadata")
def rebuild_state(meta: Dict[str, Any], tensors: Dict[str, torch.Tensor], model: torch.nn.Module) -> Rebuilt:
    """Rebuild every parameter/buffer and replaced module and check them against `model`
    (may live on meta). Returns what assign_state needs; `model` is not changed."""
    allowed = _torchao_classes()
    used: set = set()
    swaps = rebuild_modules(meta, tensors, model, used)
    ostris = _check_ostris(meta, model, swaps)
    expected = _expected_state(model, swaps, ostris)
    entries = meta["entries"]
    if set(entries) != set(expected):
        missing = sorted(set(expected) - set(entries))[:5]
        extra = sorted(set(entries) - set(expected))[:5]
        raise CacheError(f"cache does not match the model: missing {missing}, unexpected {extra}")
    out: Dict[str, Tuple[torch.Tensor, bool, bool]] = {}
    aliases = {}
    for name, entry in entries.items():
        if not isinstance(entry, dict):
            raise CacheError(f"bad entry for {name}")
        if "alias_of" in entry:
            aliases[name] = entry
            continue
        t = _unflatten(entry.get("tree"), tensors, allowed, used)
        ref, is_param = expected[name]
        if ref is not None and tuple(t.shape) != tuple(ref.shape):
            raise CacheError(f"{name}: cached shape {tuple(t.shape)}, model has {tuple(ref.shape)}")
        if bool(entry.get("param")) != is_param:
            raise CacheError(f"{name}: parameter/buffer kind differs from the model")
        out[name] = (t, is_param, bool(entry.get("requires_grad")))
    for name, entry in aliases.items():
        src = entry.get("alias_of")
        if src not in out:
            raise CacheError(f"{name}: alias of unknown {src!r}")
        out[name] = out[src]
    if used != set(tensors):
        raise CacheError(f"unreferenced tensors in cache: {sorted(set(tensors) - used)[:5]}")
    return Rebuilt(out, swaps, ostris)


def _make_ostris(model: torch.nn.Module, records: Dict[str, Any]) -> None:
    """Turn each recorded Linear into an OstrisLinear shell; its buffers are assigned next."""
    if not records:
        return
    api = _ostris_api()
    for mod_name, rec in records.items():
        mod = model.get_submodule(mod_name)
        del mod._parameters["weight"]
        mod.ostris_orig_dtype = getattr(torch, rec["dtype"])
        mod.__class__ = api.OstrisLinear
        mod.ostris_quantizer = api.get_ostris_quantizer(rec["qtype"])
        for k, v in rec["attrs"].items():
            setattr(mod, k, v)


def assign_state(
    model: torch.nn.Module,
    state: Dict[str, Tuple[torch.Tensor, bool, bool]],
    swaps: Optional[Dict[str, torch.nn.Module]] = None,
    ostris: Optional[Dict[str, Any]] = None,
) -> None:
    """Put a rebuild_state result into `model` (call as assign_state(model, *rebuilt))."""
    for name, module in (swaps or {}).items():
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, module)
    _make_ostris(model, ostris or {})
    made: Dict[int, torch.nn.Parameter] = {}
    for name, (t, is_param, rg) in state.items():
        mod_name, _, leaf = name.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        if is_param:
            p = made.get(id(t))
            if p is None:
                p = torch.nn.Parameter(t, requires_grad=rg and t.is_floating_point() and type(t) is torch.Tensor)
                made[id(t)] = p
            mod._parameters[leaf] = p
        elif mod_name in (ostris or {}):
            # backend state: not part of state_dict(), as when quantized in place
            mod.register_buffer(leaf, t, persistent=False)
        else:
            mod._buffers[leaf] = t


# ---------------------------------------------------------------------------
# cache key


def source_fingerprint(path: Path) -> Dict[str, Any]:
    """size, mtime and a hash of the header bytes of the source checkpoint."""
    path = Path(path)
    st = path.stat()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        first = f.read(8)
        h.update(first)
        n = struct.unpack("<Q", first)[0] if len(first) == 8 else 0
        # a safetensors header; otherwise the first MiB
        limit = n if 0 < n <= _MAX_HEADER_BYTES and 8 + n <= st.st_size else 1 << 20
        h.update(f.read(limit))
    return {
        "name": path.name,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "header_sha256": h.hexdigest(),
    }


def fork_commit(checkout: Optional[Path] = None) -> str:
    """The trainer checkout's git HEAD without running git; env AITK_FORK_COMMIT, else 'unknown'."""
    checkout = Path(checkout) if checkout else Path(__file__).resolve().parents[1]
    try:
        git = checkout / ".git"
        if git.is_file():  # worktree / submodule: "gitdir: <path>"
            line = git.read_text(encoding="utf-8").strip()
            if line.startswith("gitdir:"):
                git = (checkout / line[len("gitdir:"):].strip()).resolve()
        head = (git / "HEAD").read_text(encoding="utf-8").strip()
        if not head.startswith("ref:"):
            if len(head) == 40:
                return head
        else:
            ref = head[4:].strip()
            common = git
            if (git / "commondir").is_file():
                common = (git / (git / "commondir").read_text(encoding="utf-8").strip()).resolve()
            for base in (git, common):
                if (base / ref).is_file():
                    return (base / ref).read_text(encoding="utf-8").strip()
            packed = common / "packed-refs"
            if packed.is_file():
                for line in packed.read_text(encoding="utf-8").splitlines():
                    parts = line.split()
                    if len(parts) == 2 and parts[1] == ref:
                        return parts[0]
    except (OSError, UnicodeDecodeError, ValueError):
        pass
    return os.environ.get(ENV_FORK_COMMIT) or "unknown"


def _torchao_version() -> str:
    try:
        import torchao

        return str(getattr(torchao, "__version__", "unknown"))
    except ImportError:
        return "missing"


# ---------------------------------------------------------------------------
# the object the model loader uses


class QuantizedCache:
    """Cache for one (source checkpoint, qtype) pair."""

    def __init__(
        self,
        cache_dir: Path,
        source_path: Path,
        qtype: str,
        model_signature: str,
        extra_key: Optional[Dict[str, Any]] = None,
    ):
        self.source_path = Path(source_path)
        self.qtype = str(qtype)
        tag = hashlib.sha256(str(self.source_path.resolve()).encode()).hexdigest()[:10]
        name = f"{self.source_path.stem}-{self.qtype}-{tag}{CACHE_SUFFIX}"
        self.path = Path(cache_dir).expanduser().resolve() / name
        # names a rebuilt model must have; set by cache_for_model from the meta model
        self.expected_names: Optional[set] = None
        # read_spans options for a GPU load (buffers, buffer_bytes, pin); see staging_options
        self.staging: Dict[str, Any] = {}
        self.key = {
            "format_version": FORMAT_VERSION,
            "source": source_fingerprint(self.source_path),
            "qtype": self.qtype,
            "fork_commit": fork_commit(),
            "torchao": _torchao_version(),
            "model_signature": model_signature,
        }
        if extra_key:
            self.key.update(extra_key)

    @_corrupt_on_error("cache key")
    def _stale_reason(self, cached_key: Any) -> Optional[str]:
        if not isinstance(cached_key, dict):
            return "cache has no key"
        diffs = []
        for k in sorted(set(self.key) | set(cached_key)):
            if cached_key.get(k) != self.key.get(k):
                diffs.append(f"{k}: cached {_short(cached_key.get(k))}, now {_short(self.key.get(k))}")
        return "; ".join(diffs) or None

    def aside_path(self) -> Path:
        """Where the next corrupt file goes: <name>.corrupt-1, -2, ...; none is overwritten."""
        number = 1
        while self.path.with_name(f"{self.path.name}.corrupt-{number}").exists():
            number += 1
        return self.path.with_name(f"{self.path.name}.corrupt-{number}")

    def _set_aside(self, why: str) -> None:
        aside = self.aside_path()
        try:
            os.replace(self.path, aside)
            _say(f"corrupt cache {self.path}: {why}. Moved it to {aside} (safe to delete); quantizing again")
        except OSError as e:
            _say(f"corrupt cache {self.path}: {why}. Could not move it aside ({e}); quantizing again")
            try:
                self.path.unlink()
            except OSError:
                pass

    def load_into(self, model: torch.nn.Module, device: torch.device = torch.device("cpu")) -> bool:
        """Fill `model` (built on meta) from the cache, every tensor on `device`. False if there
        is no usable cache; the model is untouched then, and a corrupt file has been set aside."""
        if not self.path.is_file():
            _say(f"no cache at {self.path} yet; it will be written after quantizing")
            return False
        t0 = time.perf_counter()
        try:
            meta = read_meta(self.path)
            reason = self._stale_reason(meta.get("key"))
            if reason:
                _say(f"stale cache {self.path} ({reason}); quantizing again, it will be replaced")
                return False
            meta, tensors = read_cache(self.path, device, self.staging)
            rebuilt = rebuild_state(meta, tensors, model)
            del tensors
        except CacheError as e:
            self._set_aside(str(e))
            return False
        except OSError as e:
            _say(f"cannot read {self.path} ({e}); quantizing again")
            return False
        assign_state(model, *rebuilt)
        size, seconds = self.path.stat().st_size / 2**30, time.perf_counter() - t0
        print(
            f"Loaded quantized transformer from cache {self.path} onto {device} "
            f"({size:.2f} GiB in {seconds:.1f} s, {size / max(seconds, 1e-9):.2f} GiB/s)",
            flush=True,
        )
        return True

    def save(self, model: torch.nn.Module) -> bool:
        """Write the cache; a failure is reported and never stops training."""
        t0 = time.perf_counter()
        if self.expected_names is not None:
            names = _names_as_built(model)
            if names != self.expected_names:
                odd = sorted(names ^ self.expected_names)[:3]
                _say(
                    f"the quantized model has parameters a freshly built model lacks (e.g. {odd}: "
                    f"modules replaced while quantizing?); not writing a cache that could not be loaded"
                )
                return False
        try:
            need = sum(
                t.numel() * t.element_size() for _, t, _, _ in _named_state(model)
                if type(t) in (torch.Tensor, torch.nn.Parameter)
            )
            self.path.parent.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.path.parent).free
            # quantized weights report their unpacked size above, so this over-estimates
            if free < need // 3 + (256 << 20):
                _say(f"only {free / 2**30:.1f} GiB free in {self.path.parent}; not writing the cache")
                return False
            size = write_cache(self.path, model, self.key)
        except Exception as e:
            _say(f"could not write {self.path}: {type(e).__name__}: {e}; training goes on without it")
            return False
        _say(f"wrote {self.path} ({size / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s)")
        return True


def _bool(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(v)


def cache_dir_for(model_kwargs: Dict[str, Any], training_folder: Optional[str]) -> Optional[Path]:
    """model_kwargs.quantized_cache_dir, else $AITK_QUANT_CACHE_DIR, else
    <training_folder>/../quant_cache (shared by the runs of one output folder);
    None when none is known (the model was not built by a training process)."""
    if model_kwargs.get("quantized_cache_dir"):
        return Path(str(model_kwargs["quantized_cache_dir"]))
    if os.environ.get(ENV_CACHE_DIR):
        return Path(os.environ[ENV_CACHE_DIR])
    if training_folder:
        return Path(training_folder).resolve().parent / "quant_cache"
    return None


def _cache_qtype(qtype: str) -> str:
    """int4_w4a8 is the int4_fused model with other matmuls: one cache file serves both."""
    from toolkit.util import quantize

    if qtype == getattr(quantize, "INT4_W4A8", None):
        return quantize.INT4_FUSED
    return qtype


def _cached_backend(qtype: str) -> Optional[str]:
    """Which cacheable backend quantizes `qtype` in this trainer: "torchao", "int4_fused"
    (the fork's Int4Linear), "ostris" (upstream's OstrisLinear), or None (optimum-quanto)."""
    from toolkit.util import quantize

    if qtype in quantize.torchao_qtypes:
        return "torchao"
    if qtype == getattr(quantize, "INT4_FUSED", None):
        return "int4_fused"
    api = _ostris_api()
    if api is not None and api.get_ostris_quantizer(qtype) is not None:
        return "ostris"
    return None


def cache_for_model(base_model, source_path, model: torch.nn.Module) -> Optional[QuantizedCache]:
    """The cache for a BaseModel's transformer, or None when it is off or not possible."""
    cfg = base_model.model_config
    kwargs = getattr(cfg, "model_kwargs", None) or {}
    if not cfg.quantize or not _bool(kwargs.get("quantized_cache", True)):
        return None
    qtype = cfg.qtype if isinstance(cfg.qtype, str) else getattr(cfg.qtype, "name", str(cfg.qtype))
    qtype = _cache_qtype(qtype)
    backend = _cached_backend(qtype)
    if backend is None:
        _say(
            f"qtype {qtype!r} is quantized by optimum-quanto, whose packed layout depends on the "
            f"device; no cache for it (uint4 and the other torchao, int4_fused and OstrisLinear qtypes are cached)"
        )
        return None
    if getattr(cfg, "accuracy_recovery_adapter", None):
        _say("accuracy_recovery_adapter is set: quantization attaches a LoRA; no cache")
        return None
    source_path = Path(source_path)
    if not source_path.is_file():
        _say(f"source {source_path} is not a single file; no cache")
        return None
    cache_dir = cache_dir_for(kwargs, getattr(base_model, "training_folder", None))
    if cache_dir is None:
        _say(f"no training folder known; set model_kwargs quantized_cache_dir or ${ENV_CACHE_DIR}; no cache")
        return None
    extra = {"dtype": str(base_model.torch_dtype).replace("torch.", "")}
    if backend == "int4_fused":
        from toolkit import int4_linear

        extra["int4_linear"] = int4_linear.FORMAT_VERSION
    try:
        cache = QuantizedCache(cache_dir, source_path, qtype, model_signature(model), extra)
    except OSError as e:
        _say(f"cannot fingerprint {source_path} ({e}); no cache")
        return None
    cache.expected_names = {n for n, _, _, _ in _named_state(model)}
    cache.staging = staging_options(kwargs)
    return cache


def staging_options(model_kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """read_spans options from model_kwargs: cache_staging_mib (host RAM for the staging
    buffers of a GPU load, default 256, split in four) and pinned_staging (default true)."""
    total = model_kwargs.get("cache_staging_mib", STAGING_BUFFERS * STAGING_BUFFER_BYTES >> 20)
    if isinstance(total, bool) or not isinstance(total, int) or total < STAGING_BUFFERS:
        raise ValueError(
            f"model_kwargs cache_staging_mib must be a whole number of MiB, at least {STAGING_BUFFERS}; got {total!r}"
        )
    return {
        "buffers": STAGING_BUFFERS,
        "buffer_bytes": (total << 20) // STAGING_BUFFERS,
        "pin": _bool(model_kwargs.get("pinned_staging", True)),
    }
