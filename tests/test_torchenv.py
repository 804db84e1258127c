"""The Windows ROCm channel: exact stable pins, its Triton held, the GPU target read from the adapter name."""

import subprocess
import sys

import pytest

from launcher.envs.amdgpu import FAMILIES, pick_target, target_of
from launcher.envs.install import install_spec
from launcher.envs.torchenv import CHANNELS, constraints_text, held_packages, install_plan, resolve_channel

WINDOWS = CHANNELS["rocm-windows"]


def test_rocm_windows_pins_an_exact_stable_trio_and_triton():
    assert set(WINDOWS.versions) == {"torch", "torchvision", "torchaudio"}
    for version in (*WINDOWS.versions.values(), *WINDOWS.triton.values()):
        assert version[0].isdigit() and not any(tag in version for tag in ("a2", "dev", "nightly", "rc")), version
    assert "nightl" not in WINDOWS.index_url and "stable" in WINDOWS.index_url
    assert WINDOWS.triton == {"triton-windows": "3.7.1.post27"}


def test_the_triton_pin_is_held_in_the_constraints():
    installed = {"torch": "2.13.0+rocm10.0.0", "torchvision": "0.28.0+rocm10.0.0",
                 "torchaudio": "2.11.0.2+rocm10.0.0", "triton-windows": "3.7.1.post27"}
    assert set(held_packages(WINDOWS)) == set(installed)
    text = constraints_text(installed)
    assert "triton-windows==3.7.1.post27\n" in text and "torch==2.13.0\n" in text
    assert "torchaudio==2.11.0.2\n" in text


@pytest.mark.parametrize("name, target", [
    ("AMD Radeon RX 7900 XTX", "gfx1100"),
    ("AMD Radeon RX 7900 XT", "gfx1100"),
    ("AMD Radeon RX 7800 XT", "gfx1101"),
    ("AMD Radeon RX 7600", "gfx1102"),
    ("AMD Radeon RX 9070 XT", "gfx1201"),
    ("AMD Radeon RX 9060 XT", "gfx1200"),
    ("AMD Radeon(TM) Graphics", None),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_adapter_names_map_to_their_target(name, target):
    assert target_of(name) == target


def test_families():
    assert {FAMILIES[target_of(n)] for n in ("RX 7900 XTX", "RX 7800 XT", "RX 7600")} == {"gfx110X"}
    assert {FAMILIES[target_of(n)] for n in ("RX 9070 XT", "RX 9060 XT")} == {"gfx120X"}


def test_the_discrete_card_wins_over_the_integrated_one_and_unknown_says_what_it_chose():
    assert pick_target("auto", ["AMD Radeon(TM) Graphics", "AMD Radeon RX 7800 XT"])[0] == "gfx1101"
    target, reason = pick_target("auto", ["Some Future Radeon"])
    assert target == "gfx1100" and "Some Future Radeon" in reason and "--amd-arch" in reason
    assert "\n" not in reason
    assert pick_target("gfx1201", ["Some Future Radeon"])[0] == "gfx1201"  # a card outside the table: --amd-arch decides


def test_the_target_reaches_the_install_and_the_spec(tmp_path):
    channel = resolve_channel("rocm-windows", "gfx1200")
    plan = install_plan(channel)
    assert "torch[device-gfx1200]==2.13.0+rocm10.0.0" in plan
    assert "torchvision[device-gfx1200]==0.28.0+rocm10.0.0" in plan and "torchaudio==2.11.0.2+rocm10.0.0" in plan
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("einops\n")
    assert install_spec(channel, requirements) != install_spec(resolve_channel("rocm-windows", "gfx1100"), requirements)


def test_amd_arch_is_refused_for_other_channels():
    from launcher.errors import LauncherError

    with pytest.raises(LauncherError, match="--amd-arch"):
        resolve_channel("cuda", "gfx1100")


def test_dry_run_prints_the_pins_the_index_and_triton_and_installs_nothing(tmp_path):
    done = subprocess.run([sys.executable, "-m", "launcher", "setup", "--workdir", str(tmp_path / "wd"),
                           "--torch-channel", "rocm-windows", "--dry-run"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for pin in ("==2.13.0+rocm10.0.0", "torchvision[device-", "torchaudio==2.11.0.2+rocm10.0.0",
                "triton-windows==3.7.1.post27", WINDOWS.index_url):
        assert pin in out, out
    assert not (tmp_path / "wd").exists()
