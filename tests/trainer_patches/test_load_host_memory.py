"""Host RAM of the transformer load does not grow with depth when blocks go off the host.

bench/load_rss_depth.py runs the real Flux2Model.load_model (to where the text encoder would
load) in a fresh process per measurement and reports the peak RSS the load added (VmHWM,
reset after imports). Depth N and 4N, for the streamed phase (read + quantize per block) and
the cache load (4 MiB of staging, so the cache is many times the buffers). On a CPU machine
the meta device stands in for the GPU: it holds no host memory, as the GPU would not. The
same runs with the blocks parked on the CPU (the fallback) grow with depth: the check can fail.
Linux only (VmHWM, clear_refs).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "load_rss_depth.py"
# hidden:double:single at depth N and 4N: the blocks add ~350 MiB of bf16, ~96 MiB quantized.
# Off the host, the peak of a streamed load varies by up to ~30 MiB with no trend in depth
# (allocator and quantization temporaries), so the parked control must grow by several times that.
SIZES = ("768:2:4", "768:8:16")
MIB = 2**20 / 2**30  # in GiB


@pytest.fixture(scope="module")
def rows(trainer_checkout, tmp_path_factory):
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's VmHWM reset (/proc/self/clear_refs)")
    out = tmp_path_factory.mktemp("rss") / "rows.jsonl"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--trainer", str(trainer_checkout), "--dir", str(out.parent),
         "--sizes", ",".join(SIZES), "--qtypes", "int4_fused", "--staging-mib", "4", "--out", str(out)],
        capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {(r["size"], r["mode"], r["place"]): r for r in map(json.loads, out.read_text().splitlines())}


def growth(rows, mode, place, figure):
    small, large = (rows[(size, mode, place)][figure] for size in SIZES)
    return large - small


@pytest.mark.parametrize("mode", ["first", "cache"], ids=["streamed-phase", "cache-load"])
def test_peak_does_not_grow_with_depth_off_the_host(rows, mode):
    parked = growth(rows, mode, "cpu", "peak_gib")
    placed = growth(rows, mode, "offhost", "peak_gib")
    assert parked > 64 * MIB, f"the parked control should grow with depth (+{parked / MIB:.1f} MiB): no signal"
    assert placed < parked / 3, (
        f"{mode}: peak host RSS grew by {placed / MIB:.1f} MiB from depth N to 4N with the blocks off the "
        f"host (parked on the CPU: +{parked / MIB:.1f} MiB)"
    )


def test_nothing_of_the_model_stays_on_the_host(rows):
    """What stays is module objects, not weights: a fraction of the parked model."""
    for size in SIZES:
        for mode in ("first", "cache"):
            kept = rows[(size, mode, "offhost")]["kept_gib"]
            parked = rows[(size, mode, "cpu")]["kept_gib"]
            assert kept < parked / 4, f"{size} {mode}: {kept / MIB:.1f} MiB left on the host (parked: {parked / MIB:.1f})"
