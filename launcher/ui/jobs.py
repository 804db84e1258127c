"""The launcher commands the page starts: `run`, `comfy`, `report`, each a child process.

A child is started from an argument list (no shell) as `python -m launcher ...`, exactly what a user
would type, so it checks, writes and fails as the command does. Its output goes to a log file of
the workdir, not to a pipe: a run outlives the page's server (closing the terminal that serves the
page must not stop three hours of training), and its launcher would die on its first line into a
pipe nobody reads. It also starts in a process group of its own, so Ctrl+C on the server stays there.
"""

import os
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from launcher.nofollow import refuse_links
from launcher.ui.guard import Refused
from launcher.user_files import UserFileError, read_tail_lines
from launcher.writer import open_append

OUTPUT_LINES = 400
DETACHED = ({"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP} if os.name == "nt"
            else {"start_new_session": True})


@dataclass
class Job:
    id: str
    what: str
    command: list[str]
    log: Path
    process: subprocess.Popen


class Jobs:
    """The children this server started, by id; their logs in `folder` (inside the workdir)."""

    def __init__(self, root: Path, folder: Path) -> None:
        self.root = root
        self.folder = folder
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()

    def start(self, what: str, *args: str) -> Job:
        """`python -m launcher ARGS` in the background; its output in a log of its own."""
        command = [sys.executable, "-m", "launcher", *args]
        job_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{what}-{secrets.token_hex(3)}"
        log = self.folder / f"{job_id}.log"
        refuse_links(self.root, self.folder)  # mkdir would follow a link there
        self.folder.mkdir(parents=True, exist_ok=True)
        with open_append(self.root, log) as output:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                       **DETACHED)
        job = Job(job_id, what, command, log, process)
        with self._lock:
            self._jobs[job_id] = job
        return job

    def running(self, what: str) -> list[Job]:
        with self._lock:
            return [job for job in self._jobs.values() if job.what == what and job.process.poll() is None]

    def state(self, job_id: str) -> dict:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            raise Refused(404, f"no job {job_id!r} started by this server")
        code = job.process.poll()
        try:
            output = read_tail_lines(job.log, OUTPUT_LINES, within=self.root)
        except UserFileError as error:
            output = f"({error})"
        return {"id": job.id, "what": job.what, "command": " ".join(job.command[1:]), "done": code is not None,
                "exit_code": code, "output": output}
