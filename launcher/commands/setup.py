"""`setup`: clone the pinned trainer, apply the series, build its Python environment."""

import argparse
from pathlib import Path

from launcher.envs import rocm_windows_install
from launcher.envs.install import install
from launcher.envs.rocm_windows_toolchain import Host, applies, require_build_tools
from launcher.envs.amdgpu import TARGET_CHOICES
from launcher.envs.torchenv import CHANNEL_CHOICES, default_python, install_plan, resolve_channel
from launcher.envs.workdir import DEFAULT_WORKDIR, Workdir, read_state
from launcher.errors import LauncherError
from launcher.patching import checkout, gitops, series
from launcher.patching.lock import find_target
from launcher.progress import say


EXAMPLES = """examples:
  python -m launcher setup                   # .aitk: the default target, its venv, the torch channel detected
  python -m launcher setup --target upstream-main --workdir W --no-install   # only the checkout
  python -m launcher setup --torch-channel rocm-windows --dry-run   # the pins it would install, nothing done
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "setup",
        help="clone the pinned trainer, apply the patch series, install its environment",
        description="Idempotent: an up-to-date workdir is left alone; a drifted one is refused.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="default: .aitk")
    parser.add_argument("--target", help="a target name from upstream.lock (default: the first)")
    parser.add_argument("--torch-channel", default="auto", choices=CHANNEL_CHOICES)
    parser.add_argument("--python", type=Path, default=None,
                        help="interpreter the venv is made from (default: this one)")
    parser.add_argument("--amd-arch", default="auto", choices=TARGET_CHOICES,
                        help="rocm-windows: the GPU target whose kernels are installed "
                             "(default: read from the display adapter name)")
    parser.add_argument("--no-install", action="store_true", help="only the checkout, no venv")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the torch pins, index, Triton pin and (rocm-windows) the ROCm SDK wheels, "
                             "toolchain verdict and GPU pick; change nothing")
    parser.set_defaults(handler=run_setup)


def run_setup(args) -> int:
    if args.dry_run:
        channel = resolve_channel(args.torch_channel, args.amd_arch)
        lines = rocm_windows_install.plan_lines(channel, Host.this())
        print(install_plan(channel) + "".join(f"{line}\n" for line in lines), end="", flush=True)
        return 0
    gitops.require_git()
    workdir = Workdir(args.workdir.resolve())
    workdir.check_contained()
    target = find_target(args.target, args.lock)
    patches = series.load_checked(target.series)
    state = read_state(workdir.state_file)
    if state and state.get("target") != target.name:
        raise LauncherError(
            f"{workdir.root} was set up for target {state.get('target')!r}, not {target.name!r}. "
            "Use another --workdir for this target."
        )
    channel = None if args.no_install else resolve_channel(args.torch_channel, args.amd_arch)
    check_toolchain(channel, Host.this())
    if _has_checkout(workdir):
        drift = checkout.problems(workdir.trainer, target, patches)
        if drift:
            raise LauncherError(
                f"{workdir.trainer} differs from upstream.lock + {target.series.name}:\n  - "
                + "\n  - ".join(drift)
                + "\nNothing was changed. Keep any edits you want (git -C "
                f"{workdir.trainer} diff > my.patch), then move the folder aside or remove it "
                "and run setup again, or choose another --workdir."
            )
        say(f"{workdir.trainer} is up to date: {target.commit[:12]} + {len(patches)} patches")
        expected = checkout.expected_state(target, patches, checkout.head(workdir.trainer))
        if state != expected:
            checkout.write_state(workdir.state_file, expected)
            say(f"rewrote {workdir.state_file}, which was missing or incomplete")
    else:
        workdir.root.mkdir(parents=True, exist_ok=True)
        repo = checkout.build(target, patches, workdir.trainer)
        checkout.write_state(workdir.state_file, checkout.expected_state(target, patches, repo.head.commit.hexsha))
        say(f"checkout ready: {workdir.trainer} (branch {checkout.BRANCH})")
    if channel is not None:
        install(workdir, channel, args.python or default_python(), target.requirements)
    return 0


def check_toolchain(channel, host: Host) -> None:
    """Windows ROCm: refuse before anything is downloaded when Triton's clang-cl would find no C headers."""
    if channel is not None and applies(channel) and host.system == "Windows":
        say(require_build_tools(host))


def _has_checkout(workdir: Workdir) -> bool:
    return workdir.trainer.exists() and any(workdir.trainer.iterdir())
