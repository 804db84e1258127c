"""The launcher's check of flux2-dev.safetensors / ae.safetensors headers, through the trainer's
own reader (flux2_contract/safetensors_header.py): the same rules as the streamed loader,
and whatever the bytes, nothing but the launcher's LauncherError, naming the file."""

import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flux2_contract import qcache_index
from flux2_contract import safetensors_header as header_reader
from launcher.errors import LauncherError
from launcher.runs.validate import safetensors_header


def pack(header, data_size: int, length=None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + bytes(data_size)


def good_header(sizes: list[int]) -> tuple[dict, int]:
    header, offset = {}, 0
    for index, size in enumerate(sizes):
        header[f"t{index}"] = {"dtype": "U8", "shape": [size], "data_offsets": [offset, offset + size]}
        offset += size
    return header, offset


def test_a_good_header_is_returned(tmp_path):
    header, size = good_header([4, 0, 8])
    path = tmp_path / "good.safetensors"
    path.write_bytes(pack({**header, "__metadata__": {"format": "pt"}}, size))
    assert set(safetensors_header(path)) == {"t0", "t1", "t2", "__metadata__"}


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


@pytest.mark.parametrize("header, size, fragment", [
    ([1, 2], 0, "top level is a JSON list, expected an object"),
    ({"w": 5}, 0, "entry is not an object"),
    ({"w": {"shape": [8], "data_offsets": [0, 8]}}, 8, "unknown dtype None"),
    ({"w": entry("U8", [8], 0, "8")}, 8, "not a pair of integers"),
    ({"w": entry("U8", [8], True, 1)}, 1, "not a pair of integers"),
    ({"w": entry("U8", [4], 8, 4)}, 8, r"data_offsets \[8, 4\] outside the data section"),
    ({"w": entry("F32", [2], 0, 4)}, 4, "needs 8 bytes but data_offsets cover 4"),
    ({"a": entry("U8", [4], 0, 4), "b": entry("U8", [2], 6, 8)}, 8, "a gap of 2 bytes"),
    ({"__metadata__": {}}, 0, "holds no tensors"),
    ({"w": entry("U8", [10], 0, 10)}, 4, r"file truncated\?\); the file is damaged, truncated or still downloading"),
    ({"w": entry("U8", [4], 0, 4)}, 10, "the last 6 bytes belong to no tensor"),
])
def test_malformed_headers_are_named(tmp_path, header, size, fragment):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(pack(header, size))
    with pytest.raises(LauncherError, match=fragment) as info:
        safetensors_header(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("escaped", [r"\ud800", r"\udc00", r"\ud83d\ud83d", r"\ud800A"])
def test_a_lone_surrogate_escape_is_refused_as_safe_open_refuses_it(tmp_path, escaped):
    """json.loads keeps it as a lone surrogate; safetensors' own parser refuses the header."""
    raw = ('{"__metadata__": {"note": "%s"}, "w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}'
           % escaped).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0")
    with pytest.raises(LauncherError, match="lone UTF-16 surrogate") as info:
        safetensors_header(path)
    assert str(path) in str(info.value)


def test_a_surrogate_pair_escape_is_one_character(tmp_path):
    raw = '{"__metadata__": {"note": "\\ud83d\\ude00"}, "w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}'
    path = tmp_path / "good.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw.encode() + b"\0")
    assert safetensors_header(path)["__metadata__"] == {"note": "\U0001F600"}


def test_deeply_nested_header(tmp_path):
    raw = b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(LauncherError, match="not valid UTF-8 JSON"):
        safetensors_header(path)


def test_a_folder_in_place_of_the_file(tmp_path):
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises(LauncherError, match="dir.safetensors is a folder, not a regular file"):
        safetensors_header(tmp_path / "dir.safetensors")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def mutants(draw):
    header, size = good_header(draw(st.lists(st.integers(0, 16), min_size=1, max_size=4)))
    name = draw(st.sampled_from(sorted(header)))
    what = draw(st.sampled_from(["entry", "offsets", "one offset", "top", "bytes"]))
    if what == "entry":
        header[name] = draw(json_values)
    elif what == "offsets":
        header[name]["data_offsets"] = draw(json_values)
    elif what == "one offset":
        header[name]["data_offsets"][draw(st.integers(0, 1))] = draw(json_values)
    elif what == "top":
        header = draw(json_values)
    blob = bytearray(pack(header, max(0, size + draw(st.integers(-3, 3)))))
    if what == "bytes":
        for _ in range(draw(st.integers(1, 4))):
            position = draw(st.integers(0, len(blob) - 1))
            blob[position] = draw(st.integers(0, 255))
    return bytes(blob)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutants())
def test_any_bytes_give_a_header_or_a_launcher_error(tmp_path, blob):
    path = tmp_path / "mutant.safetensors"
    path.write_bytes(blob)
    try:
        header = safetensors_header(path)
    except LauncherError as error:
        assert str(path) in str(error)
        return
    assert isinstance(header, dict)


# -- one parser for every header: a duplicate key is refused wherever a header is read ---------------



def with_a_bogus_first_copy(header: dict, name: str, bogus) -> bytes:
    """The header's JSON with `name` written twice, the bogus copy first: Python's json keeps the
    last copy, so a reader that does not refuse duplicates sees a perfectly good header."""
    raw = json.dumps(header).encode()
    assert raw.startswith(b"{")
    return b"{" + json.dumps(name).encode() + b": " + json.dumps(bogus).encode() + b", " + raw[1:]


def quantized_cache(tmp_path, duplicate: str | None = None):
    """(cache folder, checkpoint, cache file) keyed by the trainer's own cache code, with `duplicate`
    ("tensor" or "__metadata__") written twice in its header."""
    index = qcache_index
    checkpoint = tmp_path / "flux2-dev.safetensors"
    header, size = good_header([4])
    checkpoint.write_bytes(pack(header, size))
    key = {"qtype": "uint4", "source": header_reader.source_fingerprint(checkpoint)}
    header = {"__metadata__": {"format": index.FORMAT_NAME, index.META_KEY: json.dumps({"key": key})},
              "w": entry("U8", [4096], 0, 4096)}
    raw = json.dumps(header).encode()
    if duplicate == "tensor":
        raw = with_a_bogus_first_copy(header, "w", entry("U8", [1], 0, 1))
    elif duplicate == "__metadata__":
        raw = with_a_bogus_first_copy(header, "__metadata__", {"format": "something else"})
    cache_dir = tmp_path / "quant_cache"
    cache_dir.mkdir()
    path = cache_dir / index.cache_file_name(checkpoint, "uint4")
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4096))
    return cache_dir, checkpoint, path


def test_the_fixture_cache_is_valid(tmp_path):
    cache_dir, checkpoint, path = quantized_cache(tmp_path)
    assert qcache_index.find_valid_cache(cache_dir, checkpoint, "uint4") == path


@pytest.mark.parametrize("duplicate", ["tensor", "__metadata__"])
def test_a_quantized_cache_with_a_duplicate_key_is_not_valid(tmp_path, duplicate):
    cache_dir, checkpoint, path = quantized_cache(tmp_path, duplicate)
    assert qcache_index.read_key(path) is None
    assert qcache_index.find_valid_cache(cache_dir, checkpoint, "uint4") is None


@pytest.mark.parametrize("reader", ["read_json_header", "read_header"])
def test_every_header_reader_refuses_a_duplicate_key(tmp_path, reader):
    module = header_reader
    header, size = good_header([4, 8])
    raw = with_a_bogus_first_copy(header, "t1", entry("U8", [8], 4, 12))
    path = tmp_path / "dup.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(size))
    with open(path, "rb") as handle, pytest.raises(module.SafetensorsHeaderError) as info:
        getattr(module, reader)(handle, path.stat().st_size, str(path))
    assert str(info.value) == f"{path}: malformed safetensors header: duplicate key 't1'"


def test_the_launchers_check_names_a_duplicate_key(tmp_path):
    header, size = good_header([4, 8])
    path = tmp_path / "dup.safetensors"
    raw = with_a_bogus_first_copy(header, "t0", entry("U8", [4], 0, 4))
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(size))
    with pytest.raises(LauncherError, match="duplicate key 't0'") as info:
        safetensors_header(path)
    assert str(path) in str(info.value)
