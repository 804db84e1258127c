"""GPU sample parsers on (synthetic) captured outputs; missing tools."""

import sys
from pathlib import Path

import pytest

from launcher.signals import gpu_sources
from launcher.signals.gpu_sources import (
    AmdSmiSource,
    GpuSample,
    NvidiaSmiSource,
    detect_source,
    parse_amd_smi,
    parse_nvidia_smi,
    parse_rocm_smi,
    parse_typeperf,
)

FIXTURES = Path(__file__).parent / "fixtures" / "watchdog"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def test_amd_smi_gpu_data_layout_stalled_card():
    sample = parse_amd_smi(fixture("amd_smi_metric_gpu_data.json"), device=0, t=12.0)
    assert sample == GpuSample(t=12.0, clock_mhz=3098, power_w=238, gpu_util=99, mem_load=4, vram_used_mb=23071)


def test_amd_smi_bare_list_layout_picks_the_device():
    saturated = parse_amd_smi(fixture("amd_smi_metric_list.json"), device=0)
    assert (saturated.clock_mhz, saturated.power_w, saturated.mem_load) == (2512, 386, 36)
    other = parse_amd_smi(fixture("amd_smi_metric_list.json"), device=1)
    assert other.power_w is None and other.mem_load is None and other.clock_mhz is None
    assert other.vram_used_mb == 41
    assert parse_amd_smi(fixture("amd_smi_metric_list.json"), device=7) is None


def test_rocm_smi():
    sample = parse_rocm_smi(fixture("rocm_smi.json"), device=0)
    assert (sample.clock_mhz, sample.power_w, sample.gpu_util, sample.mem_load) == (2497, 384, 99, 35)
    assert sample.vram_used_mb == pytest.approx(24210227200 / 2**20)
    assert parse_rocm_smi(fixture("rocm_smi.json"), device=1) is None


def test_nvidia_smi_and_not_available_fields():
    assert parse_nvidia_smi(fixture("nvidia_smi.csv"), t=1.0) == GpuSample(
        t=1.0, clock_mhz=2520, power_w=412.37, gpu_util=99, mem_load=41, vram_used_mb=21874)
    sample = parse_nvidia_smi(fixture("nvidia_smi_na.csv"))
    assert sample.power_w is None and sample.mem_load is None and sample.clock_mhz == 2520
    assert parse_nvidia_smi("") is None


def test_typeperf_sums_3d_and_compute_engines_of_the_busiest_adapter():
    sample = parse_typeperf(fixture("typeperf.csv"), t=3.0)
    # 0.0 (3D) + 91.48 (Compute_0) + 1.25 (another process' 3D); Copy engines are not compute
    assert sample.gpu_util == pytest.approx(92.732913)
    assert sample.vram_used_mb == pytest.approx(24206884864 / 2**20)
    assert sample.power_w is None and sample.clock_mhz is None and sample.mem_load is None
    igpu = parse_typeperf(fixture("typeperf.csv"), adapter="0x00000000_0x00010A33")
    assert igpu.gpu_util == pytest.approx(3.5) and igpu.vram_used_mb == 128
    assert parse_typeperf("Exiting, please wait...\n") is None


def test_sample_rows_round_trip_and_skip_unknown_fields():
    sample = GpuSample(t=5.0, clock_mhz=3100, power_w=240)
    assert sample.to_row() == {"t": 5.0, "clock_mhz": 3100, "power_w": 240}
    assert GpuSample.from_row({**sample.to_row(), "step": 3, "loss": 0.2}) == sample
    assert GpuSample.from_row({"t": 1.0, "step": 3}) is None


def test_a_missing_tool_is_reported_once_and_yields_nothing():
    notes = []
    source = AmdSmiSource(note=notes.append, executable=None)
    source.executable = None
    assert [source.sample() for _ in range(3)] == [None, None, None]
    assert len(notes) == 1 and "amd-smi" in notes[0] and "PATH" in notes[0]


def test_a_failing_tool_is_reported_once_and_never_raises(tmp_path):
    notes = []
    # python itself stands in for a broken nvidia-smi: it rejects the arguments and exits 2
    source = NvidiaSmiSource(note=notes.append, executable=sys.executable)
    assert source.sample() is None and source.sample() is None
    assert len(notes) == 1 and "exited with 2" in notes[0]


def test_unreadable_output_is_reported_once(tmp_path):
    script = tmp_path / "fake_nvidia_smi.py"
    script.write_text("print('No devices were found')\n", encoding="utf-8")
    notes = []
    source = NvidiaSmiSource(note=notes.append, executable=sys.executable)
    source.command = lambda: [sys.executable, str(script)]
    assert source.sample() is None and source.sample() is None
    assert len(notes) == 1 and "nothing this launcher can read" in notes[0]


def test_a_working_tool_through_a_subprocess(tmp_path):
    script = tmp_path / "fake_amd_smi.py"
    script.write_text(f"print(open({str(FIXTURES / 'amd_smi_metric_gpu_data.json')!r}).read())\n", encoding="utf-8")
    source = AmdSmiSource(note=pytest.fail, clock=lambda: 42.0, executable=sys.executable)
    source.command = lambda: [sys.executable, str(script)]
    assert source.sample() == GpuSample(42.0, 3098, 238, 99, 4, 23071)


def test_detect_source_with_no_tools(monkeypatch):
    monkeypatch.setattr(gpu_sources.shutil, "which", lambda name: None)
    notes = []
    assert detect_source(note=notes.append, windows=False) is None
    assert detect_source(note=notes.append, windows=True) is None
    assert len(notes) == 2 and "typeperf" in notes[1]
    with pytest.raises(ValueError):
        detect_source("pynvml")


def test_detect_source_order(monkeypatch):
    present = {"rocm-smi", "nvidia-smi", "typeperf"}
    monkeypatch.setattr(gpu_sources.shutil, "which", lambda name: f"/usr/bin/{name}" if name in present else None)
    assert detect_source(windows=False).name == "rocm-smi"
    assert detect_source(windows=True).name == "nvidia-smi"
    present.discard("nvidia-smi")
    assert detect_source(windows=True).name == "typeperf"
