"""The install spec: what makes setup rebuild a trainer venv."""

from launcher.envs.install import install_spec, requirement_files
from launcher.envs.torchenv import CHANNELS


def test_included_requirement_files_count(tmp_path):
    top = tmp_path / "requirements.txt"
    base = tmp_path / "requirements_base.txt"
    top.write_text("-r requirements_base.txt\nscipy==1.12.0\n")
    base.write_text("torchao==0.10.0\n")
    assert requirement_files(top) == [top, base]
    before = install_spec(CHANNELS["cuda"], top)
    base.write_text("torchao==0.11.0\n")
    assert install_spec(CHANNELS["cuda"], top) != before


def test_channels_pin_a_whole_trio():
    for channel in CHANNELS.values():
        assert set(channel.versions) in (set(), {"torch", "torchvision", "torchaudio"}), channel.name
    assert CHANNELS["cuda"].versions == {"torch": "2.11.0", "torchvision": "0.26.0", "torchaudio": "2.11.0"}


def test_auto_channel_from_the_tools_on_path():
    from launcher.envs.torchenv import detect_channel

    def which_only(*names):
        return lambda tool: f"/bin/{tool}" if tool in names else None

    assert detect_channel("Linux", which_only("nvidia-smi"))[0] == "cuda"
    assert detect_channel("Linux", which_only("rocminfo"))[0] == "rocm"
    assert detect_channel("Windows", which_only("hipinfo"))[0] == "rocm-windows"
    assert detect_channel("Linux", which_only())[0] == "cuda"


def test_constraints_hold_the_installed_trio_whatever_its_local_label():
    from launcher.envs.torchenv import constraints_text

    text = constraints_text({"torch": "2.11.0+rocm7.1", "torchvision": "0.26.0", "torchaudio": "2.11.0+cu130"})
    assert "torch==2.11.0\n" in text and "torchaudio==2.11.0\n" in text and "+" not in text.split("\n", 1)[1]
