"""The quantized-transformer cache (toolkit/quantized_cache.py, wall 8), on either target.

A tiny FLUX.2 is quantized by the trainer's own quantize() with each backend the trainer
has, cached, and loaded back into a model built on the meta device:
  torchao  tensor subclasses: the fork's uint4 (UIntXWeightOnlyConfig), upstream's int8;
  ostris   upstream's OstrisLinear (its uint4); the fork has no toolkit/util/ostris_quant.py,
           there these cases are deselected and a cache with OstrisLinear records is refused.
"""

import hashlib
import importlib
import io
import json
import math
import os
import pickle
import struct
import subprocess
import time
import types
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

TINY = dict(
    in_channels=128,
    context_in_dim=3 * 64,
    hidden_size=128,
    num_heads=2,
    depth=1,
    depth_single_blocks=1,
    axes_dim=[16, 16, 16, 16],
)
LOADED = "Loaded quantized transformer from cache"
OSTRIS_QUANT = "toolkit/util/ostris_quant.py"
ON_OSTRIS = pytest.mark.trainer_has(OSTRIS_QUANT)
BACKENDS = ["torchao", pytest.param("ostris", marks=ON_OSTRIS)]


@pytest.fixture(scope="module")
def qc(trainer_on_path):
    return importlib.import_module("toolkit.quantized_cache")


@pytest.fixture(scope="module")
def qfile(trainer_on_path):
    """The file format (header bytes, checksums)."""
    return importlib.import_module("toolkit.qcache_format")


@pytest.fixture(scope="module")
def qcodecs(trainer_on_path):
    """Model state <-> entries, and the writer."""
    return importlib.import_module("toolkit.qcache_codecs")


@pytest.fixture(scope="module")
def quantize_mod(trainer_on_path):
    return importlib.import_module("toolkit.util.quantize")


def qtype_of(quantize_mod, backend):
    """The qtype this trainer quantizes with `backend`: 4 bit where it can."""
    if backend == "ostris":
        return "uint4"
    return next(q for q in ("uint4", "int8") if q in quantize_mod.torchao_qtypes)


@pytest.fixture(scope="module", params=BACKENDS)
def tiny(request, flux2_src, quantize_mod, tmp_path_factory):
    """(backend, qtype, source checkpoint path, freshly quantized model, builder of empty meta models)."""
    from optimum.quanto import freeze

    backend = request.param
    qtype = qtype_of(quantize_mod, backend)
    torch.manual_seed(0)
    params = flux2_src.Flux2Params(**TINY)
    model = flux2_src.Flux2(params).to(torch.bfloat16)
    src = tmp_path_factory.mktemp("src") / "flux2-tiny.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(src))
    quantize_mod.quantize(model, weights=quantize_mod.get_qtype(qtype))
    freeze(model)

    def meta_model():
        with torch.device("meta"):
            return flux2_src.Flux2(params)

    return types.SimpleNamespace(backend=backend, qtype=qtype, src=src, model=model, meta_model=meta_model)


def test_backends_match_this_trainer(qc, tiny, qcodecs):
    """The ostris cases run exactly where the cache finds OstrisLinear: a moved module
    would otherwise silently drop them."""
    has_ostris = qc._ostris_api() is not None
    assert has_ostris == (Path(qc.__file__).parents[1] / OSTRIS_QUANT).is_file()
    if tiny.backend == "ostris":
        assert has_ostris and len(qcodecs._ostris_modules(tiny.model)) >= 10
    else:
        assert not qcodecs._ostris_modules(tiny.model)


def inputs():
    g = torch.Generator().manual_seed(1)
    img_len, txt_len = 16, 8
    x_ids = torch.stack(
        torch.meshgrid(torch.arange(1), torch.arange(4), torch.arange(4), torch.arange(1), indexing="ij"),
        dim=-1,
    ).reshape(1, img_len, 4)
    ctx_ids = torch.zeros(1, txt_len, 4, dtype=torch.long)
    ctx_ids[..., 3] = torch.arange(txt_len)
    return dict(
        x=torch.randn(1, img_len, 128, generator=g, dtype=torch.bfloat16),
        x_ids=x_ids,
        timesteps=torch.tensor([0.5], dtype=torch.bfloat16),
        ctx=torch.randn(1, txt_len, 3 * 64, generator=g, dtype=torch.bfloat16),
        ctx_ids=ctx_ids,
        guidance=torch.tensor([4.0], dtype=torch.bfloat16),
    )


def make_cache(qc, tiny, cache_dir):
    return qc.QuantizedCache(cache_dir, tiny.src, tiny.qtype, qc.model_signature(tiny.meta_model()))


def assert_untouched(model):
    assert all(p.device.type == "meta" for p in model.parameters())
    assert not any(getattr(m, "is_ostris_quantized", False) for m in model.modules())


def rewrite_meta(qc, path, change):
    """Apply `change` to the cache's aitk_qcache and sign the header again, as a
    deliberate forgery would: only the content checks can refuse it then. `change`
    edits the metadata in place, or returns the new metadata text verbatim."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    meta = json.loads(header["__metadata__"][qc.META_KEY])
    text = change(meta)
    meta_json = text if isinstance(text, str) else json.dumps(meta, separators=(",", ":"), sort_keys=True)
    index = {k: v for k, v in header.items() if k != "__metadata__"}
    header["__metadata__"][qc.META_KEY] = meta_json
    qfile = importlib.import_module("toolkit.qcache_format")
    header["__metadata__"][qc.META_SHA_KEY] = qfile._meta_digest(meta_json, index)
    path.write_bytes(qfile._header_bytes(header) + blob[8 + n :])


@pytest.fixture
def saved(qc, tiny, tmp_path, capsys):
    cache = make_cache(qc, tiny, tmp_path / "qcache")
    assert cache.save(tiny.model)
    assert cache.path.is_file()
    capsys.readouterr()
    return cache


# -- round trip ----------------------------------------------------------------


def test_round_trip_gives_the_same_outputs(qc, tiny, saved, capsys, qcodecs):
    meta = tiny.meta_model()
    t0 = time.perf_counter()
    assert make_cache(qc, tiny, saved.path.parent).load_into(meta)
    elapsed = time.perf_counter() - t0
    out = capsys.readouterr().out
    assert f"{LOADED} {saved.path}" in out
    print(f"tiny model: cache {saved.path.stat().st_size} bytes, loaded in {elapsed * 1000:.1f} ms")

    assert {n: type(m) for n, m in meta.named_modules()} == {n: type(m) for n, m in tiny.model.named_modules()}
    fresh = {**dict(tiny.model.named_parameters()), **dict(tiny.model.named_buffers())}
    cached = {**dict(meta.named_parameters()), **dict(meta.named_buffers())}
    assert fresh.keys() == cached.keys()
    n_quantized = 0
    for name, p in fresh.items():
        q = cached[name]
        assert type(q) is type(p), name
        assert q.shape == p.shape and q.dtype == p.dtype and q.device.type == "cpu", name
        if hasattr(p, "tensor_impl"):
            n_quantized += 1
            assert type(q.tensor_impl) is type(p.tensor_impl)
            assert q.block_size == p.block_size
            assert torch.equal(q.dequantize(), p.dequantize()), name
        else:
            assert torch.equal(q, p), name
    for name, module in qcodecs._ostris_modules(tiny.model).items():
        n_quantized += 1
        rebuilt = meta.get_submodule(name)
        assert rebuilt.ostris_quantizer.qtype == module.ostris_quantizer.qtype == tiny.qtype
        assert rebuilt.ostris_orig_dtype == module.ostris_orig_dtype
        assert "weight" not in rebuilt._parameters
        # backend buffers stay out of state_dict(), as after quantizing in place
        assert rebuilt._non_persistent_buffers_set == module._non_persistent_buffers_set != set()
        assert torch.equal(rebuilt.dequantize_weight(), module.dequantize_weight()), name
    assert n_quantized >= 10
    assert meta.state_dict().keys() == tiny.model.state_dict().keys()

    with torch.no_grad():
        expected = tiny.model(**inputs())
        got = meta(**inputs())
    assert torch.equal(got, expected)


def test_cache_is_plain_safetensors_with_json_metadata(qc, tiny, saved):
    blob = saved.path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    meta = json.loads(header["__metadata__"]["aitk_qcache"])
    assert meta["format_version"] == qc.FORMAT_VERSION == 3
    assert meta["key"]["qtype"] == tiny.qtype
    assert meta["modules"] == {}  # Int4Linear entries: test_int4_trainer.py
    if tiny.backend == "torchao":
        assert meta["ostris"] == {}
        entry = meta["entries"]["img_in.weight"]["tree"]
        assert entry["subclass"] == "AffineQuantizedTensor"
        assert {"tensor_impl"} == {name for name, _ in entry["inner"]}
    else:
        record = meta["ostris"]["img_in"]
        assert record["qtype"] == "uint4" and record["dtype"] == "bfloat16"
        assert "img_in.weight" not in meta["entries"]
        assert {f"img_in.{b}" for b in record["buffers"]} <= set(header)
    if tiny.qtype == "uint4":
        # the packed 4-bit data is half a byte per weight (128 x 128 weights)
        packed = {"torchao": "img_in.weight.tensor_impl.int_data.int4_shard", "ostris": "img_in.uintx_packed"}
        assert header[packed[tiny.backend]]["dtype"] == "U8"
        assert math.prod(header[packed[tiny.backend]]["shape"]) == 128 * 64
    assert b"\x80\x02" not in blob[: 8 + n] and b"PK\x03\x04" not in blob[:4]


def test_key_has_source_fingerprint_and_fork_commit(qc, tiny, saved, trainer_checkout):
    key = qc.read_meta(saved.path)["key"]
    st = tiny.src.stat()
    assert key["source"]["size"] == st.st_size
    assert key["source"]["mtime_ns"] == st.st_mtime_ns
    (n,) = struct.unpack("<Q", tiny.src.read_bytes()[:8])
    assert key["source"]["header_sha256"] == hashlib.sha256(tiny.src.read_bytes()[: 8 + n]).hexdigest()
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=trainer_checkout, capture_output=True, text=True
    ).stdout.strip()
    assert key["fork_commit"] == (head or "unknown")


# -- stale keys ------------------------------------------------------------------


def test_other_qtype_is_stale_and_rebuilt(qc, tiny, saved, capsys):
    other = qc.QuantizedCache(saved.path.parent, tiny.src, tiny.qtype, "x" * 64)
    other.path = saved.path  # same file, different key
    model = tiny.meta_model()
    assert not other.load_into(model)
    out = capsys.readouterr().out
    assert "stale" in out and "model_signature" in out
    assert_untouched(model)
    assert saved.path.is_file()  # kept until the rebuild replaces it


def test_touched_source_is_stale_then_rebuilt(qc, tiny, saved, capsys, tmp_path):
    st = tiny.src.stat()
    os.utime(tiny.src, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    try:
        cache = make_cache(qc, tiny, saved.path.parent)
        model = tiny.meta_model()
        assert not cache.load_into(model)
        assert "stale" in capsys.readouterr().out
        assert_untouched(model)
        assert cache.save(tiny.model)  # the rebuild writes a fresh one
        assert cache.load_into(tiny.meta_model())
        assert LOADED in capsys.readouterr().out
    finally:
        os.utime(tiny.src, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_cache_of_an_older_format_is_stale_not_corrupt(qc, tiny, saved, capsys):
    """A version-2 cache (no "ostris" section) is rebuilt in place, not set aside as damaged."""

    def as_version_2(meta):
        meta["format_version"] = meta["key"]["format_version"] = 2
        del meta["ostris"]

    rewrite_meta(qc, saved.path, as_version_2)
    model = tiny.meta_model()
    assert not make_cache(qc, tiny, saved.path.parent).load_into(model)
    out = capsys.readouterr().out
    assert "stale" in out and "format_version: cached 2, now 3" in out and "corrupt" not in out, out
    assert_untouched(model)
    assert saved.path.is_file()
    with pytest.raises(qc.CacheError, match="format version 2"):
        qc.read_cache(saved.path)


def test_missing_cache_says_it_will_be_written(qc, tiny, tmp_path, capsys):
    model = tiny.meta_model()
    assert not make_cache(qc, tiny, tmp_path / "none").load_into(model)
    assert "no cache" in capsys.readouterr().out
    assert_untouched(model)


# -- corrupt files -----------------------------------------------------------------


def _expect_corrupt(qc, tiny, cache, capsys, *fragments):
    model = tiny.meta_model()
    assert not make_cache(qc, tiny, cache.path.parent).load_into(model)
    out = capsys.readouterr().out
    assert "corrupt" in out, out
    for fragment in fragments:
        assert fragment in out, out
    assert LOADED not in out
    assert_untouched(model)  # never half-loaded
    assert not cache.path.exists()
    assert cache.path.with_name(cache.path.name + ".corrupt-1").is_file()
    # the caller quantizes again and rewrites; that one loads
    assert cache.save(tiny.model)
    assert make_cache(qc, tiny, cache.path.parent).load_into(tiny.meta_model())
    assert LOADED in capsys.readouterr().out


@pytest.mark.parametrize("cut", [1, 1000, "half", "header"])
def test_truncated_file_is_detected_and_rebuilt(qc, tiny, saved, capsys, cut):
    blob = saved.path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    keep = {"half": len(blob) // 2, "header": 8 + n // 2}.get(cut, len(blob) - cut if isinstance(cut, int) else 0)
    saved.path.write_bytes(blob[:keep])
    _expect_corrupt(qc, tiny, saved, capsys)


@pytest.mark.parametrize("where", ["last", "data_middle", "first_data"])
def test_flipped_data_byte_is_detected(qc, tiny, saved, capsys, where):
    blob = bytearray(saved.path.read_bytes())
    (n,) = struct.unpack("<Q", blob[:8])
    pos = {"last": len(blob) - 1, "data_middle": (8 + n + len(blob)) // 2, "first_data": 8 + n}[where]
    blob[pos] ^= 0x10
    saved.path.write_bytes(bytes(blob))
    _expect_corrupt(qc, tiny, saved, capsys, "checksum mismatch")


def test_flipped_header_byte_is_detected(qc, tiny, saved, capsys):
    blob = bytearray(saved.path.read_bytes())
    (n,) = struct.unpack("<Q", blob[:8])
    text = bytes(blob[: 8 + n])
    pos = text.index(b'"shape":[') + len(b'"shape":[')  # a digit of a tensor shape
    blob[pos] = ord("9") if blob[pos] != ord("9") else ord("8")
    saved.path.write_bytes(bytes(blob))
    _expect_corrupt(qc, tiny, saved, capsys)


def test_appended_bytes_are_detected(qc, tiny, saved, capsys):
    with open(saved.path, "ab") as f:
        f.write(b"\0" * 16)
    _expect_corrupt(qc, tiny, saved, capsys, "truncated or padded")


def unquantized_param(model):
    """(module, parameter name) of a parameter no quantizer touches (a norm's scale)."""
    return next(
        (m, n) for m in model.modules() if not isinstance(m, torch.nn.Linear)
        for n, p in m._parameters.items() if p is not None
    )


def test_cache_for_a_different_model_is_rejected(qc, tiny, tmp_path, capsys):
    # same key, but the file is missing a parameter of the model
    cache = make_cache(qc, tiny, tmp_path / "qcache")
    smaller = tiny.model
    module, leaf = unquantized_param(smaller)
    name = next(n for n, m in smaller.named_modules() if m is module) + "." + leaf
    saved_p = module._parameters.pop(leaf)
    try:
        qc.write_cache(cache.path, smaller, cache.key)
    finally:
        module._parameters[leaf] = saved_p
    _expect_corrupt(qc, tiny, cache, capsys, name)


@pytest.mark.parametrize("tiny", ["torchao"], indirect=True)
def test_unknown_tensor_class_in_metadata_is_rejected(qc, tiny, saved, capsys):
    meta, tensors = qc.read_cache(saved.path)
    meta["entries"]["img_in.weight"]["tree"]["subclass"] = "os.system"
    with pytest.raises(qc.CacheError, match="allow-list"):
        qc.rebuild_state(meta, tensors, tiny.meta_model())


# -- malformed metadata: any of it is a corrupt cache, never an exception ---------------------------


def deep_json(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("where", ["header", "metadata"])
def test_deeply_nested_json_is_a_corrupt_cache(qc, tiny, saved, capsys, where):
    if where == "header":
        raw = b'{"__metadata__": ' + deep_json(100_000).encode() + b"}"
        saved.path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    else:
        rewrite_meta(qc, saved.path, lambda meta: deep_json(100_000))
    _expect_corrupt(qc, tiny, saved, capsys, "RecursionError")


@pytest.mark.parametrize("tiny", ["torchao"], indirect=True)  # edits a torchao entry
@pytest.mark.parametrize("change", [
    lambda meta: meta["entries"]["img_in.weight"]["tree"].update(subclass=["AffineQuantizedTensor"]),
    lambda meta: meta["entries"]["img_in.weight"]["tree"].update(inner=[[["tensor_impl"], {}]]),
    lambda meta: meta["entries"]["img_in.weight"].update(tree={"tensor": {"name": 1}}),
    lambda meta: meta["entries"]["img_in.weight"]["tree"]["attrs"].append({"t": "enum", "cls": "ZeroPointDomain", "v": [1]}),
    lambda meta: meta["entries"]["img_in.weight"]["tree"]["attrs"].append({"t": "float", "v": None}),
    lambda meta: meta["entries"]["img_in.weight"]["tree"].update(size="128"),
    lambda meta: meta.update(entries={"img_in.weight": []}),
    lambda meta: meta["checksums"].update({next(iter(meta["checksums"])): 7}),
    lambda meta: meta.update(key=["not", "a", "dict"]),
], ids=["unhashable class name", "unhashable inner name", "tensor name not a string", "enum member a list",
        "float from null", "size a string", "entry a list", "checksum a number", "key a list"])
def test_ill_typed_metadata_is_a_corrupt_cache(qc, tiny, saved, capsys, change):
    rewrite_meta(qc, saved.path, change)
    _expect_corrupt(qc, tiny, saved, capsys)


@pytest.mark.parametrize("name", ["tensor", "__metadata__"])
def test_a_duplicate_header_key_is_a_corrupt_cache(qc, tiny, saved, capsys, name):
    """JSON allows a key twice and Python's json keeps the last: a bogus copy written first would
    otherwise hide behind the good one and pass every check."""
    blob = saved.path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    key = next(k for k in header if k != "__metadata__") if name == "tensor" else "__metadata__"
    bogus = {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]} if name == "tensor" else {"format": "pt"}
    raw = b"{" + json.dumps(key).encode() + b":" + json.dumps(bogus).encode() + b"," + blob[9 : 8 + n]
    saved.path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + n :])
    _expect_corrupt(qc, tiny, saved, capsys, f"[quantized cache] corrupt cache {saved.path}: cache file: "
                    f"malformed safetensors header: duplicate key {key!r}. Moved it to ")


def test_a_duplicate_key_in_the_metadata_json_is_a_corrupt_cache(qc, tiny, saved, capsys):
    """The same parser reads the JSON kept in the header's metadata, even when the header is signed."""
    rewrite_meta(qc, saved.path, lambda meta: '{"key":{},' + json.dumps(meta, sort_keys=True)[1:])
    _expect_corrupt(qc, tiny, saved, capsys, "cache metadata: duplicate key 'key'")


def test_every_set_aside_file_is_kept_numbered(qc, tiny, saved, capsys):
    for number in (1, 2, 3):
        saved.path.write_bytes(b"garbage " * number)
        assert not make_cache(qc, tiny, saved.path.parent).load_into(tiny.meta_model())
        aside = saved.path.with_name(f"{saved.path.name}.corrupt-{number}")
        assert aside.read_bytes() == b"garbage " * number
        assert f"Moved it to {aside}" in capsys.readouterr().out


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _paths(value, prefix + (index,))


@st.composite
def metadata_changes(draw, meta):
    """A list of (path, action, value) edits to a valid cache's metadata."""
    paths = list(_paths(meta))
    edits = []
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths))
        edits.append((path, draw(st.sampled_from(["replace", "delete", "add"])), draw(json_values)))
    return edits


def apply_edits(meta, edits):
    for path, action, value in edits:
        if not path:
            return value
        parent = meta
        try:
            for step in path[:-1]:
                parent = parent[step]
            if action == "replace":
                parent[path[-1]] = value
            elif action == "delete":
                del parent[path[-1]]
            elif isinstance(parent, dict):
                parent[f"extra{len(parent)}"] = value
            else:
                parent.append(value)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit removed this path
    return meta


@pytest.fixture(scope="module")
def pristine(qc, tiny, tmp_path_factory):
    """The bytes and metadata of one good cache, for the property test to damage."""
    cache = make_cache(qc, tiny, tmp_path_factory.mktemp("pristine"))
    assert cache.save(tiny.model)
    return cache.path.read_bytes(), qc.read_meta(cache.path)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_metadata_parser_property(qc, tiny, pristine, tmp_path_factory, data):
    """Whatever the metadata says: the loader returns, the model is untouched unless it loaded,
    and a cache it refused is set aside (or, for a key that differs, kept as stale)."""
    blob, meta = pristine
    edits = data.draw(metadata_changes(meta))
    folder = tmp_path_factory.mktemp("mutant")
    cache = make_cache(qc, tiny, folder)
    cache.path.write_bytes(blob)
    rewrite_meta(qc, cache.path, lambda m: json.dumps(apply_edits(m, edits)))
    model = tiny.meta_model()
    try:
        loaded = cache.load_into(model)
    except Exception as error:  # the property: nothing escapes
        pytest.fail(f"load_into raised {type(error).__name__}: {error} for edits {edits}")
    if not loaded:
        assert_untouched(model)
        aside = cache.path.with_name(cache.path.name + ".corrupt-1")
        assert aside.is_file() or cache.path.is_file(), "a refused cache is set aside or kept as stale"
        assert not (aside.is_file() and cache.path.exists())


# -- OstrisLinear records ---------------------------------------------------------------


@pytest.mark.parametrize("tiny", ["torchao"], indirect=True)
def test_ostris_records_need_a_trainer_with_ostrislinear(qc, tiny, saved, monkeypatch, capsys, qcodecs):
    """A cache naming OstrisLinear modules, read by a trainer without them (the fork; on
    upstream its module is made unimportable), is refused as unusable, never half-loaded."""
    if qc._ostris_api() is not None:
        monkeypatch.setattr(qcodecs, "_OSTRIS_MODULE", "toolkit.util.ostris_quant_absent")
    assert qc._ostris_api() is None
    record = {"qtype": tiny.qtype, "dtype": "bfloat16", "buffers": ["packed"], "attrs": {}}
    rewrite_meta(qc, saved.path, lambda meta: meta["ostris"].update({"img_in": record}))
    _expect_corrupt(qc, tiny, saved, capsys, "OstrisLinear", "ostris_quant")


def _forge_ostris(change):
    """A tamper for rewrite_meta: `change(meta)` on a cache with OstrisLinear records."""
    return lambda meta: change(meta, meta["ostris"]["double_blocks.0.img_attn.qkv"])


@pytest.mark.parametrize("tiny", [pytest.param("ostris", marks=ON_OSTRIS)], indirect=True)
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda meta, rec: rec.update(qtype="os.system"), "is not this cache's"),
        (lambda meta, rec: rec.update(qtype="uint2"), "is not this cache's"),
        (lambda meta, rec: rec.update(dtype="int8"), "dtype 'int8' not allowed"),
        (lambda meta, rec: rec["attrs"].update(forward=1), "'forward' not allowed"),
        (lambda meta, rec: rec["attrs"].update(ostris_quantizer="x"), "'ostris_quantizer' not allowed"),
        (lambda meta, rec: rec["attrs"].update(__class__="x"), "'__class__' not allowed"),
        (lambda meta, rec: rec["buffers"].append("weight"), "'weight' not allowed"),
        (lambda meta, rec: rec["attrs"].update(group=[1, 2]), "must be scalars"),
        (lambda meta, rec: rec.update(buffers="packed"), "bad buffer"),
        (lambda meta, rec: meta["ostris"].update({"double_blocks.0.img_norm1": rec}), "not a plain Linear"),
        (lambda meta, rec: meta["ostris"].update({"no.such.module": rec}), "no such module"),
        (lambda meta, rec: meta["ostris"].pop("double_blocks.0.img_attn.qkv"), "does not match the model"),
        (lambda meta, rec: meta.update(ostris=[]), "lacks 'ostris'"),
    ],
    ids=["unknown-qtype", "other-qtype", "int-dtype", "method-name", "fixed-attr", "dunder", "weight-as-buffer",
         "list-value", "buffers-not-a-list", "not-a-linear", "no-module", "record-missing", "section-not-a-dict"],
)
def test_bad_ostris_record_is_set_aside_and_model_untouched(qc, tiny, saved, capsys, change, message):
    """Even with a valid header checksum, every record is checked before the model changes."""
    rewrite_meta(qc, saved.path, _forge_ostris(change))
    _expect_corrupt(qc, tiny, saved, capsys, message)


# -- no code execution ----------------------------------------------------------------


class _Boom:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "pwned"))


def _forbid_unpickling(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the cache loader must never unpickle")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch.serialization, "load", refuse)


def test_loader_never_unpickles_a_good_cache(qc, tiny, saved, monkeypatch, capsys):
    _forbid_unpickling(monkeypatch)
    assert make_cache(qc, tiny, saved.path.parent).load_into(tiny.meta_model())
    assert LOADED in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["raw_pickle", "torch_save", "pickle_in_tensor_data", "pickle_in_metadata"])
def test_pickle_payload_is_never_executed(qc, tiny, tmp_path, monkeypatch, capsys, kind):
    marker = tmp_path / "PWNED"
    payload = pickle.dumps(_Boom(marker))
    # sanity: the payload really would create the marker when unpickled
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_Boom(probe)))
    assert probe.exists()

    cache = make_cache(qc, tiny, tmp_path / "qcache")
    cache.path.parent.mkdir(parents=True)
    if kind == "raw_pickle":
        cache.path.write_bytes(payload)
    elif kind == "torch_save":
        buf = io.BytesIO()
        torch.save({"img_in.weight": _Boom(marker)}, buf)
        cache.path.write_bytes(buf.getvalue())
    else:
        # a well-formed cache whose bytes carry the payload
        assert cache.save(tiny.model)
        blob = bytearray(cache.path.read_bytes())
        (n,) = struct.unpack("<Q", blob[:8])
        if kind == "pickle_in_tensor_data":
            blob[8 + n : 8 + n + len(payload)] = payload
        else:
            header = json.loads(blob[8 : 8 + n])
            meta = json.loads(header["__metadata__"]["aitk_qcache"])
            victim = next(e for e in meta["entries"].values() if "tree" in e)
            victim["tree"] = {"pickle": payload.hex()}
            header["__metadata__"]["aitk_qcache"] = json.dumps(meta)
            raw = json.dumps(header).encode()
            blob = bytearray(struct.pack("<Q", len(raw)) + raw + blob[8 + n :])
        cache.path.write_bytes(bytes(blob))
    capsys.readouterr()

    _forbid_unpickling(monkeypatch)
    model = tiny.meta_model()
    assert not make_cache(qc, tiny, cache.path.parent).load_into(model)
    out = capsys.readouterr().out
    assert "corrupt" in out
    assert not marker.exists()
    assert_untouched(model)


# -- writes -----------------------------------------------------------------------------


def test_failed_write_leaves_old_cache_and_no_temp_files(qc, tiny, saved, monkeypatch, capsys, qcodecs):
    before = saved.path.read_bytes()
    calls = {"n": 0}
    real = qcodecs._tensor_bytes

    def flaky(t):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("disk full (simulated)")
        return real(t)

    monkeypatch.setattr(qcodecs, "_tensor_bytes", flaky)
    assert not make_cache(qc, tiny, saved.path.parent).save(tiny.model)
    assert "disk full" in capsys.readouterr().out
    assert saved.path.read_bytes() == before
    assert sorted(p.name for p in saved.path.parent.iterdir()) == [saved.path.name]


# -- wiring: model_kwargs ---------------------------------------------------------------


def fake_base_model(tmp_path, qtype, **config):
    cfg = dict(quantize=True, qtype=qtype, model_kwargs={}, accuracy_recovery_adapter=None)
    cfg.update(config)
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(**cfg),
        torch_dtype=torch.bfloat16,
        training_folder=str(tmp_path / "runs" / "output"),
    )


def test_cache_is_on_by_default_beside_the_training_folder(qc, tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("AITK_QUANT_CACHE_DIR", str(tmp_path / "env"))  # the trainer reads no variable
    cache = qc.cache_for_model(fake_base_model(tmp_path, tiny.qtype), tiny.src, tiny.meta_model())
    assert cache is not None
    assert cache.path.parent == (tmp_path / "runs" / "quant_cache").resolve()
    assert cache.key["dtype"] == "bfloat16"


def test_cache_dir_from_model_kwargs(qc, tiny, tmp_path):
    base = fake_base_model(tmp_path, tiny.qtype, model_kwargs={"quantized_cache_dir": str(tmp_path / "kw")})
    cache = qc.cache_for_model(base, tiny.src, tiny.meta_model())
    assert cache.path.parent == (tmp_path / "kw").resolve()


def test_model_with_replaced_modules_is_not_cached(qc, tiny, tmp_path, monkeypatch, capsys):
    """A quantizer that swaps modules (new parameter names) would make a cache the
    meta-built model can never load; it is not written."""
    cache = qc.cache_for_model(fake_base_model(tmp_path, tiny.qtype), tiny.src, tiny.meta_model())
    model = tiny.model
    module, _ = unquantized_param(model)
    module.register_buffer("qweight", torch.zeros(2, dtype=torch.uint8))
    try:
        assert not cache.save(model)
    finally:
        del module._buffers["qweight"]
    assert "not writing" in capsys.readouterr().out
    assert not cache.path.exists()
    assert cache.save(model)


def test_no_cache_without_a_known_folder(qc, tiny, tmp_path, monkeypatch, capsys):
    base = fake_base_model(tmp_path, tiny.qtype)
    base.training_folder = None  # a model built outside a training process
    assert qc.cache_for_model(base, tiny.src, tiny.meta_model()) is None
    assert "quantized_cache_dir" in capsys.readouterr().out


@pytest.mark.parametrize(
    "config, message",
    [
        ({"model_kwargs": {"quantized_cache": False}}, None),
        ({"quantize": False}, None),
        ({"qtype": "qfloat8"}, "optimum-quanto"),
        ({"accuracy_recovery_adapter": "some/ara.safetensors"}, "accuracy_recovery_adapter"),
    ],
)
def test_cache_off_or_unsupported(qc, tiny, tmp_path, capsys, config, message):
    config = {"qtype": tiny.qtype, **config}
    assert qc.cache_for_model(fake_base_model(tmp_path, **config), tiny.src, tiny.meta_model()) is None
    out = capsys.readouterr().out
    if message:
        assert message in out


# -- wiring: Flux2Model.load_model -------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("streamed", [True, False])
def test_flux2_load_model_writes_then_loads_the_cache(trainer_on_path, quantize_mod, tmp_path, monkeypatch, capsys, streamed, backend,
                                                     load_transformer):
    """First load quantizes and writes the cache; the second never reads the checkpoint."""
    fm = importlib.import_module("extensions_built_in.diffusion_models.flux2.flux2_model")
    from toolkit.config_modules import ModelConfig

    torch.manual_seed(0)
    ckpt = tmp_path / "model"
    ckpt.mkdir()
    model = fm.Flux2(fm.Flux2Params(**TINY))
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()},
        str(ckpt / fm.FLUX2_TRANSFORMER_FILENAME),
    )

    def load():
        cfg = ModelConfig(
            name_or_path=str(ckpt), arch="flux2", quantize=True, qtype=qtype_of(quantize_mod, backend),
            model_kwargs={"flux2_params": TINY, "streamed_loader": streamed},
        )
        return load_transformer(fm, cfg, tmp_path / "runs" / "output")

    fresh = load()
    out = capsys.readouterr().out
    assert "no cache at" in out and "wrote" in out
    cache_files = list((tmp_path / "runs" / "quant_cache").glob("*.qcache.safetensors"))
    assert len(cache_files) == 1

    def refuse(*args, **kwargs):
        raise AssertionError("the checkpoint must not be read on a cache hit")

    monkeypatch.setattr(fm, "load_file", refuse)
    monkeypatch.setattr(fm, "quantize_model", refuse)
    monkeypatch.setattr(fm.flux2_hooks, "load_transformer_streamed", refuse)  # the streamed loader
    cached = load()
    assert f"{LOADED} {cache_files[0]}" in capsys.readouterr().out
    with torch.no_grad():
        assert torch.equal(cached(**inputs()), fresh(**inputs()))
    assert hasattr(cached, "orig_state_dict")  # dequantize-on-save patch applied as before
