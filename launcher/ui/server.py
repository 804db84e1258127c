"""The page's HTTP server: the run list, a run's figures and files, and the actions of the commands.

Python's own http.server (ThreadingHTTPServer), not a web framework: the page needs a dozen JSON
routes and a few static files on the loopback interface, which the standard library serves; a
framework would be the launcher's largest dependency (its list is deliberately short) for nothing
the page uses. One thread a request, so a slow dry run does not hold up the run list's polling.
Every request passes launcher/ui/guard.py first; what the server answers is JSON, a run's image
(launcher/ui/runs.py) or one of the page's own files, never a shell.
"""

import html
import json
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Callable
from urllib.parse import unquote, urlsplit

from launcher.envs.workdir import Workdir
from launcher.errors import LauncherError, unexpected_error_line
from launcher.nofollow import refuse_links
from launcher.progress import warn
from launcher.ui import new_run, runs
from launcher.ui.guard import Guard, Refused
from launcher.ui.jobs import Jobs

STATIC = Path(__file__).resolve().parent / "static"
STATIC_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8"}
MAX_BODY = 2**20
HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",  # the token is in the page's URL
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
}


@dataclass(frozen=True)
class Commands:
    """What the page does with the terminal commands' own functions, handed in by
    launcher/commands/ui.py (the commands sit above this package, which imports none of them)."""

    flags: dict[str, str]
    """`save` / `stop`: the flag file each writes."""
    write_flag: Callable
    """(arguments with `workdir` and `run`, flag file) -> exit code: what `save` and `stop` run."""
    preset_lines: Callable[[str], list[str]]
    """`presets NAME`: the preset in full, each value with the file that set it."""


class UiServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, workdir: Workdir, commands: Commands, port: int = 0) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        self.workdir = workdir
        self.commands = commands
        self.guard = Guard(self.server_address[1])
        self.jobs = Jobs(workdir.root, workdir.root / "ui" / "jobs")
        self.checked: dict[str, tuple[Path, list[str]]] = {}
        """Presets whose dry run passed, by file name: only these can be started."""
        self.checked_lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.guard.url()


class Handler(BaseHTTPRequestHandler):
    server: UiServer

    def do_GET(self) -> None:
        self.answer("GET")

    def do_POST(self) -> None:
        self.answer("POST")

    def answer(self, method: str) -> None:
        try:
            self.server.guard.check(method, self.path, self.headers)
            path = unquote(urlsplit(self.path).path)
            routes = self.get_routes() if method == "GET" else self.post_routes(self.body())
            for pattern, route in routes:  # `/api/runs/*`: the rest of the path is the route's argument
                prefix = pattern.removesuffix("*")
                if path == pattern or (pattern.endswith("*") and path.startswith(prefix)):
                    return route(path.removeprefix(prefix))
            raise Refused(404, f"no such page: {method} {path}")
        except Refused as refused:
            self.send_json({"error": refused.reason}, refused.status)
        except LauncherError as error:
            self.send_json({"error": str(error)}, HTTPStatus.BAD_REQUEST)
        except Exception as error:  # noqa: BLE001 - a bug is one line on the page, the traceback kept in a file
            self.send_json({"error": unexpected_error_line(error)}, HTTPStatus.INTERNAL_SERVER_ERROR)

    def get_routes(self):
        wd = self.server.workdir
        return (("/", lambda _: self.send_page()),
                ("/static/*", self.send_static),
                ("/api/runs", lambda _: self.send_json([runs.summary(wd.runs, root) for root in runs.runs(wd.runs)])),
                ("/api/runs/*", lambda name: self.send_json(runs.detail(wd.runs, name))),
                ("/files/*", self.send_image),
                ("/api/presets", lambda _: self.send_json(new_run.presets(wd))),
                ("/api/presets/*", lambda name: self.send_json(new_run.describe(wd, name, self.server.commands.preset_lines))),
                ("/api/jobs/*", lambda job: self.send_json(self.server.jobs.state(job))))

    def post_routes(self, body: dict):
        return (("/api/flag/*", lambda command: self.send_json(self.write_flag(command, body))),
                ("/api/command/*", lambda command: self.send_json(self.start_command(command, body))),
                ("/api/check", lambda _: self.send_json(self.check(body))),
                ("/api/start", lambda _: self.send_json(self.start(body))))

    def body(self) -> dict:
        length = self.headers.get("Content-Length") or "0"
        if not length.isdigit() or int(length) > MAX_BODY:
            raise Refused(413, f"a request body is at most {MAX_BODY} bytes")
        try:
            data = json.loads(self.rfile.read(int(length)) or b"{}")
        except ValueError:
            raise Refused(400, "the body is not JSON") from None
        if not isinstance(data, dict):
            raise Refused(400, "the body is not a JSON object")
        return data

    # -- actions ------------------------------------------------------------------------------

    def write_flag(self, command: str, body: dict) -> dict:
        """`save` / `stop`: the same function as the commands, on the run the page names."""
        flags = self.server.commands.flags
        if command not in flags:
            raise Refused(404, f"no flag command {command!r}")
        run = runs.named(self.server.workdir.runs, str(body.get("run")))
        flag = flags[command]
        self.server.commands.write_flag(SimpleNamespace(workdir=self.server.workdir.root, run=str(run.root)), flag)
        return {"message": f"wrote {run.flag(flag)}; the trainer acts on it at its next step"}

    def start_command(self, command: str, body: dict) -> dict:
        """`comfy RUN` or `report` as typed, in the background; the page polls its output."""
        workdir = str(self.server.workdir.root)
        if command == "comfy":
            run = runs.named(self.server.workdir.runs, str(body.get("run")))
            job = self.server.jobs.start("comfy", "comfy", str(run.root), "--workdir", workdir)
        elif command == "report":
            # the stored self-test: a new one would share the GPU with a run that trains
            out = self.server.workdir.root / "ui" / "reports" / f"flux2-report-{time.strftime('%Y%m%d-%H%M%S')}.zip"
            refuse_links(self.server.workdir.root, out.parent)  # mkdir would follow a link there
            out.parent.mkdir(parents=True, exist_ok=True)
            job = self.server.jobs.start("report", "report", "--workdir", workdir, "--no-selftest", "--out", str(out))
        else:
            raise Refused(404, f"no command {command!r}")
        return {"job": job.id}

    def check(self, body: dict) -> dict:
        """The schema on the edited values, then the new preset file and its dry run."""
        form = body.get("values") if isinstance(body.get("values"), dict) else {}
        preset = str(body.get("preset"))
        try:
            path, content = new_run.check(self.server.workdir, preset, form)
        except LauncherError as error:
            return {"ok": False, "error": str(error)}
        new_run.write(self.server.workdir, path, content, preset)
        flags = new_run.place_flags(form)
        result = new_run.dry_run(self.server.workdir, path, flags)
        with self.server.checked_lock:
            if result["ok"]:
                self.server.checked[path.name] = (path, flags)
            else:
                self.server.checked.pop(path.name, None)
        return {**result, "preset_file": str(path), "start": path.name if result["ok"] else None}

    def start(self, body: dict) -> dict:
        with self.server.checked_lock:  # once: a second click would only meet the first run's lock
            checked = self.server.checked.pop(str(body.get("start")), None)
        if checked is None:
            raise Refused(409, "check the settings first: only a preset whose dry run passed can start")
        path, flags = checked
        job = self.server.jobs.start("run", "run", str(path), "--workdir", str(self.server.workdir.root), *flags)
        return {"job": job.id, "command": " ".join(job.command[1:])}

    # -- answers ------------------------------------------------------------------------------

    def send_page(self) -> None:
        page = (STATIC / "index.html").read_text(encoding="utf-8")
        self.send(page.replace("{{token}}", html.escape(self.server.guard.token)).encode("utf-8"), STATIC_TYPES[".html"])

    def send_static(self, name: str) -> None:
        known = {path.name: path for path in STATIC.iterdir() if path.suffix in STATIC_TYPES}
        if name not in known:
            raise Refused(404, f"no static file {name!r}")
        self.send(known[name].read_bytes(), STATIC_TYPES[known[name].suffix])

    def send_image(self, rest: str) -> None:
        name, _, relative = rest.partition("/")
        data, kind = runs.image(self.server.workdir.runs, name, relative)
        self.send(data, kind)

    def send_json(self, data, status: int = HTTPStatus.OK) -> None:
        self.send(json.dumps(data).encode("utf-8"), "application/json; charset=utf-8", status)

    def send(self, data: bytes, kind: str, status: int = HTTPStatus.OK) -> None:
        self.send_response(status)
        for name, value in {**HEADERS, "Content-Type": kind, "Content-Length": str(len(data))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:
        """Only refused and failed requests, without the query (it holds the token)."""
        if len(args) >= 2 and str(args[1])[:1] in "45":
            warn(f"{self.command} {urlsplit(getattr(self, 'path', '')).path}: HTTP {args[1]}")
