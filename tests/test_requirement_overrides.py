"""A torch channel's requirement overrides: the adjusted copy pip installs from, the install spec,
and what `setup --dry-run` shows."""

from launcher.cli import main
from launcher.envs.install import install_spec
from launcher.envs.requirement_overrides import named_package, write_adjusted
from launcher.envs.torchenv import CHANNELS, install_plan

OVERRIDES = {"setuptools": "80.9.0", "optimum-quanto": "0.2.7"}


def requirement_lines(path) -> list[str]:
    """The lines pip reads as requirements (comments and blank lines left out)."""
    lines = [line.split("#", 1)[0].strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line]


def test_an_override_replaces_the_pin_in_the_file_and_in_its_includes(tmp_path):
    fork = tmp_path / "trainer"
    (fork / "reqs").mkdir(parents=True)
    (fork / "requirements.txt").write_text(
        "torchao==0.10.0\n-r reqs/base.txt\nsetuptools==69.5.1\n-c reqs/pins.txt\n", encoding="utf-8")
    (fork / "reqs" / "base.txt").write_text("Optimum_Quanto==0.2.4 ; python_version >= '3.9'\npeft\n", encoding="utf-8")
    (fork / "reqs" / "pins.txt").write_text("peft<1\n", encoding="utf-8")
    before = {path: path.read_bytes() for path in fork.rglob("*.txt")}
    out = write_adjusted(fork / "requirements.txt", OVERRIDES, tmp_path / "workdir" / "requirements-x.txt")
    assert requirement_lines(out) == [
        "torchao==0.10.0", "optimum-quanto==0.2.7", "peft", "setuptools==80.9.0",
        f"-c {(fork / 'reqs' / 'pins.txt').resolve()}",
    ]
    assert {path: path.read_bytes() for path in fork.rglob("*.txt")} == before  # the fork's files untouched


def test_an_override_the_requirements_do_not_name_is_added(tmp_path):
    top = tmp_path / "requirements.txt"
    top.write_text("git+https://example.invalid/diffusers@abc\nsafetensors\n", encoding="utf-8")
    out = write_adjusted(top, {"setuptools": "80.9.0"}, tmp_path / "out.txt")
    assert requirement_lines(out) == ["git+https://example.invalid/diffusers@abc", "safetensors", "setuptools==80.9.0"]


def test_named_package_reads_names_not_options_urls_or_paths():
    assert named_package("Optimum_Quanto[extra]>=0.2 # pin") == "optimum-quanto"
    assert named_package("diffusers @ git+https://example.invalid/d") == "diffusers"
    for line in ("-r other.txt", "git+https://example.invalid/x.git", "./local", "# setuptools", ""):
        assert named_package(line) is None, line


def test_overrides_are_part_of_the_install_spec_only_where_a_channel_has_them(tmp_path):
    top = tmp_path / "requirements.txt"
    top.write_text("setuptools==69.5.1\n", encoding="utf-8")
    assert "requirement_overrides" not in install_spec(CHANNELS["cuda"], top)
    assert install_spec(CHANNELS["rocm-windows"], top)["requirement_overrides"] == CHANNELS["rocm-windows"].requirement_overrides


def test_rocm_windows_overrides_the_pins_torch_2_13_cannot_install_beside():
    overrides = CHANNELS["rocm-windows"].requirement_overrides
    major, minor, _ = (int(part) for part in overrides["setuptools"].split("."))
    assert (major, minor) >= (77, 0) and major < 82  # torch 2.13 needs >=77.0.3; 82.0.0 drops pkg_resources
    assert overrides["optimum-quanto"] == "0.2.7"
    assert all(not channel.requirement_overrides for name, channel in CHANNELS.items() if name != "rocm-windows")
    assert "requirement overrides: optimum-quanto==0.2.7, setuptools==80.9.0" in install_plan(CHANNELS["rocm-windows"])


def test_setup_dry_run_shows_the_overrides(capsys):
    assert main(["setup", "--torch-channel", "rocm-windows", "--amd-arch", "gfx1100", "--dry-run"]) == 0
    assert "requirement overrides: optimum-quanto==0.2.7, setuptools==80.9.0" in capsys.readouterr().out
