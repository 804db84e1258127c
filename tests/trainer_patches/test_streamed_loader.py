"""The streamed-loader patch: the plain-read safetensors reader (overlay/toolkit/streamed_safetensors.py)."""

import io
import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file as reference_load_file
from safetensors.torch import save_file

ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "F16": 2, "BF16": 2, "I32": 4, "F32": 4, "F64": 8, "I64": 8}


def pack(header: dict, data: bytes = b"", length=None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def write(tmp_path, name, blob):
    path = tmp_path / name
    path.write_bytes(blob)
    return path


def expect_header_error(sst, path, *fragments):
    with pytest.raises(sst.SafetensorsHeaderError) as info:
        sst.StreamedSafetensors(path)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message
    return message


# -- malformed files ---------------------------------------------------------


def test_truncated_data_is_rejected(streamed_safetensors, tmp_path):
    good = tmp_path / "good.safetensors"
    save_file({"a": torch.zeros(4, 4), "b": torch.ones(8)}, str(good))
    blob = good.read_bytes()
    path = write(tmp_path, "cut.safetensors", blob[:-5])
    expect_header_error(streamed_safetensors, path, "'b'", "truncated")


def test_truncated_inside_header_is_rejected(streamed_safetensors, tmp_path):
    good = tmp_path / "good.safetensors"
    save_file({"a": torch.zeros(4)}, str(good))
    path = write(tmp_path, "cut.safetensors", good.read_bytes()[:20])
    expect_header_error(streamed_safetensors, path, "header length")


def test_file_shorter_than_length_prefix(streamed_safetensors, tmp_path):
    path = write(tmp_path, "tiny.safetensors", b"\x01\x02")
    expect_header_error(streamed_safetensors, path, "too short")


def test_gap_between_tensors_is_rejected(streamed_safetensors, tmp_path):
    header = {
        "first": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "second": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]},
    }
    path = write(tmp_path, "gap.safetensors", pack(header, bytes(20)))
    expect_header_error(streamed_safetensors, path, "'second'", "gap of 4 bytes")
    assert_safe_open_refuses(path)


def test_uncovered_trailing_bytes_are_rejected(streamed_safetensors, tmp_path):
    header = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    path = write(tmp_path, "tail.safetensors", pack(header, bytes(8 + 5)))
    expect_header_error(streamed_safetensors, path, "5 bytes belong to no tensor")
    assert_safe_open_refuses(path)


def test_data_not_starting_at_zero_is_rejected(streamed_safetensors, tmp_path):
    header = {"w": {"dtype": "U8", "shape": [2], "data_offsets": [3, 5]}}
    path = write(tmp_path, "late.safetensors", pack(header, bytes(5)))
    expect_header_error(streamed_safetensors, path, "'w'", "gap of 3 bytes")
    assert_safe_open_refuses(path)


@pytest.mark.parametrize("shape", [[2**64, 0], [0, 2**70], [2**40, 2**40, 0]])
def test_absurd_shapes_are_rejected(streamed_safetensors, tmp_path, shape):
    header = {"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}
    path = write(tmp_path, "absurd.safetensors", pack(header))
    expect_header_error(streamed_safetensors, path, "'w'", "absurd")
    assert_safe_open_refuses(path)


def test_header_that_is_not_an_object_is_rejected(streamed_safetensors, tmp_path):
    raw = b'[{"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}]'
    path = write(tmp_path, "list.safetensors", struct.pack("<Q", len(raw)) + raw + b"\x00")
    expect_header_error(streamed_safetensors, path, "top level is a JSON list")
    assert_safe_open_refuses(path)


def test_whitespace_around_the_header_is_accepted(streamed_safetensors, tmp_path):
    raw = b'  {"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}    '
    path = write(tmp_path, "spaces.safetensors", struct.pack("<Q", len(raw)) + raw + b"\x07")
    assert streamed_safetensors.load_file(path)["w"].tolist() == [7]
    assert reference_accepts(path.read_bytes(), tmp_path)


def test_deeply_nested_header_is_rejected(streamed_safetensors, tmp_path):
    raw = b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    path = write(tmp_path, "deep.safetensors", struct.pack("<Q", len(raw)) + raw)
    expect_header_error(streamed_safetensors, path, "JSON")


def assert_safe_open_refuses(path):
    """The reference reader refuses the same file (the streamed reader is no more lenient)."""
    with pytest.raises(Exception):
        with safe_open(str(path), framework="pt") as reference:
            reference.keys()


def test_overlapping_offsets_are_rejected(streamed_safetensors, tmp_path):
    header = {
        "first": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "second": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    path = write(tmp_path, "overlap.safetensors", pack(header, bytes(12)))
    expect_header_error(streamed_safetensors, path, "overlap", "'second'", "'first'")


def test_huge_header_length_is_rejected(streamed_safetensors, tmp_path):
    path = write(tmp_path, "huge.safetensors", pack({}, b"", length=2**40))
    expect_header_error(streamed_safetensors, path, "header length")


def test_header_length_beyond_limit_is_rejected(streamed_safetensors, safetensors_header, tmp_path, monkeypatch):
    monkeypatch.setattr(safetensors_header, "MAX_HEADER_BYTES", 16)
    header = {"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}
    path = write(tmp_path, "long.safetensors", pack(header, b"\x00"))
    expect_header_error(streamed_safetensors, path, "header length")


def test_unknown_dtype_is_rejected(streamed_safetensors, tmp_path):
    header = {"w": {"dtype": "Q4_K", "shape": [4], "data_offsets": [0, 4]}}
    path = write(tmp_path, "dtype.safetensors", pack(header, bytes(4)))
    expect_header_error(streamed_safetensors, path, "'w'", "unknown dtype", "Q4_K")


def test_shape_size_mismatch_is_rejected(streamed_safetensors, tmp_path):
    header = {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}
    path = write(tmp_path, "shape.safetensors", pack(header, bytes(8)))
    expect_header_error(streamed_safetensors, path, "'w'", "12 bytes", "cover 8")


def test_garbage_json_is_rejected(streamed_safetensors, tmp_path):
    raw = b"{not json"
    path = write(tmp_path, "garbage.safetensors", struct.pack("<Q", len(raw)) + raw)
    expect_header_error(streamed_safetensors, path, "JSON")


def test_duplicate_names_are_rejected(streamed_safetensors, tmp_path):
    entry = '{"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}'
    raw = ('{"w": %s, "w": %s}' % (entry, entry)).encode()
    path = write(tmp_path, "dup.safetensors", struct.pack("<Q", len(raw)) + raw + b"\x00")
    expect_header_error(streamed_safetensors, path, "duplicate")


# -- real files --------------------------------------------------------------


def test_round_trip_matches_safetensors(streamed_safetensors, tmp_path):
    torch.manual_seed(0)
    tensors = {
        "double_blocks.0.img_attn.qkv.weight": torch.randn(96, 32).to(torch.bfloat16),
        "f16": torch.randn(3, 5).half(),
        "f32": torch.randn(7),
        "f64": torch.randn(2, 2, 2).double(),
        "i64": torch.arange(-5, 5),
        "i8": torch.arange(-3, 3).to(torch.int8),
        "u8": torch.arange(0, 255, 7).to(torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "f8": torch.randn(16).to(torch.float8_e4m3fn),
    }
    path = tmp_path / "real.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "x"})
    expected = reference_load_file(str(path))

    loaded = streamed_safetensors.load_file(path)
    assert set(loaded) == set(expected)
    for name, value in expected.items():
        assert loaded[name].dtype == value.dtype, name
        assert loaded[name].shape == value.shape, name
        assert torch.equal(loaded[name].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), name

    with streamed_safetensors.StreamedSafetensors(path) as reader:
        assert reader.metadata == {"format": "pt", "note": "x"}
        one = reader.read("f32")
    one.add_(1)  # a fresh writable buffer, not a view of the file
    assert torch.equal(one, expected["f32"] + 1)


def test_large_tensor_is_read_in_chunks(streamed_safetensors, tmp_path, monkeypatch):
    monkeypatch.setattr(streamed_safetensors, "_READ_CHUNK", 1000)
    value = torch.randn(300, 41)
    path = tmp_path / "chunks.safetensors"
    save_file({"w": value}, str(path))
    assert torch.equal(streamed_safetensors.load_file(path)["w"], value)


def test_group_keys_by_block(streamed_safetensors):
    groups = streamed_safetensors.group_keys(
        [
            "double_blocks.0.img_mlp.0.weight",
            "double_blocks.10.img_mlp.0.weight",
            "single_blocks.1.linear1.weight",
            "double_blocks.0.txt_attn.qkv.weight",
            "img_in.weight",
            "single_blocks_extra.weight",
        ],
        ["double_blocks", "single_blocks"],
    )
    assert groups == {
        "double_blocks.0": ["double_blocks.0.img_mlp.0.weight", "double_blocks.0.txt_attn.qkv.weight"],
        "double_blocks.10": ["double_blocks.10.img_mlp.0.weight"],
        "single_blocks.1": ["single_blocks.1.linear1.weight"],
        "": ["img_in.weight", "single_blocks_extra.weight"],
    }


# -- property tests of the header parser --------------------------------------

names = st.text(alphabet="abcdefghij._0123456789", min_size=1, max_size=12)
entries = st.lists(
    st.tuples(
        st.sampled_from(sorted(ITEMSIZE)),
        st.lists(st.integers(0, 5), max_size=3),
    ),
    max_size=6,
)


@st.composite
def valid_files(draw):
    chosen = draw(st.lists(names, unique=True, max_size=6))
    specs = draw(entries)[: len(chosen)]
    header, offset = {}, 0
    for name, (dtype, shape) in zip(chosen, specs):
        numel = 1
        for d in shape:
            numel *= d
        begin = offset
        end = begin + numel * ITEMSIZE[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
        offset = end
    if draw(st.booleans()):
        header["__metadata__"] = {"k": draw(st.text(max_size=5))}
    items = list(header.items())
    order = draw(st.permutations(range(len(items))))
    header = dict(items[i] for i in order)
    return header, bytes(offset)


def check_consistent(parsed, file_size):
    """What a successful parse promises: the ranges tile the data section exactly."""
    position = 0
    for entry in sorted(parsed.entries.values(), key=lambda e: (e.begin, e.end)):
        numel = 1
        for d in entry.shape:
            numel *= d
        assert entry.end - entry.begin == numel * ITEMSIZE_ALL[entry.dtype]
        assert entry.begin == position <= entry.end
        position = entry.end
    assert parsed.data_start + position == file_size


ITEMSIZE_ALL = dict(ITEMSIZE, U16=2, U32=4, U64=8, F8_E4M3=1, F8_E5M2=1)


def parse_blob(sst, blob, name="mutant.safetensors"):
    return sst.read_header(io.BytesIO(blob), len(blob), name)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(valid_files())
def test_random_valid_headers_parse(streamed_safetensors, tmp_path, case):
    header, data = case
    blob = pack(header, data)
    assert reference_accepts(blob, tmp_path), "the generator made a file safetensors refuses"
    parsed = parse_blob(streamed_safetensors, blob)
    expected = {k: v for k, v in header.items() if k != "__metadata__"}
    assert set(parsed.entries) == set(expected)
    for name, info in expected.items():
        entry = parsed.entries[name]
        assert entry.dtype == info["dtype"]
        assert list(entry.shape) == info["shape"]
        assert [entry.begin, entry.end] == info["data_offsets"]
    assert parsed.metadata == header.get("__metadata__", {})
    check_consistent(parsed, len(blob))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def structural_mutants(draw):
    header, data = draw(valid_files())
    tensors = [k for k in header if k != "__metadata__"]
    if tensors:
        victim = draw(st.sampled_from(tensors))
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets", None]))
        if field is None:
            header[victim] = draw(json_values)
        else:
            header[victim][field] = draw(json_values)
    else:
        header[draw(names)] = draw(json_values)
    return pack(header, data)


@st.composite
def byte_mutants(draw):
    header, data = draw(valid_files())
    blob = bytearray(pack(header, data))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "delete", "insert", "truncate"]))
        pos = draw(st.integers(0, max(0, len(blob) - 1)))
        if kind == "flip" and blob:
            blob[pos] = draw(st.integers(0, 255))
        elif kind == "delete":
            del blob[pos : pos + draw(st.integers(1, 8))]
        elif kind == "insert":
            blob[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        else:
            del blob[pos:]
    return bytes(blob)


def reference_accepts(blob, folder) -> bool:
    """Whether safetensors' own safe_open opens these bytes."""
    path = folder / "reference.safetensors"
    path.write_bytes(blob)
    try:
        with safe_open(str(path), framework="pt") as reference:
            reference.keys()
    except Exception:
        return False
    return True


def parses_or_fails_clearly(sst, blob, folder):
    try:
        parsed = parse_blob(sst, blob)
    except sst.SafetensorsHeaderError as e:
        assert "mutant.safetensors" in str(e)
        return
    # any other exception type propagates and fails the test
    check_consistent(parsed, len(blob))
    assert reference_accepts(blob, folder), "the streamed reader accepted a file safe_open refuses"
    again = parse_blob(sst, blob)
    assert again == parsed


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(structural_mutants())
def test_mutated_header_fields_parse_or_fail_clearly(streamed_safetensors, tmp_path, blob):
    parses_or_fails_clearly(streamed_safetensors, blob, tmp_path)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(byte_mutants())
def test_mutated_bytes_parse_or_fail_clearly(streamed_safetensors, tmp_path, blob):
    parses_or_fails_clearly(streamed_safetensors, blob, tmp_path)


@st.composite
def layout_mutants(draw):
    """A valid file with a gap before one tensor, or bytes after the last one."""
    header, data = draw(valid_files())
    tensors = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    extra = draw(st.integers(1, 4))
    if tensors and draw(st.booleans()):
        start = header[draw(st.sampled_from(tensors))]["data_offsets"][0]
        for name in tensors:  # everything from that offset on moves back by `extra`
            begin, end = header[name]["data_offsets"]
            if begin >= start:
                header[name]["data_offsets"] = [begin + extra, end + extra]
    return pack(header, data + bytes(extra))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout_mutants())
def test_gaps_and_trailing_bytes_are_refused_like_safe_open(streamed_safetensors, tmp_path, blob):
    assert not reference_accepts(blob, tmp_path)
    with pytest.raises(streamed_safetensors.SafetensorsHeaderError, match="gap of|belong to no tensor"):
        parse_blob(streamed_safetensors, blob)
