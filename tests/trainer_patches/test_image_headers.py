"""The launcher's PIL-free image check (launcher/runs/images.py) against the trainer's PIL.

The launcher reads image headers in its own interpreter, which has no PIL; the trainer opens
the same files with PIL. Every file PIL writes must pass with PIL's size, and a damaged file
the launcher passes must be one PIL can load: the check never refuses a good image and never
lets through a truncated one that would fail in the trainer.
"""

import io

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from launcher.runs.images import BadImage, image_size

FORMATS = [("PNG", {}), ("JPEG", {}), ("JPEG", {"progressive": True}), ("WEBP", {}),
           ("WEBP", {"lossless": True}), ("PNG", {"optimize": True})]


def encoded(fmt: str, options: dict, width: int, height: int, mode: str) -> bytes:
    image = Image.new(mode, (width, height))
    image.putdata([(x * 7 % 256, x * 13 % 256, x % 256, 255)[: len(mode)] for x in range(width * height)])
    buffer = io.BytesIO()
    image.convert("RGB" if fmt == "JPEG" else mode).save(buffer, fmt, **options)
    return buffer.getvalue()


def pil_loads(data: bytes) -> bool:
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
    except Exception:
        return False
    return True


images = st.tuples(st.sampled_from(FORMATS), st.integers(1, 90), st.integers(1, 90), st.sampled_from(["RGB", "RGBA"]))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(images)
def test_every_image_pil_writes_passes_with_its_size(tmp_path, case):
    (fmt, options), width, height, mode = case
    path = tmp_path / "image.bin"
    path.write_bytes(encoded(fmt, options, width, height, mode))
    assert image_size(path) == (width, height)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(images, st.floats(0.0, 0.999))
def test_a_truncated_image_passes_only_if_pil_loads_it(tmp_path, case, keep):
    (fmt, options), width, height, mode = case
    data = encoded(fmt, options, width, height, mode)
    cut = data[: int(len(data) * keep)]
    path = tmp_path / "image.bin"
    path.write_bytes(cut)
    try:
        image_size(path)
    except BadImage:
        return
    assert pil_loads(cut), f"{fmt} {options} cut at {len(cut)} of {len(data)} bytes passed, PIL fails on it"


@pytest.mark.parametrize("fmt, options", FORMATS)
def test_text_renamed_as_an_image_is_refused(tmp_path, fmt, options):
    path = tmp_path / f"notes.{fmt.lower()}"
    path.write_text("not an image at all")
    assert not pil_loads(path.read_bytes())
    with pytest.raises(BadImage, match="is not a PNG, JPEG or WebP image"):
        image_size(path)
