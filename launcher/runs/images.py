"""Image sizes from file headers, in the bare interpreter (the launcher has no PIL).

Enough of each format is walked to tell a real image from a renamed text file or a
truncated download before the trainer starts: PNG chunks with their CRCs up to IEND (a 13-byte
IHDR, and IDAT data that decompresses to the end of its zlib stream, checked in bounded pieces
so a large image is never held in memory), JPEG
segments up to the frame header plus the end-of-image marker, WebP's RIFF size and frame
header. The format comes from the bytes, not the file name, as in the trainer's PIL. PNG modes that
PIL's `convert('RGB')` in the trainer's loader turns into a different picture (16-bit grey:
clipped to white; palette with transparency: hidden colours) are refused; the launcher cannot
change the trainer's loader, and these files are rare and easy to re-save.
"""

import struct
import zlib
from pathlib import Path

from launcher.user_files import UserFileError, open_regular, read_bytes

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# JPEG start-of-frame markers (C4 DHT, C8 JPG and CC DAC share the range but are not frames)
JPEG_FRAMES = set(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
PIL_MAX_PIXELS = int(1024 * 1024 * 1024 // 4 // 3)
"""PIL.Image.MAX_IMAGE_PIXELS; over twice this, opening the image raises DecompressionBombError."""
INFLATE_PIECE = 1 << 20
"""The most bytes of decompressed PNG pixel data held at once while checking its zlib stream."""


class BadImage(ValueError):
    """The file is not an image the trainer can open; the message says why."""


def image_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG, JPEG or WebP file; BadImage when it is not one or is damaged."""
    try:
        with open_regular(path) as handle:  # its kind first: a large file of anything else is never read whole
            _image_kind(handle.read(12))
        data = read_bytes(path, "image")  # a regular file only, and not without bound
    except UserFileError as error:
        raise BadImage(error.reason) from None
    if data.startswith(PNG_SIGNATURE):
        return _png_size(data)
    if data.startswith(b"\xff\xd8"):
        return _jpeg_size(data)
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return _webp_size(data)
    raise BadImage(f"is not a PNG, JPEG or WebP image (it starts with {data[:8]!r})")


def _image_kind(head: bytes) -> None:
    if not (head.startswith((PNG_SIGNATURE, b"\xff\xd8")) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")):
        raise BadImage(f"is not a PNG, JPEG or WebP image (it starts with {head[:8]!r})")


def _png_size(data: bytes) -> tuple[int, int]:
    position, size, lossy = 8, None, None
    view = memoryview(data)
    pixels, previous = None, None  # the IDAT data's decompressor; the kind of the chunk before
    while True:
        if position + 12 > len(data):
            raise BadImage("is a truncated PNG (it ends before its IEND chunk)")
        length, kind = struct.unpack(">I4s", data[position : position + 8])
        end = position + 12 + length
        if end > len(data):
            raise BadImage(f"is a truncated PNG (chunk {kind!r} runs past the end of the file)")
        (crc,) = struct.unpack(">I", data[end - 4 : end])
        if zlib.crc32(view[position + 4 : end - 4]) != crc:
            raise BadImage(f"is a damaged PNG (chunk {kind!r} fails its CRC check)")
        if kind == b"IHDR":
            if length != 13:
                raise BadImage(f"is a damaged PNG (its IHDR chunk is {length} bytes long, it must be 13)")
            size = struct.unpack(">II", data[position + 8 : position + 16])
            depth, colour = data[position + 16 : position + 18]
            if (depth, colour) == (16, 0):
                lossy = ("is a 16-bit greyscale PNG: the trainer's PIL opens it as mode I;16 and its conversion to "
                         "RGB clips it to white; save it as 8-bit greyscale or RGB")
        if kind == b"tRNS" and size is not None and colour == 3:
            lossy = ("is a palette PNG with transparency: the trainer's conversion to RGB drops the transparency and "
                     "trains the hidden palette colours; save it as RGB (flattened on the background you want)")
        if kind == b"IDAT" and (pixels is None or previous == b"IDAT"):  # PIL reads one run of IDATs
            pixels = pixels or zlib.decompressobj()
            if size is None or size[0] * size[1] <= 2 * PIL_MAX_PIXELS:  # larger: PIL refuses it unread
                _inflate(pixels, view[position + 8 : end - 4])
        if kind == b"IEND":
            if size is None:
                raise BadImage("is a PNG without an IHDR chunk")
            if pixels is None:
                raise BadImage("is a damaged PNG (it has no IDAT image data before its IEND chunk)")
            if not pixels.eof and size[0] * size[1] <= 2 * PIL_MAX_PIXELS:
                raise BadImage("is a truncated PNG (its IDAT image data stops before the end of its zlib stream)")
            if lossy:
                raise BadImage(lossy)
            return size
        position, previous = end, kind


def _inflate(pixels, piece) -> None:
    """Feed one IDAT chunk's bytes to the zlib stream, throwing the pixels away INFLATE_PIECE at a time."""
    try:
        while not pixels.eof:
            out = pixels.decompress(piece, INFLATE_PIECE)
            piece = pixels.unconsumed_tail
            if not piece and len(out) < INFLATE_PIECE:  # all fed and nothing held back
                return
    except zlib.error as error:
        raise BadImage(f"is a damaged PNG (its IDAT image data does not decompress: {error})") from None


def _jpeg_size(data: bytes) -> tuple[int, int]:
    position, size = 2, None
    while size is None:
        if position + 4 > len(data) or data[position] != 0xFF:
            raise BadImage("is a truncated or damaged JPEG (no frame header)")
        marker = data[position + 1]
        if marker == 0xFF:  # a fill byte before the marker
            position += 1
            continue
        if marker in JPEG_FRAMES:
            if position + 9 > len(data):
                raise BadImage("is a truncated JPEG (frame header cut off)")
            height, width = struct.unpack(">HH", data[position + 5 : position + 9])
            size = (width, height)
        position += 2 + struct.unpack(">H", data[position + 2 : position + 4])[0]
    if data.rfind(b"\xff\xd9") < position:
        raise BadImage("is a truncated JPEG (no end-of-image marker: the download stopped early?)")
    return size


def _webp_size(data: bytes) -> tuple[int, int]:
    (riff_size,) = struct.unpack("<I", data[4:8])
    if riff_size + 8 > len(data):
        raise BadImage(f"is a truncated WebP ({len(data)} of {riff_size + 8} bytes)")
    chunk, body = data[12:16], data[20:30]
    if chunk == b"VP8 " and len(body) == 10 and body[3:6] == b"\x9d\x01\x2a":
        width, height = struct.unpack("<HH", body[6:10])
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L" and len(body) >= 5 and body[0] == 0x2F:
        (bits,) = struct.unpack("<I", body[1:5])
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X" and len(body) == 10:
        return int.from_bytes(body[4:7], "little") + 1, int.from_bytes(body[7:10], "little") + 1
    raise BadImage(f"is a WebP with an unknown or damaged image chunk {chunk!r}")
