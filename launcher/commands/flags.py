"""`save [RUN]` and `stop [RUN]`: ask a running trainer to checkpoint (and stop) at its next step.

The train loop looks for SAVE_NOW / STOP_NOW in its job folder at every step (a patch of the
series); these commands only create the file, so they work from any terminal.
"""

import argparse
from pathlib import Path

from flux2_contract.files import SAVE_NOW, STOP_NOW
from launcher.envs.workdir import DEFAULT_WORKDIR, Workdir
from launcher.nofollow import refuse_links
from launcher.progress import say
from launcher.runs.folders import find_run
from launcher.writer import touch

FLAGS = {
    "save": (SAVE_NOW, "save a checkpoint at the next step and keep training"),
    "stop": (STOP_NOW, "save a checkpoint at the next step and exit cleanly (resume with run --resume)"),
}


EXAMPLES = """examples:
  python -m launcher save                    # the latest run saves a checkpoint and goes on
  python -m launcher stop my-run             # that run saves and exits
"""


def register(subparsers) -> None:
    for command, (flag, meaning) in FLAGS.items():
        parser = subparsers.add_parser(command, help=meaning, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("run", nargs="?", help="run folder or run name (default: the latest run)")
        parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="default: .aitk")
        parser.set_defaults(handler=lambda args, flag=flag: write_flag(args, flag))


def write_flag(args, flag: str) -> int:
    run = find_run(Workdir(args.workdir.resolve()).runs, args.run)
    path = run.flag(flag)
    refuse_links(run.root, path.parent)  # a linked job folder: mkdir would follow it
    run.refuse_job_file()
    path.parent.mkdir(exist_ok=True)
    touch(run.root, path)
    say(f"wrote {path}; the trainer acts on it at its next step (see {run.log})")
    return 0
