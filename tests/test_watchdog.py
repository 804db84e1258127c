"""The stall detector and burst policy on replayed and simulated traces, with a fake clock.

Pure logic: no torch, no sleeping. The simulated runs drive the real watchdog loop (log lines
through the StepTracker, GPU samples, burst results) against launcher.watchdog.replay's card.
"""

import sys
from pathlib import Path

import pytest

from launcher.envs import trainer_python
from launcher.envs.workdir import venv_python
from launcher.errors import LauncherError
from launcher.signals.gpu_sources import GpuSample
from launcher.signals.trainer_log import (
    LogFollower,
    Progress,
    Saved,
    StepTracker,
    parse_elapsed,
)
from launcher.watchdog.loop import SubprocessBurster, parse_burst_output
from launcher.watchdog.policy import (
    XTX_SATURATED,
    BurstResult,
    Policy,
    load_config,
    stall_signature,
)
from launcher.watchdog.replay import (
    Episode,
    Scenario,
    default_scenario,
    replay,
    simulate,
    trace_items,
)

FIXTURES = Path(__file__).parent / "fixtures" / "watchdog"
CONFIG = load_config({"enabled": True})


def kinds(events, *wanted):
    return [event["kind"] for event in events if not wanted or event["kind"] in wanted]


def bursts(events):
    return [event for event in events if event["kind"] == "burst"]


def quiet(**overrides) -> dict:
    """A config block without prophylactic bursts, to look at one behaviour at a time."""
    return {"enabled": True, "prophylactic_after_start_s": None, "prophylactic_after_save_s": None, **overrides}


# --- thresholds ---------------------------------------------------------------------------------

@pytest.mark.parametrize("clock, power, mem, stalled", [
    (3100, 240, 4, True),     # docs/recipe.md stalled: ~3100 MHz, 220-260 W, 2-7 %
    (3050, 260, 7, True),
    (2500, 385, 35, False),   # saturated: ~2500 MHz, ~385 W, 23-52 %
    (2520, 380, 23, False),
    (3100, 385, 35, False),   # a high clock alone is not the stall
    (700, 70, 1, False),      # idle (a checkpoint save): low clock
])
def test_signature_on_the_recipe_numbers(clock, power, mem, stalled):
    sample = GpuSample(t=0, clock_mhz=clock, power_w=power, mem_load=mem)
    assert stall_signature(sample, XTX_SATURATED, CONFIG) is stalled


def test_signature_needs_all_three_fields():
    assert stall_signature(GpuSample(t=0, gpu_util=99, vram_used_mb=20000), XTX_SATURATED, CONFIG) is None


def test_defaults_are_the_recipe_numbers():
    config = load_config(None)
    assert (config.samples, config.burst_s, config.dud_tflops) == (2, 25.0, 11.0)
    assert (config.burst_m, config.burst_k, config.burst_n) == (6144, 6144, 18432)
    assert config.prophylactic_after_start_s == config.prophylactic_after_save_s == 60.0
    assert config.baseline == XTX_SATURATED and config.enabled is False


def test_config_errors_say_how_to_fix_them():
    with pytest.raises(LauncherError, match="did you mean `cooldown_s`"):
        load_config({"cooldown": 30})
    with pytest.raises(LauncherError, match="baseline needs power_w"):
        load_config({"baseline": {"clock_mhz": 2500, "mem_load": 30}})
    assert load_config({"baseline": None}).baseline is None


# --- the trainer's progress ---------------------------------------------------------------------

def test_step_tracker_on_the_real_tqdm_bar():
    tracker = StepTracker()
    items = tracker.feed((FIXTURES / "train_log_tqdm.txt").read_text(encoding="utf-8"), t=100.0)
    progress = [item for item in items if isinstance(item, Progress)]
    assert [item.step for item in progress] == [1, 2, 3, 4, 5, 6, 7]
    # measured from the bar's elapsed field (whole seconds), not tqdm's smoothed rate
    assert [item.s_it for item in progress] == [21.0, 9.0, 10.0, 48.0, 10.0, 10.0, 9.0]
    assert progress[0].loss == pytest.approx(0.5123) and progress[-1].loss == pytest.approx(0.42)
    assert [item.step for item in items if isinstance(item, Saved)] == [5]
    assert tracker.last == progress[-1]


def test_step_tracker_resume_and_rates():
    tracker = StepTracker()
    assert tracker.feed("\rjob:  25%|##  | 500/2000 [00:00<?, ?it/s]", 1.0) == [Progress(1.0, 500, None)]
    assert tracker.feed("\rjob:  25%|##  | 500/2000 [00:05<?, ?it/s, lr: 1e-4]", 2.0) == []
    # a redraw of the same step keeps the time that step finished at
    assert tracker.feed("\rjob:  25%|##  | 501/2000 [00:12<5:00:00, 12.00s/it]", 3.0)[0].s_it == 12.0
    assert tracker.feed("\rjob:  25%|##  | 503/2000 [00:31<5:00:00, 11.00s/it]", 4.0)[0].s_it == 9.5
    fast = StepTracker().feed("\rjob:  1%| | 20/2000 [00:04<00:10, 4.00it/s, loss: nan]", 4.0)[0]
    assert fast.s_it == 0.25 and fast.loss != fast.loss  # nan
    assert parse_elapsed("30:01:38") == 30 * 3600 + 98 and parse_elapsed("01:05") == 65


def test_log_follower_reads_whole_segments(tmp_path):
    log = tmp_path / "train.log"
    log.write_bytes(b"loading\n\rbar 1/2000 [00:09<")
    follower = LogFollower(log)
    assert follower.read_new() == ["loading"]
    with log.open("ab") as out:
        out.write(b"?, 9.00s/it]\r\xffbar 2")
    assert follower.read_new() == ["bar 1/2000 [00:09<?, 9.00s/it]"]
    with log.open("ab") as out:
        out.write(b"/2000\n")
    assert follower.read_new() == ["\ufffdbar 2/2000"]
    log.write_bytes(b"new run\n")  # truncated and rewritten
    assert follower.read_new() == ["new run"]
    assert LogFollower(tmp_path / "missing.log").read_new() == []


# --- the policy on simulated runs ---------------------------------------------------------------

def test_a_stall_that_clears_after_one_burst():
    run = simulate(Scenario(steps=200, save_every=1000, episodes=(Episode(100, s_it=60.0),)), load_config(quiet()))
    assert kinds(run.events, "stall", "burst", "burst_done", "restored") == ["stall", "burst", "burst_done", "restored"]
    stall, burst = run.events[kinds(run.events).index("stall")], bursts(run.events)[0]
    assert burst["trigger"] == "stall" and burst["t"] == stall["t"] and stall["step"] == 100
    assert stall["power_w"] <= 260 and stall["clock_mhz"] > 3000 and stall["mem_load"] <= 7
    # the signature must hold for 2 samples: the stall started within the 2 intervals before
    started = min(row["t"] for row in run.trace if row["kind"] == "gpu" and row["power_w"] < 300)
    assert stall["t"] - started == CONFIG.interval_s
    assert "disabled" not in kinds(run.events)


def test_a_stall_that_persists_disables_the_watchdog():
    config = load_config(quiet())
    run = simulate(Scenario(steps=160, save_every=1000, episodes=(Episode(100, "persists", s_it=50.0),)), config)
    assert kinds(run.events, "not_restored").count("not_restored") == config.max_failed_bursts
    disabled = [event for event in run.events if event["kind"] == "disabled"]
    assert len(disabled) == 1 and "3 bursts in a row did not restore" in disabled[0]["reason"]
    assert all(burst["t"] < disabled[0]["t"] for burst in bursts(run.events))
    assert len(bursts(run.events)) == config.max_failed_bursts


def test_cooldown_between_bursts_is_respected():
    config = load_config(quiet(cooldown_s=90))
    run = simulate(Scenario(steps=160, save_every=1000, episodes=(Episode(100, "persists", s_it=50.0),)), config)
    ends = [event["t"] for event in run.events if event["kind"] in ("burst_done", "dud")]
    starts = [event["t"] for event in bursts(run.events)]
    assert len(starts) == 3
    for end, start in zip(ends, starts[1:]):
        assert start - end >= 90
    holds = [event for event in run.events if event["kind"] == "hold"]
    assert holds and all("cooldown" in event["reason"] for event in holds)


def test_a_dud_burst_is_respawned_at_once():
    run = simulate(Scenario(steps=200, save_every=1000, episodes=(Episode(100, s_it=60.0, duds=1),)),
                   load_config(quiet()))
    sequence = kinds(run.events, "burst", "dud", "burst_done", "restored")
    assert sequence == ["burst", "dud", "burst", "burst_done", "restored"]
    dud = next(event for event in run.events if event["kind"] == "dud")
    respawn = bursts(run.events)[1]
    assert dud["tflops"] < 11 and respawn["t"] == dud["t"] and respawn["trigger"] == "respawn"


def test_duds_only_count_as_a_failed_burst():
    config = load_config(quiet(max_respawns=2))
    run = simulate(Scenario(steps=200, save_every=1000, episodes=(Episode(100, s_it=60.0, duds=3),)), config)
    sequence = kinds(run.events, "burst", "dud", "not_restored", "burst_done", "restored")
    assert sequence[:7] == ["burst", "dud", "burst", "dud", "burst", "dud", "not_restored"]
    assert sequence[7:] == ["burst", "burst_done", "restored"]


def test_prophylactic_burst_after_each_save():
    config = load_config({"enabled": True, "prophylactic_after_start_s": None})
    run = simulate(Scenario(steps=160, save_every=50, save_s=15.0), config)
    saves = [row["t"] for row in run.trace if row["kind"] == "save"]
    prophylactic = [event for event in bursts(run.events) if event["trigger"] == "prophylactic-save"]
    assert len(saves) == len(prophylactic) == 3
    for saved, burst in zip(saves, prophylactic):
        assert 60 <= burst["t"] - saved < 60 + config.interval_s
    assert kinds(run.events, "stall") == []


def test_prophylactic_burst_after_start():
    run = simulate(Scenario(steps=30, save_every=1000), CONFIG)
    first_step = next(row["t"] for row in run.trace if row["kind"] == "progress")
    (burst,) = bursts(run.events)
    assert burst["trigger"] == "prophylactic-start" and 60 <= burst["t"] - first_step < 70


def test_a_stall_burst_makes_the_prophylactic_one_redundant():
    run = simulate(Scenario(steps=120, save_every=50, episodes=(Episode(50, s_it=60.0),)),
                   load_config({"enabled": True, "prophylactic_after_start_s": None}))
    triggers = [burst["trigger"] for burst in bursts(run.events)]
    assert triggers[0] == "stall" and "skip" in kinds(run.events)


def test_the_2000_step_trace_has_every_decision_and_replays_exactly():
    run = simulate(default_scenario(), CONFIG)
    seen = set(kinds(run.events))
    assert {"baseline", "stall", "burst", "burst_done", "dud", "restored", "not_restored", "hold", "skip",
            "disabled"} <= seen
    assert {burst["trigger"] for burst in bursts(run.events)} == {
        "stall", "prophylactic-start", "prophylactic-save", "respawn"}
    assert run.telemetry[-1]["step"] == 2000 and all("power_w" in row for row in run.telemetry)
    assert replay(trace_items(run.trace), CONFIG) == run.events


def test_replay_of_telemetry_rows_without_burst_results_assumes_good_bursts():
    rows = []
    for i in range(40):
        stalled = 20 <= i < 30
        rows.append({"t": 10.0 * i, "step": i, "s_it": 60.0 if stalled else 9.5,
                     "clock_mhz": 3100 if stalled else 2500, "power_w": 240 if stalled else 385,
                     "mem_load": 4 if stalled else 35})
    events = replay(trace_items(rows), load_config(quiet()))
    # the recorded stall goes on after the assumed burst: a static trace cannot react
    assert kinds(events, "stall", "burst", "burst_done")[:3] == ["stall", "burst", "burst_done"]
    assert next(e for e in events if e["kind"] == "burst_done")["tflops"] == 70.0


def test_learnt_baseline_from_the_run_when_the_preset_gives_none():
    config = load_config(quiet(baseline=None))
    run = simulate(Scenario(steps=200, save_every=1000, episodes=(Episode(100, s_it=60.0),)), config)
    baseline = next(event for event in run.events if event["kind"] == "baseline")
    assert 370 < baseline["power_w"] < 400 and 2400 < baseline["clock_mhz"] < 2600
    assert "stall" in kinds(run.events) and "restored" in kinds(run.events)


def test_a_baseline_that_looks_stalled_is_not_learnt():
    policy = Policy(load_config(quiet()))
    policy.feed(Progress(0.0, 1, 9.5))
    events = []
    for i in range(10):
        events += policy.feed(GpuSample(10.0 * (i + 1), 3100, 240, 99, 4))
    assert "baseline" not in kinds(events) and policy.baseline == XTX_SATURATED
    assert "stall" in kinds(events)


def test_step_rate_stands_in_where_the_platform_has_no_power_reading():
    """Windows counters give utilisation and VRAM only: slow steps are the stall evidence."""
    policy = Policy(load_config(quiet()))
    events, t = [], 0.0
    for step in range(1, 20):
        t += 9.5 if step < 12 else 60.0
        events += policy.feed(GpuSample(t, gpu_util=99, vram_used_mb=23000))
        events += policy.feed(Progress(t, step, 9.5 if step < 12 else 60.0))
        events += policy.tick(t)
    stall = next(event for event in events if event["kind"] == "stall")
    assert stall["step"] == 13 and "slow step rate" in stall["reason"]
    assert bursts(events)[0]["trigger"] == "stall"


def test_verification_times_out_on_the_signature_when_no_step_arrives():
    policy = Policy(load_config(quiet()))
    policy.feed(Progress(0.0, 1, 9.5))
    policy.feed(GpuSample(10.0, 3100, 240, 99, 4))
    assert kinds(policy.feed(GpuSample(20.0, 3100, 240, 99, 4))) == ["stall", "burst"]
    assert kinds(policy.feed(BurstResult(50.0, True, 70.0, 25.0))) == ["burst_done"]
    assert policy.tick(349.0) == []
    judged = policy.tick(350.0)
    assert kinds(judged) == ["restored"] and "no step rate" in judged[0]["reason"]


def test_a_result_nobody_asked_for_is_ignored():
    assert Policy(CONFIG).feed(BurstResult(5.0, True, 70.0, 25.0)) == []


def test_every_event_is_a_flat_json_row():
    for event in simulate(default_scenario(), CONFIG).events:
        assert {"t", "step", "kind", "reason"} <= set(event)
        assert all(isinstance(value, (int, float, str, type(None))) for value in event.values())


# --- burst process plumbing (no torch: a stand-in script) ----------------------------------------

def test_burst_output_parsing():
    good = parse_burst_output('warning\n{"ok": true, "tflops": 71.5, "seconds": 25.0}\n', 0, "", 9.0)
    assert good == BurstResult(9.0, True, 71.5, 25.0)
    crashed = parse_burst_output("", -9, "Traceback\nRuntimeError: HIP error: out of memory\n", 9.0)
    assert not crashed.ok and "HIP error: out of memory" in crashed.error
    failed = parse_burst_output('{"ok": false, "error": "no GPU"}', 1, "", 9.0)
    assert not failed.ok and failed.error == "no GPU"


def test_subprocess_burster_runs_a_fresh_process_each_time(tmp_path, monkeypatch):
    fake_root = tmp_path / "root"
    (fake_root / "launcher" / "in_trainer").mkdir(parents=True)
    (fake_root / "launcher" / "__init__.py").write_text("", encoding="utf-8")
    (fake_root / "launcher" / "in_trainer" / "__init__.py").write_text("", encoding="utf-8")
    (fake_root / "launcher" / "in_trainer" / "burst.py").write_text(
        "import json, os, sys\nprint(json.dumps({'ok': True, 'tflops': 5.0 + len(sys.argv), "
        "'seconds': float(sys.argv[sys.argv.index('--seconds') + 1]), 'pid': os.getpid()}))\n", encoding="utf-8")
    monkeypatch.setattr(trainer_python, "LAUNCHER_ROOT", fake_root)
    burster = SubprocessBurster(Path(sys.executable), load_config({"burst_s": 0.5}))
    results = []
    for now in (0.0, 1.0):
        burster.start(now)
        burster._child.wait(timeout=60)
        results.append(burster.poll(now + 1))
    assert all(result.ok and result.seconds == 0.5 and result.tflops == 5.0 + 13 for result in results)
    assert burster.poll(5.0) is None


def test_subprocess_burster_reports_a_missing_interpreter(tmp_path):
    burster = SubprocessBurster(tmp_path / "no-python", CONFIG)
    burster.start(0.0)
    result = burster.poll(0.0)
    assert not result.ok and "cannot start" in result.error


def test_venv_python_is_the_interpreter_bursts_use(tmp_path):
    config = load_config(None)
    command = SubprocessBurster(venv_python(tmp_path / "venv", windows=True), config).command()
    assert command[0].endswith(str(Path("venv") / "Scripts" / "python.exe"))
    assert command[1:3] == ["-m", "launcher.in_trainer.burst"] and "18432" in command
