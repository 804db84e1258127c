"""Windows ROCm: the toolchain checks, the ROCm SDK wheels, the GPU pick and the trainer's environment,
decided on simulated Windows hosts (the host's files, variables and tools are injected)."""

import json
import os
from pathlib import Path, PureWindowsPath

import pytest

from launcher.cli import main
from launcher.checkup import known_problems
from launcher.envs import install as install_module
from launcher.envs import rocm_windows_install
from launcher.envs import rocm_windows_toolchain as toolchain
from launcher.envs.amdgpu import pick_target
from launcher.envs.torchenv import CHANNELS, resolve_channel
from launcher.envs.trainer_python import child_env
from launcher.envs.workdir import Workdir
from launcher.errors import LauncherError

KITS = r"C:\Program Files (x86)\Windows Kits\10"
VS = r"C:\Program Files (x86)\Microsoft Visual Studio\2022\BuildTools"
VSWHERE = r"C:\Program Files (x86)\Microsoft Visual Studio\Installer\vswhere.exe"
MSVC_FILES = {VSWHERE, VS + r"\VC\Tools\MSVC\14.44.35207\include\vcruntime.h",
              VS + r"\VC\Tools\MSVC\14.44.35207\lib\x64\vcruntime.lib"}
SDK_FILES = {KITS + r"\Include\10.0.26100.0\ucrt\stdlib.h", KITS + r"\Lib\10.0.26100.0\ucrt\x64\ucrt.lib"}
ROCM_WINDOWS = resolve_channel("rocm-windows", "gfx1100")


def windows(files=frozenset(), environ=None, vswhere_out=VS + "\n") -> toolchain.Host:
    """A Windows host holding `files` (folders are implied by them); vswhere prints `vswhere_out`."""
    files = {str(PureWindowsPath(name)).lower() for name in files}

    def exists(path: PureWindowsPath) -> bool:
        key = str(path).lower()
        return key in files or any(name.startswith(key + "\\") for name in files)

    def listdir(folder: PureWindowsPath) -> list[str]:
        prefix = str(folder).lower() + "\\"
        return sorted({name[len(prefix):].split("\\")[0] for name in files if name.startswith(prefix)})

    def run(command):
        return (0, vswhere_out) if command[0].lower() == VSWHERE.lower() else (1, "")

    return toolchain.Host("Windows", environ or {}, exists, listdir, run)


# --------------------------------------------------------------------------- MSVC and Windows SDK headers


def test_build_tools_found_through_vswhere_and_windows_kits():
    ok, line = toolchain.build_tools_verdict(windows(MSVC_FILES | SDK_FILES))
    assert ok and "14.44.35207" in line and r"10.0.26100.0\ucrt" in line


@pytest.mark.parametrize("files, missing", [(MSVC_FILES, "ucrt\\stdlib.h"), (SDK_FILES, "MSVC (vcruntime.h)"),
                                            (frozenset(), "MSVC (vcruntime.h) and the Windows SDK")])
def test_missing_headers_refuse_in_one_line_naming_the_install_command(files, missing):
    with pytest.raises(LauncherError) as error:
        toolchain.require_build_tools(windows(files))
    message = str(error.value)
    assert missing in message and toolchain.BUILD_TOOLS_INSTALL in message and "\n" not in message


def test_a_developer_prompt_is_enough_without_vswhere():
    tools = r"C:\VS\VC\Tools\MSVC\14.40.0"
    files = {tools + r"\include\vcruntime.h", tools + r"\lib\x64\vcruntime.lib",
             r"D:\Kits\Include\10.0.22621.0\ucrt\stdlib.h", r"D:\Kits\Lib\10.0.22621.0\ucrt\x64\ucrt.lib"}
    environ = {"VCINSTALLDIR": "C:\\VS\\VC\\", "VCToolsVersion": "14.40.0",
               "WindowsSdkDir": "D:\\Kits\\", "WindowsSDKVersion": "10.0.22621.0\\"}
    assert toolchain.build_tools_verdict(windows(files, environ))[0]
    assert not toolchain.build_tools_verdict(windows(files))[0]  # the same files, no prompt: not found


def test_an_incomplete_newer_sdk_falls_back_to_a_complete_older_one():
    files = SDK_FILES | {KITS + r"\Include\10.0.28000.0\ucrt\stdlib.h"}  # no ucrt.lib for 28000
    assert toolchain.find_ucrt_include(windows(files)) == PureWindowsPath(KITS, "Include", "10.0.26100.0", "ucrt")


def test_setup_refuses_before_anything_is_downloaded(tmp_path, monkeypatch, capsys):
    from launcher.commands import setup

    monkeypatch.setattr(setup.Host, "this", classmethod(lambda cls: windows(MSVC_FILES)))
    monkeypatch.setattr(setup.checkout, "build", lambda *a: pytest.fail("the checkout started"))
    code = main(["setup", "--torch-channel", "rocm-windows", "--amd-arch", "gfx1100", "--workdir", str(tmp_path / "w")])
    assert code == 2 and "winget install" in capsys.readouterr().err
    assert not (tmp_path / "w" / "trainer").exists()


def test_only_windows_rocm_is_checked():
    from launcher.commands.setup import check_toolchain

    check_toolchain(CHANNELS["cuda"], windows())  # no headers, but no ROCm either
    check_toolchain(ROCM_WINDOWS, toolchain.Host("Linux", {}, lambda p: False, lambda p: [], lambda c: (1, "")))
    with pytest.raises(LauncherError):
        check_toolchain(ROCM_WINDOWS, windows())


# --------------------------------------------------------------------------- ROCm SDK wheels


def test_the_sdk_follows_the_torch_builds_rocm():
    assert toolchain.sdk_install_args(ROCM_WINDOWS) == ["rocm[libraries,devel]==10.0.0"]
    assert toolchain.sdk_install_args(CHANNELS["cuda"]) == []


@pytest.mark.parametrize("status, out", [(0, "rocm-sdk-devel (7.2.1)\nAvailable versions: 7.2.1, 7.1.0\n"),
                                         (1, "ERROR: No matching distribution found for rocm-sdk-devel\n")])
def test_a_missing_sdk_wheel_is_one_line(status, out):
    def run(command):
        return (0, "rocm (10.0.0)\nAvailable versions: 10.0.0, 7.2.1\n") if command[5] == "rocm" else (status, out)

    with pytest.raises(LauncherError) as error:
        toolchain.check_sdk_served(Path("python"), ROCM_WINDOWS, run)
    message = str(error.value)
    assert "rocm-sdk-devel 10.0.0" in message and ROCM_WINDOWS.index_url in message and "Nothing was installed" in message
    assert "\n" not in message


def test_install_checks_the_index_then_installs_the_sdk_with_the_trio(tmp_path, monkeypatch):
    workdir, events = fake_venv(tmp_path, monkeypatch)
    install_module.install(workdir, ROCM_WINDOWS, Path("python3"), "requirements.txt")
    assert [event[0] for event in events] == ["index", "pip", "pip", "pip", "finish"]
    assert "rocm[libraries,devel]==10.0.0" in events[1][1] and "torch[device-gfx1100]==2.13.0+rocm10.0.0" in events[1][1]
    assert (workdir.venv / install_module.MARKER).is_file()


def test_a_missing_sdk_wheel_stops_the_install_before_pip(tmp_path, monkeypatch):
    workdir, events = fake_venv(tmp_path, monkeypatch, served=False)
    with pytest.raises(LauncherError):
        install_module.install(workdir, ROCM_WINDOWS, Path("python3"), "requirements.txt")
    assert [event[0] for event in events] == ["index"] and not (workdir.venv / install_module.MARKER).exists()


def fake_venv(tmp_path, monkeypatch, served=True):
    """A workdir whose venv interpreter exists; pip, the index check and the post-install steps recorded."""
    workdir = Workdir(tmp_path)
    (workdir.trainer).mkdir()
    (workdir.trainer / "requirements.txt").write_text("einops\n")
    python = install_module.venv_python(workdir.venv)
    python.parent.mkdir(parents=True)
    python.write_text("")
    events = []

    def index(python_, channel, run=None):
        events.append(("index",))
        if not served:
            raise LauncherError("no sdk")

    pins = {**ROCM_WINDOWS.versions, **ROCM_WINDOWS.triton}
    monkeypatch.setattr(toolchain, "check_sdk_served", index)
    monkeypatch.setattr(install_module, "_pip", lambda python_, args, unserved=None: events.append(("pip", args)))
    monkeypatch.setattr(install_module, "_check_triton_amd", lambda *a: None)
    monkeypatch.setattr(install_module, "installed_versions", lambda python_, names=(): dict(pins))
    monkeypatch.setattr(rocm_windows_install, "finish_install", lambda *a: events.append(("finish",)))
    return workdir, events


# --------------------------------------------------------------------------- the GPU pick


IGPU = toolchain.Gpu(0, "AMD Radeon(TM) Graphics", "gfx1036", 0.5)
XTX = toolchain.Gpu(1, "AMD Radeon RX 7900 XTX", "gfx1100:sramecc-:xnack-", 24.0)


def test_the_integrated_gpu_at_device_0_is_hidden():
    pick = toolchain.pick_device([IGPU, XTX], "gfx1100", {})
    assert pick.env == {"HIP_VISIBLE_DEVICES": "1"}
    assert "RX 7900 XTX" in pick.line and "integrated" in pick.line and "\n" not in pick.line


@pytest.mark.parametrize("variable", toolchain.USER_DEVICE_VARIABLES)
def test_a_visible_devices_variable_the_user_set_is_kept(variable):
    pick = toolchain.pick_device([IGPU, XTX], "gfx1100", {variable: "1"})
    assert pick.env == {} and f"{variable}=1" in pick.line


def test_one_discrete_gpu_needs_no_variable():
    assert toolchain.pick_device([XTX], "gfx1100", {}).env == {}


def test_a_second_discrete_card_is_hidden_and_named():
    other = toolchain.Gpu(0, "AMD Radeon RX 6600", "gfx1032", 8.0)
    pick = toolchain.pick_device([other, XTX], "gfx1100", {})
    assert pick.env == {"HIP_VISIBLE_DEVICES": "1"} and "RX 6600" in pick.line


def test_kernels_for_another_card_are_refused_with_the_right_arch():
    with pytest.raises(LauncherError) as error:
        toolchain.pick_device([IGPU, toolchain.Gpu(1, "AMD Radeon RX 7800 XT", "gfx1101", 16.0)], "gfx1100", {})
    assert "--amd-arch gfx1101" in str(error.value)


def test_only_an_integrated_gpu_gets_a_line_and_no_variable():
    pick = toolchain.pick_device([IGPU], "gfx1100", {})
    assert pick.env == {} and "only integrated" in pick.line


def test_a_wrong_amd_arch_is_refused_before_the_download():
    with pytest.raises(LauncherError) as error:
        pick_target("gfx1101", ["AMD Radeon(TM) Graphics", "AMD Radeon RX 7900 XTX"])
    assert "AMD Radeon RX 7900 XTX is gfx1100" in str(error.value) and "--amd-arch gfx1100" in str(error.value)
    target, reason = pick_target("auto", ["AMD Radeon RX 7900 XTX", "AMD Radeon RX 7600"])
    assert target == "gfx1100" and "RX 7600 (gfx1102) gets no kernels" in reason


# --------------------------------------------------------------------------- after the install


SDK_ROOT = r"C:\w\venv\Lib\site-packages\_rocm_sdk_devel"
SDK_CORE = r"C:\w\venv\Lib\site-packages\_rocm_sdk_core"
SDK_PATHS = {"root": SDK_ROOT, "core": SDK_CORE, "scripts": r"C:\w\venv\Scripts"}


def after_install(tmp_path, monkeypatch, devices, compiled, init_ok=True, environ=None):
    """finish_install on a simulated host: the SDK CLI's answers and the in-venv probes are given."""
    def checked(command, what):
        if "init" in command and not init_ok:
            raise LauncherError("rocm-sdk init failed in the trainer venv (disk full)")
        return json.dumps(SDK_PATHS)

    def probe(python, mode, env):
        probes.append((mode, env))
        return devices if mode == "devices" else compiled

    probes = []
    monkeypatch.setattr(rocm_windows_install, "_checked", checked)
    monkeypatch.setattr(rocm_windows_install, "_probe", probe)
    host = windows({SDK_CORE + r"\lib\llvm\bin\clang-cl.exe"}, environ=environ or {"PATH": "C:\\Windows"})
    rocm_windows_install.finish_install(tmp_path, Path("python"), ROCM_WINDOWS, host)
    return probes


def test_the_environment_is_stored_with_the_pick_and_the_compile_ran_with_it(tmp_path, monkeypatch, capsys):
    devices = {"gpus": [IGPU.__dict__, XTX.__dict__]}
    probes = after_install(tmp_path, monkeypatch, devices, {"triton": "3.7.1", "device": "RX 7900 XTX"})
    stored = toolchain.stored_env(tmp_path)
    clang = SDK_CORE + r"\lib\llvm\bin\clang-cl.exe"
    assert stored["variables"] == {"ROCM_HOME": SDK_ROOT, "HIP_PATH": SDK_ROOT, "CC": clang, "CXX": clang,
                                   "DISTUTILS_USE_SDK": "1", "HIP_VISIBLE_DEVICES": "1"}
    assert stored["path_prepend"] == [r"C:\w\venv\Scripts", SDK_ROOT + r"\bin", SDK_CORE + r"\lib\llvm\bin"]
    assert probes[1][0] == "compile" and probes[1][1]["HIP_VISIBLE_DEVICES"] == "1" and probes[1][1]["CC"] == clang
    assert "compiled and ran a kernel" in capsys.readouterr().out


def test_a_triton_that_cannot_compile_says_why_in_one_line(tmp_path, monkeypatch, capsys):
    error = r"C:\x\hip_runtime.h(33,10): fatal error: 'stdlib.h' file not found"
    after_install(tmp_path, monkeypatch, {"gpus": [XTX.__dict__]}, {"error": error})
    line = next(line for line in capsys.readouterr().out.splitlines() if "cannot compile" in line)
    assert "'stdlib.h' file not found" in line and "uint4" in line
    assert (tmp_path / toolchain.ENV_FILE).is_file()  # training still runs, uncompiled


def test_a_failed_init_leaves_no_environment(tmp_path, monkeypatch):
    with pytest.raises(LauncherError):
        after_install(tmp_path, monkeypatch, {"gpus": []}, {}, init_ok=False)
    assert not (tmp_path / toolchain.ENV_FILE).exists()


def test_first_cause_prefers_the_compilers_error():
    lines = ["In file included from x.c:2:", "x.h(33,10): fatal error: 'stdlib.h' file not found",
             "subprocess.CalledProcessError: Command '...' returned non-zero exit status 1."]
    assert "stdlib.h" in rocm_windows_install._first_cause(lines)
    assert rocm_windows_install._first_cause(["Traceback", "RuntimeError: boom"]) == "RuntimeError: boom"


def test_other_channels_drop_a_stale_environment(tmp_path):
    toolchain.write_stored_env(tmp_path, {"variables": {"CC": "x"}})
    rocm_windows_install.finish_install(tmp_path, Path("python"), CHANNELS["cuda"])
    assert not (tmp_path / toolchain.ENV_FILE).exists()


# --------------------------------------------------------------------------- every trainer process gets it


def test_trainer_processes_get_the_stored_toolchain_and_the_users_device_choice_wins(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    toolchain.write_stored_env(venv, {"variables": {"CC": "clang-cl.exe", "HIP_VISIBLE_DEVICES": "1"},
                                      "path_prepend": ["S", "B"]})
    monkeypatch.setenv("PATH", "P")
    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    env = child_env({"EXTRA": "1"}, venv / "bin" / "python")
    assert env["CC"] == "clang-cl.exe" and env["HIP_VISIBLE_DEVICES"] == "1" and env["EXTRA"] == "1"
    assert env["PATH"] == os.pathsep.join(["S", "B", "P"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert "HIP_VISIBLE_DEVICES" not in child_env(None, venv / "bin" / "python")
    assert "CC" not in child_env(None, tmp_path / "other" / "bin" / "python")


def test_run_adds_the_toolchain_before_the_presets_own_env(tmp_path):
    from types import SimpleNamespace

    from launcher.decision import env_changes

    workdir = Workdir(tmp_path)
    toolchain.write_stored_env(workdir.venv, {"variables": {"CC": "clang-cl.exe", "ROCM_HOME": "R"}})
    preset = SimpleNamespace(telemetry={"interval_s": 5}, allocator="default", env={"ROCM_HOME": "mine"})
    changes = env_changes(preset, workdir)
    assert changes["CC"] == "clang-cl.exe" and changes["ROCM_HOME"] == "mine"


# --------------------------------------------------------------------------- doctor


def doctor_report(facts, gpus=()):
    return {"platform": {"system": "Windows"}, "torch": {"torch": "2.13.0", "hip": "7.15", "gpu_available": True,
                                                         "gpus": list(gpus)},
            "allocator": {}, "free_disk_gib": 500.0, "workdir": "w", "memory_gib": {"ram_total": 64, "swap_total": 32},
            "selftest": {"stale": None}, "rocm_windows": facts}


def test_doctor_has_one_line_with_its_fix_per_pitfall(tmp_path):
    site = tmp_path / "Lib" / "site-packages"
    site.mkdir(parents=True)
    (site / "preload.pth").write_text("import triton\n")
    facts = toolchain.doctor_facts(tmp_path, windows())
    problems = known_problems(doctor_report(facts, [{"name": "AMD Radeon(TM) Graphics", "arch": "gfx1036"}]))
    assert any("winget install" in p for p in problems)
    assert any(toolchain.ENV_FILE in p and "setup" in p for p in problems)
    assert any("preload.pth" in p and "remove that line" in p for p in problems)
    assert any("integrated GPU AMD Radeon(TM) Graphics" in p and "HIP_VISIBLE_DEVICES" in p for p in problems)
    assert all("\n" not in p for p in problems)


def test_doctor_is_quiet_on_a_good_windows_rocm_install(tmp_path):
    clang = SDK_CORE + r"\lib\llvm\bin\clang-cl.exe"
    toolchain.write_stored_env(tmp_path, {"variables": {"ROCM_HOME": SDK_ROOT, "CC": clang}, "path_prepend": [SDK_ROOT]})
    facts = toolchain.doctor_facts(tmp_path, windows(MSVC_FILES | SDK_FILES | {clang, SDK_ROOT + r"\include\hip.h"}))
    assert facts["missing_folders"] == []
    problems = known_problems(doctor_report(facts, [{"name": "RX 7900 XTX", "arch": "gfx1100"}]))
    assert not any("winget" in p or "toolchain" in p or "integrated" in p or "triton" in p for p in problems), problems
