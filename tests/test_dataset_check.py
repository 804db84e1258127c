"""The up-front dataset check: image headers read without PIL, sizes, captions, the file walk.
(PIL's own verdict on real PNG/JPEG/WebP files: tests/trainer_patches/test_image_headers.py.)"""

import struct
import tracemalloc
import zlib

import pytest
from conftest import write_png
from png_bytes import IEND, chunk, ihdr, png

from launcher.errors import LauncherError
from launcher.runs.dataset import check_dataset, dataset_images
from launcher.runs.images import BadImage, image_size


def jpeg(width: int, height: int, end: bool = True) -> bytes:
    """The segments a baseline JPEG has (SOI, APP0, SOF0, SOS, data, EOI); enough for a header reader."""
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    sof0 = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\x01\x11\x00"
    sos = b"\xff\xda" + struct.pack(">HB", 8, 1) + b"\x01\x00\x00\x3f\x00"
    return b"\xff\xd8" + app0 + b"\xff\xff" + sof0 + sos + b"\x12\x34\x56" + (b"\xff\xd9" if end else b"")


def webp_lossless(width: int, height: int) -> bytes:
    bits = (width - 1) | ((height - 1) << 14)
    chunk = b"VP8L" + struct.pack("<I", 5) + b"\x2f" + struct.pack("<I", bits) + b"\x00"
    return b"RIFF" + struct.pack("<I", 4 + len(chunk)) + b"WEBP" + chunk


def test_sizes_of_png_jpeg_and_webp(tmp_path):
    assert image_size(write_png(tmp_path / "a.png", 31, 7)) == (31, 7)
    (tmp_path / "b.jpg").write_bytes(jpeg(640, 480))
    assert image_size(tmp_path / "b.jpg") == (640, 480)
    (tmp_path / "c.webp").write_bytes(webp_lossless(300, 200))
    assert image_size(tmp_path / "c.webp") == (300, 200)


def test_format_comes_from_the_bytes_not_the_name(tmp_path):
    (tmp_path / "really_a_jpeg.png").write_bytes(jpeg(64, 64))
    assert image_size(tmp_path / "really_a_jpeg.png") == (64, 64)


@pytest.mark.parametrize("damage, reason", [
    (lambda blob: b"hello, this is text", "is not a PNG, JPEG or WebP image"),
    (lambda blob: blob[: len(blob) - 10], "truncated PNG"),
    (lambda blob: blob[:40] + bytes([blob[40] ^ 1]) + blob[41:], "fails its CRC check"),
    (lambda blob: b"", "is not a PNG"),
])
def test_damaged_pngs(tmp_path, damage, reason):
    path = write_png(tmp_path / "x.png", 16, 16)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(BadImage, match=reason):
        image_size(path)


def test_truncated_jpeg_and_webp(tmp_path):
    (tmp_path / "a.jpg").write_bytes(jpeg(64, 64, end=False))
    with pytest.raises(BadImage, match="no end-of-image marker"):
        image_size(tmp_path / "a.jpg")
    (tmp_path / "b.jpg").write_bytes(jpeg(64, 64)[:12])
    with pytest.raises(BadImage, match="truncated or damaged JPEG"):
        image_size(tmp_path / "b.jpg")
    (tmp_path / "c.webp").write_bytes(webp_lossless(64, 64)[:-3])
    with pytest.raises(BadImage, match="truncated WebP"):
        image_size(tmp_path / "c.webp")


def test_the_walk_matches_the_trainers(tmp_path):
    write_png(tmp_path / "a.png", 8, 8)
    write_png(tmp_path / "sub" / "b.PNG", 8, 8)
    write_png(tmp_path / "_controls" / "c.png", 8, 8)
    (tmp_path / "d.bmp").write_bytes(b"BM")
    (tmp_path / "e.txt").write_text("caption")
    assert [p.relative_to(tmp_path).as_posix() for p in dataset_images(tmp_path)] == ["a.png", "sub/b.PNG"]


def test_caption_extension_with_or_without_dot(tmp_path):
    write_png(tmp_path / "a.png", 64, 64)
    (tmp_path / "a.caption").write_text("a photo", encoding="utf-8")
    assert len(check_dataset(tmp_path, ".caption").good) == 1
    assert len(check_dataset(tmp_path, "caption").good) == 1


def test_bucket_tolerance_sets_the_minimum(tmp_path):
    write_png(tmp_path / "a.png", 40, 300)
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(LauncherError, match="40x300 px; both sides must be at least 64 px"):
        check_dataset(tmp_path)
    assert len(check_dataset(tmp_path, minimum=32).good) == 1


def test_the_message_shows_ten_files_and_counts_the_rest(tmp_path):
    for index in range(13):
        (tmp_path / f"bad{index:02d}.png").write_text("text")
    with pytest.raises(LauncherError) as info:
        check_dataset(tmp_path)
    message = str(info.value)
    assert "13 of 13 images" in message and "... and 3 more" in message
    assert message.count("is not a PNG") == 10


# -- PNGs whose chunks walk fine but that PIL refuses when the trainer loads them ---------------------


IHDR = ihdr(64, 64)
PIXELS = zlib.compress(b"".join(b"\x00" + bytes(range(64)) for _ in range(64)))


@pytest.mark.parametrize("blob, reason", [
    (png(IHDR, IEND), "is a damaged PNG (it has no IDAT image data before its IEND chunk)"),
    (png(chunk(b"IHDR", struct.pack(">II", 64, 64)), chunk(b"IDAT", PIXELS), IEND),
     "is a damaged PNG (its IHDR chunk is 8 bytes long, it must be 13)"),
    (png(chunk(b"IHDR", b""), chunk(b"IDAT", PIXELS), IEND), "is a damaged PNG (its IHDR chunk is 0 bytes long, it must be 13)"),
    (png(IHDR, chunk(b"IDAT", PIXELS[: len(PIXELS) // 2]), IEND),
     "is a truncated PNG (its IDAT image data stops before the end of its zlib stream)"),
    (png(IHDR, chunk(b"IDAT", PIXELS[:2] + bytes(len(PIXELS) - 2)), IEND),
     "is a damaged PNG (its IDAT image data does not decompress: Error -3 while decompressing data: "),
], ids=["no IDAT", "8-byte IHDR", "0-byte IHDR", "cut zlib stream", "bad zlib data"])
def test_pngs_pil_refuses_are_refused(tmp_path, blob, reason):
    path = tmp_path / "x.png"
    path.write_bytes(blob)
    with pytest.raises(BadImage) as info:
        image_size(path)
    if reason.endswith(": "):  # then zlib's own words follow
        assert str(info.value).startswith(reason) and str(info.value).endswith(")"), info.value
    else:
        assert str(info.value) == reason


def test_image_data_split_over_many_idat_chunks_passes(tmp_path):
    pieces = [chunk(b"IDAT", PIXELS[start : start + 7]) for start in range(0, len(PIXELS), 7)]
    (tmp_path / "split.png").write_bytes(png(IHDR, *pieces, IEND))
    assert image_size(tmp_path / "split.png") == (64, 64)


def test_the_image_data_is_not_decompressed_into_memory(tmp_path):
    """16000x16000 grey: 256 MB of pixels from a few hundred kB of zlib data, checked in small pieces."""
    side = 16_000
    squeezer, parts = zlib.compressobj(9), []
    row = bytes(side + 1)
    for _ in range(side):
        parts.append(squeezer.compress(row))
    parts.append(squeezer.flush())
    (tmp_path / "big.png").write_bytes(png(ihdr(side, side), chunk(b"IDAT", b"".join(parts)), IEND))
    tracemalloc.start()
    try:
        assert image_size(tmp_path / "big.png") == (side, side)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"{peak / 2**20:.0f} MiB held while checking a 256 MB image"


def test_each_refused_png_is_one_line_of_the_dataset_check(tmp_path):
    blobs = {"no_idat.png": png(IHDR, IEND), "short_ihdr.png": png(chunk(b"IHDR", b""), chunk(b"IDAT", PIXELS), IEND),
             "cut.png": png(IHDR, chunk(b"IDAT", PIXELS[:-9]), IEND), "good.png": png(IHDR, chunk(b"IDAT", PIXELS), IEND)}
    for name, blob in blobs.items():
        (tmp_path / name).write_bytes(blob)
        (tmp_path / name).with_suffix(".txt").write_text("a photo", encoding="utf-8")
    with pytest.raises(LauncherError) as info:
        check_dataset(tmp_path)
    lines = str(info.value).splitlines()
    assert lines[:4] == [
        f"3 of 4 images in the dataset {tmp_path} cannot be used:",
        "  cut.png is a truncated PNG (its IDAT image data stops before the end of its zlib stream)",
        "  no_idat.png is a damaged PNG (it has no IDAT image data before its IEND chunk)",
        "  short_ihdr.png is a damaged PNG (its IHDR chunk is 0 bytes long, it must be 13)",
    ]
    result = check_dataset(tmp_path, skip_bad=True)
    assert result.good == [tmp_path / "good.png"]
    assert [path.name for path, _ in result.bad] == ["cut.png", "no_idat.png", "short_ihdr.png"]
