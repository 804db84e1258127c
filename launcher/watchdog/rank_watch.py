"""The rank watch of a `run --gpus N` run: a rank that stalls (alive, but not reaching the step's
gradient all-reduce: asleep, stopped, in a loop) holds every other rank waiting in it, and
torchrun only acts on a rank that ends. NCCL or gloo would end a waiting rank after their
collective timeout (10 or 30 minutes) and torchrun would then name that rank, not the stalled one.

Each rank keeps `rank-state.rank<R>.json` in the run folder (overlay toolkit/data_parallel.py):
its pid, how many collectives it has entered, since when it waits in the last, and a heartbeat
its own thread renews every few seconds. A rank's wait counts up to its last heartbeat: a rank
frozen inside the collective stops waiting there, though its file still says it waits. When a rank
has waited past `rank_stall_s` (the preset's `launcher: watchdog:` block) for a collective, the
stalled rank is one whose heartbeat is that old (a process that does not run, wherever it froze),
else one that has not entered the collective (not waiting, or stuck in an earlier one); when every
rank has waited that long alive in the same collective, the collective itself hangs. The watch
says which in one line, with the rank's last step from its trainer telemetry, and kills it, so
torchrun stops the others. The main rank sampling images (its telemetry's open
`sample_start`) keeps the others waiting by design and is not a stall.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from flux2_contract import files
from launcher.progress import warn
from launcher.user_files import last_rows, load_json_state


def rank_file(path: Path, rank: int) -> Path:
    """`rank-state.json` -> `rank-state.rank<R>.json`, `trainer-telemetry.jsonl` -> `...rank<R>.jsonl`;
    the telemetry of rank 0 keeps its plain name (toolkit/trainer_telemetry.py)."""
    return Path(files.rank_file(path, rank))


def telemetry_of(rows: list[dict]) -> tuple[int | None, bool]:
    """(the last step a rank's telemetry reports, whether it is sampling now), from its rows newest first."""
    step = next((row["step"] for row in rows if isinstance(row.get("step"), int)), None)
    event = next((row["event"] for row in rows if row.get("event") in ("sample_start", "sample")), None)
    return step, event == "sample_start"


def _age(state: dict | None, key: str, now: float) -> float | None:
    value = (state or {}).get(key)
    return now - value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _waited_alive(state: dict, now: float) -> float | None:
    """How long a rank has waited in its collective while its heartbeat went on: up to its last
    beat, or up to now where its file has no beat (an older overlay)."""
    since_beat = max(_age(state, "beat", now) or 0.0, 0.0)
    return _age(state, "waiting_since", now - since_beat)


def stalled(states: dict[int, dict | None], telemetry: dict[int, tuple[int | None, bool]], now: float,
            limit: float) -> tuple[int, str] | None:
    """(rank, the line naming it) once a rank has waited `limit` seconds alive in a collective.

    The culprit is, in this order: a rank whose heartbeat is older than `limit` (its process does
    not run: stopped, or hung in a call that holds the interpreter; wherever it froze, inside the
    collective included), then a rank that has not entered the collective and is not sampling.
    When every rank has waited `limit` seconds alive in the same collective, the collective itself
    hangs: the line says so and names the rank that is stopped so that torchrun stops the others.
    A rank that froze while waiting stops counting its wait at its last heartbeat, so its own wait
    never makes the others look hung before its heartbeat is old enough to name it."""
    frozen = [rank for rank in sorted(states) if (_age(states[rank], "beat", now) or 0.0) > limit]
    waits = {rank: (age, states[rank].get("entered") or 0) for rank in states
             if rank not in frozen and (age := _waited_alive(states[rank], now)) is not None}
    if not waits:
        return None
    front = max(entered for _, entered in waits.values())  # the collective the furthest ranks wait in
    waiter = max((rank for rank, (_, entered) in waits.items() if entered == front), key=lambda rank: waits[rank][0])
    if waits[waiter][0] < limit:
        return None
    waited = _age(states[waiter], "waiting_since", now)
    late = [rank for rank in sorted(states) if rank not in frozen and (
        rank not in waits and not telemetry.get(rank, (None, False))[1] or rank in waits and waits[rank][1] < front)]
    if not frozen and not late:
        if len(waits) < len(states):
            return None  # the main rank samples: the others wait by design
        if min(age for age, _ in waits.values()) < limit:
            return None  # a rank stopped waiting alive: its heartbeat will be old enough to name it
        pid = (states.get(waiter) or {}).get("pid")
        return waiter, (f"ranks {', '.join(map(str, sorted(waits)))} have waited {waited:.0f} s in the same gradient "
                        f"all-reduce, each of them running (limit rank_stall_s {limit:.0f} s): the collective itself "
                        f"hangs (the link between the GPUs, or a GPU that never finishes its part); stopping rank "
                        f"{waiter}{f' (pid {pid})' if pid else ''}, torchrun stops the others")
    rank = (frozen or late)[0]
    why = (f", its process has not run for {_age(states[rank], 'beat', now):.0f} s (stopped, or hung in a call that "
           "holds Python)") if frozen else ""
    pid = (states.get(rank) or {}).get("pid")
    step = telemetry.get(rank, (None, False))[0]
    return rank, (f"rank {rank}{f' (pid {pid})' if pid else ''} stalled: rank {waiter} has waited {waited:.0f} s for it "
                  f"in the gradient all-reduce (limit rank_stall_s {limit:.0f} s){why}, its last step "
                  f"{step if step is not None else 'unknown'}; stopping it, torchrun stops the others")


class RankWatch:
    """Polls the ranks' state files; on a stall says the line once and kills the stalled rank."""

    def __init__(self, run_root: Path, telemetry: Path, count: int, limit: float) -> None:
        self.state = Path(run_root) / files.RANK_STATE_FILE
        self.telemetry = Path(telemetry)
        self.count = count
        self.limit = limit
        self.found: str | None = None

    def poll_once(self, now: float) -> str | None:
        states = {rank: load_json_state(rank_file(self.state, rank)) for rank in range(self.count)}
        telemetry = {rank: telemetry_of(last_rows(self.telemetry if rank == 0 else rank_file(self.telemetry, rank)))
                     for rank in range(self.count)}
        found = stalled(states, telemetry, now, self.limit)
        if found is None:
            return None
        rank, self.found = found
        warn(self.found)
        pid = (states.get(rank) or {}).get("pid")
        if isinstance(pid, int):
            try:
                os.kill(pid, getattr(signal, "SIGKILL", signal.SIGTERM))
            except OSError:
                pass  # it ended meanwhile: torchrun names it
        return self.found

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(min(5.0, self.limit / 4)):
            if self.poll_once(time.time()):
                return


@contextmanager
def watch_ranks(run_root: Path, telemetry: Path, count: int, limit: float):
    """The rank watch for the length of the training, on runs of more than one rank."""
    if count < 2:
        yield None
        return
    for old in Path(run_root).glob(f"{Path(files.RANK_STATE_FILE).stem}.rank*{Path(files.RANK_STATE_FILE).suffix}"):
        old.unlink(missing_ok=True)  # an earlier launch's: its pids are not this launch's ranks
    watch = RankWatch(run_root, telemetry, count, limit)
    stop = threading.Event()
    thread = threading.Thread(target=watch.run, args=(stop,), name="rank-watch", daemon=True)
    thread.start()
    try:
        yield watch
    finally:
        stop.set()
        thread.join(10)
