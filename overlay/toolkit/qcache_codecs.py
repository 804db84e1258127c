"""The quantized model's state as cache entries: the allow-listed classes a cache file may name,
how each quantized tensor or module is encoded, and writing a model into a cache file.

Only classes from fixed allow-lists can be named by a file: torchao's tensor subclasses, the
Int4Linear module kind, and the upstream trainer's OstrisLinear (imported only when a model or a
cache has such modules, so the fork, which has none, never needs it). optimum-quanto qtypes are
not cached: their packed layout depends on the device they were quantized on. The way back
(entries -> model) is toolkit/qcache_rebuild.py.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import os
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from toolkit.qcache_format import (
    _CHUNK,
    CacheError,
    _fsync_dir,
    _header,
    _tensor_bytes,
    _int_list,
    _tensor_index,
)

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


