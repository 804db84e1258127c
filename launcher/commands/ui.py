"""`ui`: a local web page for the workdir's runs: live figures, samples, log, save/stop, and new runs.

The page is served on 127.0.0.1 only, behind a random token in the URL printed here; it reads the
files `run` writes and acts through the same functions and commands as the terminal
(docs/ui.md). Stop it with Ctrl+C: the runs it started go on.
"""

import argparse
from pathlib import Path

from launcher.commands import flags, presets
from launcher.envs.workdir import DEFAULT_WORKDIR, Workdir
from launcher.errors import LauncherError
from launcher.progress import say
from launcher.ui.server import Commands, UiServer

EXAMPLES = """examples:
  python -m launcher ui                      # prints http://127.0.0.1:8765/?token=...; open it in a browser
  python -m launcher ui --port 0             # any free port
"""
DEFAULT_PORT = 8765


def register(subparsers) -> None:
    parser = subparsers.add_parser("ui", help="a local web page: runs, live plots, samples, save/stop, start a run",
                                   description=__doc__.splitlines()[0], epilog=EXAMPLES,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="default: .aitk")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port on 127.0.0.1 (default: %(default)s; "
                        "0: any free one)")
    parser.set_defaults(handler=handle)


def handle(args) -> int:
    workdir = Workdir(args.workdir.resolve())
    workdir.check_is_folder()
    try:
        server = page_server(workdir, args.port)
    except OSError as error:
        raise LauncherError(f"cannot listen on 127.0.0.1:{args.port} ({error.strerror or error}); another program "
                            "may use the port: pass --port 0 for a free one") from None
    with server:
        say(f"the page for {workdir.root}: {server.url}")
        say("it answers only this machine, and only with the token in that URL; Ctrl+C stops it (runs go on)")
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            say("stopped the page; the runs it started go on (python -m launcher stop RUN stops one)")
    return 0


def page_server(workdir: Workdir, port: int) -> UiServer:
    """The page's server, acting through the `save`, `stop` and `presets` commands' own functions."""
    commands = Commands(flags={command: flag for command, (flag, _) in flags.FLAGS.items()},
                        write_flag=flags.write_flag, preset_lines=presets.shown)
    return UiServer(workdir, commands, port)
