"""The launcher's check of flux2-dev.safetensors / ae.safetensors headers, through the trainer's
own reader (the overlay's toolkit/safetensors_header.py): the same rules as the streamed loader,
and whatever the bytes, nothing but the launcher's LauncherError, naming the file."""

import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


def test_deeply_nested_header(tmp_path):
    raw = b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(LauncherError, match="not valid UTF-8 JSON"):
        safetensors_header(path)


def test_a_folder_in_place_of_the_file(tmp_path):
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises(LauncherError, match="cannot be read"):
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
