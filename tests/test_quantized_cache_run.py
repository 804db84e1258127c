"""Wall 8 end to end: the second launch loads the quantized transformer from the workdir's cache
and gives the same first-step loss (same `training_seed`); a corrupted cache is reported, set
aside and rebuilt by the next launch.
"""

import re
import struct
from pathlib import Path

import pytest
from conftest import private_workdir
from tiny_run import run_tiny

pytestmark = pytest.mark.trainer

FIRST_LOSS = re.compile(rb"loss: ([0-9.eE+-]+)")


def launch(workdir, output: Path) -> str:
    result = run_tiny(workdir.root, output=output)
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


def first_loss(text: str) -> float:
    found = FIRST_LOSS.search(text.encode())
    assert found, "no loss in the trainer's output"
    return float(found.group(1))


@pytest.fixture(scope="module")
def cache_runs(trainer_workdir, tmp_path_factory):
    """Launches of the tiny preset sharing the workdir's cache: the third after a flipped data byte,
    the fifth after metadata nested too deep to parse (it used to crash every launch)."""
    # a workdir of its own: these launches delete and damage its cache, which others must not read
    workdir = private_workdir(trainer_workdir, tmp_path_factory.mktemp("cache-workdir"))
    root = tmp_path_factory.mktemp("cache-runs")
    first = launch(workdir, root / "first")
    second = launch(workdir, root / "second")
    caches = sorted(workdir.quantized_cache.glob("*.qcache.safetensors"))
    assert len(caches) == 1, caches
    data = bytearray(caches[0].read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the tensor data
    caches[0].write_bytes(bytes(data))
    third = launch(workdir, root / "third")
    fourth = launch(workdir, root / "fourth")
    nested = b'{"__metadata__": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    caches[0].write_bytes(struct.pack("<Q", len(nested)) + nested)
    fifth = launch(workdir, root / "fifth")
    return first, second, third, fourth, fifth, caches[0]


def test_first_launch_quantizes_and_writes_the_cache(cache_runs):
    first, *_ = cache_runs
    assert "no cache at" in first and "[quantized cache] wrote" in first


def test_second_launch_loads_it_with_the_same_first_loss(cache_runs):
    first, second, *_ = cache_runs
    assert "Loaded quantized transformer from cache" in second
    assert "[quantized cache] wrote" not in second
    assert first_loss(second) == first_loss(first)


def test_corrupt_cache_is_reported_set_aside_and_rebuilt(cache_runs):
    _, _, third, fourth, _, cache = cache_runs
    assert "corrupt cache" in third and "quantizing again" in third
    assert "Loaded quantized transformer from cache" not in third
    assert "[quantized cache] wrote" in third
    assert cache.with_name(cache.name + ".corrupt-1").is_file()
    assert "Loaded quantized transformer from cache" in fourth
    assert first_loss(fourth) == first_loss(third)


def test_malformed_metadata_is_a_corrupt_cache_not_a_crash(cache_runs):
    *_, fourth, fifth, cache = cache_runs
    assert "corrupt cache" in fifth and "RecursionError" in fifth
    assert "[quantized cache] wrote" in fifth and first_loss(fifth) == first_loss(fourth)
    assert cache.with_name(cache.name + ".corrupt-1").is_file(), "the earlier set-aside file is kept"
    assert cache.with_name(cache.name + ".corrupt-2").is_file()
