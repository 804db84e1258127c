"""PNG files byte by byte, with the standard library only: the launcher's venv has no PIL, and the
in-trainer suite checks the same bytes against the trainer's PIL."""

import struct
import zlib

SIGNATURE = b"\x89PNG\r\n\x1a\n"


def chunk(kind: bytes, data: bytes) -> bytes:
    """One chunk: length, type, data and the CRC over type and data."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(*chunks: bytes) -> bytes:
    return SIGNATURE + b"".join(chunks)


def ihdr(width: int, height: int, colour: int = 0) -> bytes:
    """An 8-bit IHDR chunk: colour 0 is grey, 2 is RGB."""
    return chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, colour, 0, 0, 0))


IEND = chunk(b"IEND", b"")
