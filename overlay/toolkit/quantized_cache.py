"""On-disk cache of a quantized transformer that can never execute code when loaded: when a
cache is used, what keys it, and the object the model loader calls.

Quantizing the FLUX.2 transformer to 4 bit takes minutes at every launch. After the first
quantization the result is written once and later launches load it in seconds. A cache is
keyed by its source checkpoint (flux2_contract/safetensors_header.py `source_fingerprint`), the
cache qtype (flux2_contract/qtypes.py: int4_w4a8 shares int4_fused's file), the trainer commit, the
torchao version and the model's signature; a stale one is rebuilt, a corrupt one set aside.

One file serves both trainers: the AMD fork (torchao uint2..uint8 and float8, and int4_fused:
Int4Linear block Linears) and upstream ai-toolkit (torchao int8/float8, and uint2..uint8,
orbit, ... as OstrisLinear). The file itself: toolkit/qcache_format.py; the entries:
toolkit/qcache_codecs.py and toolkit/qcache_rebuild.py; its name and a torch-free validity
check for the launcher: flux2_contract/qcache_index.py.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from toolkit.qcache_codecs import _named_state, _names_as_built, _ostris_api, model_signature, write_cache  # noqa: F401
from toolkit.qcache_format import (  # noqa: F401  (names the tests and the bench read here)
    FORMAT_VERSION,
    META_KEY,
    META_SHA_KEY,
    CacheError,
    _corrupt_on_error,
    _say,
    _short,
    read_cache,
    read_meta,
)
from flux2_contract.qcache_index import cache_file_name
from toolkit.qcache_rebuild import assign_state, rebuild_state  # noqa: F401
from flux2_contract.qtypes import INT4_LINEAR, QTYPES, cache_qtype
from flux2_contract.settings import cache_folder, read
from flux2_contract.safetensors_header import source_fingerprint
from toolkit.staged_load import STAGING_BUFFERS

# ---------------------------------------------------------------------------
# cache key


def fork_commit(checkout: Optional[Path] = None) -> str:
    """The trainer checkout's git HEAD without running git, else 'unknown'."""
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
    return "unknown"


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
        self.path = Path(cache_dir).expanduser().resolve() / cache_file_name(self.source_path, self.qtype)
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

    def load_into(self, model: torch.nn.Module, device=torch.device("cpu")) -> bool:
        """Fill `model` (built on meta) from the cache, every tensor on `device`, or where a
        placement puts it by its name (toolkit/memory_budget.py LoadPlacement: a memory plan's
        streamed blocks on the host). False if there is no usable cache; the model is untouched
        then, and a corrupt file has been set aside."""
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


def cache_dir_for(model_kwargs: Dict[str, Any], training_folder: Optional[str]) -> Optional[Path]:
    """model_kwargs.quantized_cache_dir, else <training_folder>/../quant_cache; None when neither is
    known (the model was not built by a training process)."""
    return cache_folder(model_kwargs, "quantized_cache_dir", training_folder, "quant_cache")


def _cached_backend(qtype: str) -> Optional[str]:
    """Which cacheable backend quantizes `qtype` in this trainer: "torchao", INT4_LINEAR (the
    project's Int4Linear: every qtype of flux2_contract/qtypes.py), "ostris" (upstream's OstrisLinear), or None (optimum-quanto)."""
    from toolkit.util import quantize

    if qtype in quantize.torchao_qtypes:
        return "torchao"
    if qtype in QTYPES:
        return INT4_LINEAR
    api = _ostris_api()
    if api is not None and api.get_ostris_quantizer(qtype) is not None:
        return "ostris"
    return None


def cache_for_model(base_model, source_path, model: torch.nn.Module) -> Optional[QuantizedCache]:
    """The cache for a BaseModel's transformer, or None when it is off or not possible."""
    cfg = base_model.model_config
    kwargs = getattr(cfg, "model_kwargs", None) or {}
    if not cfg.quantize or not read(kwargs, "quantized_cache"):
        return None
    qtype = cfg.qtype if isinstance(cfg.qtype, str) else getattr(cfg.qtype, "name", str(cfg.qtype))
    qtype = cache_qtype(qtype)  # int4_w4a8 loads int4_fused's file: the same model, other matmuls
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
        _say("no training folder known; set model_kwargs quantized_cache_dir; no cache")
        return None
    extra = {"dtype": str(base_model.torch_dtype).replace("torch.", "")}
    if backend == INT4_LINEAR:
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
    total = read(model_kwargs, "cache_staging_mib")
    return {
        "buffers": STAGING_BUFFERS,
        "buffer_bytes": (total << 20) // STAGING_BUFFERS,
        "pin": read(model_kwargs, "pinned_staging"),
    }
