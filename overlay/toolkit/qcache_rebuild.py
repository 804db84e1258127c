"""From a read cache back into the model: rebuild each entry (plain tensor, torchao subclass,
Int4Linear, OstrisLinear) against what the meta model expects, then assign it. Nothing is
assigned until every entry has been checked (toolkit/qcache_format.py reads and verifies the file).
"""

from __future__ import annotations

import re
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch

from toolkit.qcache_codecs import (
    _OSTRIS_MODULE,
    _OSTRIS_DTYPES,
    _OSTRIS_FIXED,
    _module_kinds,
    _named_state,
    _ostris_api,
    _torchao_classes,
    _unflatten,
)
from toolkit.qcache_format import CacheError, _corrupt_on_error


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


