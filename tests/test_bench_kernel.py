"""The bench scripts choose the 4-bit kernel as a run does, through model_kwargs: train_step's
`--kernel KEY=VALUE` (bench/_settings.py) is checked by the settings catalogue before anything
loads, and no script sets a kernel through an environment variable."""

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest
import setting_reads

from bench import _settings

REPO = Path(__file__).resolve().parents[1]


def parse(*flags: str) -> dict:
    parser = argparse.ArgumentParser()
    _settings.add_kernel_flag(parser)
    return dict(parser.parse_args([part for flag in flags for part in ("--kernel", flag)]).kernel)


def test_kernel_flags_are_yaml_scalars_a_later_one_winning():
    assert parse("w4a8_gemm=scaled_mm", "w4a8_activations=fp8", "int4_chunk_mib=64", "int4_chunk_mib=256",
                 "int4_kernel=false") == {"w4a8_gemm": "scaled_mm", "w4a8_activations": "fp8",
                                          "int4_chunk_mib": 256, "int4_kernel": False}
    assert parse() == {}


@pytest.mark.parametrize("flag, message", [
    ("w4a8_gemm=cublas", "w4a8_gemm=cublas: not one of the allowed values; allowed: triton | scaled_mm"),
    ("w4a8_activations=int4", "w4a8_activations=int4: not one of the allowed values; allowed: fp8 | int8"),
    ("int4_chunk_mib=0", "int4_chunk_mib=0: out of range"),
    ("int4_chunk_mib=64MiB", "int4_chunk_mib=64MiB: not a whole number"),
    ("int4_kernel=0", "int4_kernel=0: not true/false"),
    ("w4a8_gemm=auto", "w4a8_gemm=auto: auto is resolved by `python -m launcher run`"),
    ("stream_mode=serialized", "KEY one of the kernel settings w4a8_activations, w4a8_gemm"),
    ("w4a8_gemm", "give KEY=VALUE"),
])
def test_a_bad_kernel_flag_is_refused_naming_the_key(flag, message):
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
        _settings.kernel_setting(flag)


def test_the_kernel_keys_are_the_ones_the_trainer_reads():
    catalogue = _settings.settings.CATALOGUE
    assert all(catalogue[key].block == "model_kwargs" for key in _settings.KERNEL_KEYS)
    qtypes = (REPO / "flux2_contract" / "qtypes.py").read_text(encoding="utf-8")
    found = setting_reads.check(qtypes, set(catalogue), {"read"})
    assert found.around == [] and found.through.keys() == set(_settings.KERNEL_KEYS)


def test_train_step_refuses_a_bad_kernel_before_it_imports_torch(tmp_path):
    out = tmp_path / "step.json"
    done = subprocess.run([sys.executable, "-m", "bench.train_step", "--trainer", str(tmp_path), "--weights",
                           "int4_w4a8", "--out", str(out), "--kernel", "w4a8_gemm=cublas"],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and "argument --kernel: w4a8_gemm=cublas" in done.stderr, done.stderr
    assert not out.exists()


def test_no_bench_script_sets_a_kernel_by_environment_variable():
    """The trainer reads no such variable any more: one would be silently ignored."""
    variable = re.compile(r"INT4_(W4A8|LINEAR)_\w+")
    for path in sorted((REPO / "bench").glob("*")):
        if path.suffix in (".py", ".sh"):
            assert not variable.search(path.read_text(encoding="utf-8")), f"bench/{path.name}"
