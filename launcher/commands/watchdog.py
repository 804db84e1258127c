"""`watchdog`: replay a trace through the stall watchdog, synthesise a run, or run one burst.

    python -m launcher watchdog replay RUN/watchdog-trace.jsonl --out events.jsonl [--preset P]
    python -m launcher watchdog simulate --out-dir sim [--plot]
    python -m launcher watchdog burst [--seconds 25] [--device cuda]

`replay` is for tuning thresholds on your own logs (a watchdog trace or telemetry rows);
`simulate` writes a synthetic 2000-step run (telemetry, trace, events, train.log, and with
--plot a PNG through the trainer venv); `burst` runs one rescue burst with the trainer's
interpreter and says whether this card would call it a dud.
"""

import argparse
from collections import Counter
from pathlib import Path

from launcher.envs.trainer_python import run_module
from launcher.envs.workdir import DEFAULT_WORKDIR, Workdir, venv_python
from launcher.errors import LauncherError
from launcher.progress import say
from launcher.runs.plotting import plot_with
from launcher.watchdog.loop import SubprocessBurster, parse_burst_output
from launcher.watchdog.policy import WatchdogConfig, load_config
from launcher.watchdog.replay import (
    default_scenario,
    read_jsonl,
    replay,
    simulate,
    trace_items,
    write_jsonl,
)


EXAMPLES = """examples:
  python -m launcher watchdog replay runs/x/watchdog-trace.jsonl --out events.jsonl
  python -m launcher watchdog simulate --out-dir sim --preset 7900xtx_512
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser("watchdog", help="stall watchdog: replay, simulate, burst",
                                   description=__doc__.splitlines()[0],
                                   epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    replay_parser = verbs.add_parser("replay", help="decisions of the watchdog on a recorded trace")
    replay_parser.add_argument("trace", type=Path, help="watchdog-trace.jsonl or telemetry.jsonl")
    replay_parser.add_argument("--out", type=Path, required=True, help="where to write the events JSONL")
    replay_parser.add_argument("--preset", help="take the thresholds from this preset's launcher: watchdog:")
    replay_parser.set_defaults(handler=handle_replay)

    sim = verbs.add_parser("simulate", help="write a synthetic 2000-step run with stalls and its decisions")
    sim.add_argument("--out-dir", type=Path, required=True)
    sim.add_argument("--preset", help="take the thresholds from this preset's launcher: watchdog:")
    sim.add_argument("--plot", action="store_true", help="also draw plot.png with the trainer venv's matplotlib")
    sim.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="for --plot; default: %(default)s")
    sim.set_defaults(handler=handle_simulate)

    burst = verbs.add_parser("burst", help="run one rescue burst with the trainer's interpreter")
    burst.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="default: %(default)s")
    burst.add_argument("--preset", help="take sizes and thresholds from this preset's launcher: watchdog:")
    burst.add_argument("--seconds", type=float)
    burst.add_argument("--device")
    burst.add_argument("--size", type=int, nargs=3, metavar=("M", "K", "N"))
    burst.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"])
    burst.set_defaults(handler=handle_burst)


def config_from(preset: str | None) -> WatchdogConfig:
    if preset is None:
        return load_config({"enabled": True})
    from launcher.runs.presets import load_preset

    return load_config(load_preset(preset).settings.get("watchdog"))


def summary(events: list[dict]) -> str:
    counts = Counter(event["kind"] for event in events)
    return ", ".join(f"{counts[kind]} {kind}" for kind in ("stall", "burst", "dud", "restored", "not_restored",
                                                             "disabled") if counts[kind])


def handle_replay(args) -> int:
    if not args.trace.is_file():
        raise LauncherError(f"no trace at {args.trace}: give a run's watchdog-trace.jsonl or telemetry.jsonl")
    try:
        items = trace_items(read_jsonl(args.trace))
    except (ValueError, KeyError) as error:
        raise LauncherError(f"{args.trace} is not a watchdog trace or telemetry JSONL ({error})") from None
    events = replay(items, config_from(args.preset))
    write_jsonl(events, args.out)
    say(f"{len(items)} inputs -> {len(events)} events ({summary(events) or 'no decisions'}): {args.out}")
    return 0


def handle_simulate(args) -> int:
    result = simulate(default_scenario(), config_from(args.preset))
    paths = result.write(args.out_dir)
    say(f"synthetic run: {summary(result.events)}; files in {args.out_dir}")
    if args.plot:
        python = venv_python(Workdir(args.workdir).venv)
        if not python.is_file():
            raise LauncherError(f"--plot needs the trainer venv ({python}): run `python -m launcher setup` first")
        code = plot_with(python, paths["telemetry"], paths["events"], args.out_dir / "plot.png")
        if code != 0:
            raise LauncherError(f"plotting failed with exit code {code}; see above")
        say(f"plot: {args.out_dir / 'plot.png'}")
    return 0


def handle_burst(args) -> int:
    config = config_from(args.preset)
    overrides = {"burst_s": args.seconds, "burst_device": args.device, "burst_dtype": args.dtype}
    if args.size:
        overrides.update(burst_m=args.size[0], burst_k=args.size[1], burst_n=args.size[2])
    config = WatchdogConfig(**{**config.__dict__, **{k: v for k, v in overrides.items() if v is not None}})
    python = venv_python(Workdir(args.workdir).venv)
    if not python.is_file():
        raise LauncherError(f"no trainer venv at {python}: run `python -m launcher setup` first")
    burster = SubprocessBurster(python, config)
    say(f"burst: {' '.join(burster.command())}")
    done = run_module(python, "burst", *burster.arguments(), capture=True)
    result = parse_burst_output(done.stdout, done.returncode, done.stderr, 0.0)
    print(done.stdout.strip(), flush=True)
    if not result.ok:
        raise LauncherError(f"the burst failed: {result.error}")
    verdict = "a dud" if result.tflops < config.dud_tflops else "good"
    say(f"{result.tflops:.2f} TFLOP/s over {result.seconds:.1f} s: {verdict} (dud below {config.dud_tflops:g})")
    return 0
