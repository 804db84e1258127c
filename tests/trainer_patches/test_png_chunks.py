"""PNGs whose chunks walk and pass their CRCs but that the trainer's PIL cannot load: the launcher's
PIL-free check (launcher/runs/images.py) refuses each, as PIL does. The same on every target: the
first target's suite runs it."""

import struct
import zlib

import pytest
from png_bytes import IEND, chunk, ihdr, png
from test_image_headers import pil_loads

from launcher.runs.images import BadImage, image_size


pytestmark = pytest.mark.first_target

IHDR = ihdr(64, 64, colour=2)
PIXELS = zlib.compress(b"".join(b"\x00" + bytes(range(192)) for _ in range(64)))
TEXT = chunk(b"tEXt", b"Comment\x00between the image data")

REFUSED = {
    "no IDAT": png(IHDR, IEND),
    "8-byte IHDR": png(chunk(b"IHDR", struct.pack(">II", 64, 64)), chunk(b"IDAT", PIXELS), IEND),
    "0-byte IHDR": png(chunk(b"IHDR", b""), chunk(b"IDAT", PIXELS), IEND),
    "cut zlib stream": png(IHDR, chunk(b"IDAT", PIXELS[: len(PIXELS) // 2]), IEND),
    "bad zlib data": png(IHDR, chunk(b"IDAT", PIXELS[:2] + bytes(len(PIXELS) - 2)), IEND),
    "IDAT after another chunk": png(IHDR, chunk(b"IDAT", PIXELS[:40]), TEXT, chunk(b"IDAT", PIXELS[40:]), IEND),
}


def test_the_good_one_loads_everywhere(tmp_path):
    good = png(IHDR, chunk(b"IDAT", PIXELS[:40]), chunk(b"IDAT", PIXELS[40:]), IEND)
    assert pil_loads(good)
    (tmp_path / "good.png").write_bytes(good)
    assert image_size(tmp_path / "good.png") == (64, 64)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_pil_refuses_the_launcher_refuses(tmp_path, name):
    assert not pil_loads(REFUSED[name])
    path = tmp_path / "x.png"
    path.write_bytes(REFUSED[name])
    with pytest.raises(BadImage, match="PNG"):
        image_size(path)
