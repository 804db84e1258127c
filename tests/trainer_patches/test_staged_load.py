"""toolkit/staged_load.py: tensors read onto a device through bounded staging, sha256 checked on threads.

On a CPU machine the meta device stands in for the GPU: it takes the staging path (the
buffers, the copies, the hashes) while holding no host memory itself.
"""

import hashlib
import importlib
import io

import pytest
import torch


@pytest.fixture(scope="module")
def staged(trainer_on_path):
    return importlib.import_module("toolkit.staged_load")


def file_of(staged, tensors, lead=24):
    """(file object, spans): `lead` junk bytes, then the tensors back to back."""
    data = bytearray(b"x" * lead)
    spans = []
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        spans.append(staged.TensorSpan(name, len(data), len(data) + len(raw), t.dtype, tuple(t.shape),
                                       hashlib.sha256(raw).hexdigest()))
        data += raw
    return io.BytesIO(bytes(data)), spans


def sample_tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(1000, 37, generator=g).to(torch.bfloat16),  # spans several small buffers
        "empty": torch.zeros(0, 5),
        "b": torch.randint(0, 255, (3, 1, 7), generator=g, dtype=torch.uint8),
        "c": torch.randn(513, generator=g),
    }


@pytest.mark.parametrize("buffer_bytes", [64, 4096, 1 << 20], ids=["tiny-buffers", "4KiB", "1MiB"])
@pytest.mark.parametrize("threads", [1, 3])
def test_round_trip_through_staging_buffers_of_any_size(staged, buffer_bytes, threads):
    tensors = sample_tensors()
    f, spans = file_of(staged, tensors)
    # the host target reads straight into the tensors; a device target through the ring
    for device in ("cpu", "meta"):
        out = staged.read_spans(f, spans, device, buffer_bytes=buffer_bytes, buffers=3, hash_threads=threads)
        assert list(out) == list(tensors)
        for name, t in tensors.items():
            assert out[name].dtype == t.dtype and tuple(out[name].shape) == tuple(t.shape)
            assert out[name].device.type == device
            if device == "cpu":
                assert torch.equal(out[name], t), name


@pytest.mark.parametrize("buffer_bytes", [64, 1 << 20], ids=["tiny-buffers", "1MiB"])
def test_each_tensor_on_the_device_a_placement_gives_it(staged, buffer_bytes):
    """A memory plan's load: some tensors on the host (streamed blocks), the others on the device,
    read through the same staging ring; the host ones hold the file's bytes."""
    tensors = sample_tensors()
    f, spans = file_of(staged, tensors)
    host = {"a", "c"}
    out = staged.read_spans(f, spans, lambda name: "cpu" if name in host else "meta", buffer_bytes=buffer_bytes)
    assert {name: t.device.type for name, t in out.items()} == {n: "cpu" if n in host else "meta" for n in tensors}
    for name in host:
        assert torch.equal(out[name], tensors[name]), name


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_flipped_byte_names_the_tensor(staged, device):
    tensors = sample_tensors()
    f, spans = file_of(staged, tensors)
    raw = bytearray(f.getvalue())
    raw[spans[2].begin + 3] ^= 0x10  # inside "b"
    with pytest.raises(staged.StagedReadError, match="^b: data checksum mismatch"):
        staged.read_spans(io.BytesIO(bytes(raw)), spans, device, buffer_bytes=256)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_short_file_is_an_error_not_a_partial_model(staged, device):
    tensors = sample_tensors()
    f, spans = file_of(staged, tensors)
    short = io.BytesIO(f.getvalue()[:-10])
    with pytest.raises(staged.StagedReadError, match="file ends inside"):
        staged.read_spans(short, spans, device, buffer_bytes=256)


def test_spans_with_a_gap_are_refused(staged):
    f, spans = file_of(staged, sample_tensors())
    gap = [*spans[:2], *spans[3:]]  # "b" left out
    with pytest.raises(ValueError, match="does not follow"):
        staged.read_spans(f, gap, "cpu")


def test_unpinnable_platform_falls_back_to_plain_memory(staged, monkeypatch):
    """pin=True where pinned memory cannot be had: plain buffers, synchronous copies, same result."""
    real_empty = torch.empty
    refused = []

    def empty(*args, pin_memory=False, **kwargs):
        if pin_memory:
            refused.append(True)
            raise RuntimeError("no pinned memory here")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(staged.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(staged.torch, "empty", empty)
    notes = []
    f, spans = file_of(staged, sample_tensors())
    out = staged.read_spans(f, spans, "meta", buffer_bytes=512, log=notes.append)
    assert refused == [True], "pinning was tried once, then plain memory for every buffer"
    assert any("pinned staging memory unavailable" in n for n in notes), notes
    assert set(out) == {s.name for s in spans}


def test_staging_settings_are_checked_before_any_load(trainer_on_path):
    qc = importlib.import_module("toolkit.quantized_cache")
    assert qc.staging_options({}) == {"buffers": 4, "buffer_bytes": 64 << 20, "pin": True}
    assert qc.staging_options({"cache_staging_mib": 32, "pinned_staging": False}) == {
        "buffers": 4, "buffer_bytes": 8 << 20, "pin": False}
    for bad in ("lots", 2, True, 1.5):
        with pytest.raises(ValueError, match="model_kwargs cache_staging_mib"):
            qc.staging_options({"cache_staging_mib": bad})
    with pytest.raises(ValueError, match="model_kwargs pinned_staging: 'false' is not true/false"):
        qc.staging_options({"pinned_staging": "false"})
