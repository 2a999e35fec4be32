"""Checkpoint cadence (issue 24, item 2): by steps or by minutes, whichever comes first, so that a
hard kill loses minutes. The bound is checked on simulated runs against its definition: at any
moment, the time since the last save is at most the cadence plus one step."""

import random

from megatron_dppo.config import TrainerConfig, load_config
from megatron_dppo.run.cadence import save_cost_line, should_save


def simulate(cfg, step_seconds, max_steps):
    """Steps run back to back; returns (steps saved after, their end times)."""
    now, last, saved, times = 0.0, 0.0, [], []
    for step in range(1, max_steps + 1):
        now += step_seconds[step - 1]
        if should_save(step, now, last, cfg, final=step == max_steps):
            saved.append(step)
            times.append(now)
            last = now
    return saved, times


def test_whichever_comes_first():
    cfg = TrainerConfig(save_every=50, save_every_minutes=1.0)
    # 25 s steps: a minute has passed after every 3rd step (75 s), long before step 50.
    saved, _ = simulate(cfg, [25.0] * 12, 12)
    assert saved == [3, 6, 9, 12]
    # 0.5 s steps: 50 steps (25 s) come first.
    saved, _ = simulate(cfg, [0.5] * 120, 120)
    assert saved == [50, 100, 120]
    assert simulate(TrainerConfig(save_every=0, save_every_minutes=0.0), [25.0] * 12, 12)[0] == [12]  # end only


def test_a_kill_at_any_moment_loses_at_most_the_cadence_plus_one_step():
    rng = random.Random(0)
    for _ in range(200):
        minutes = rng.choice([0.5, 1.0, 10.0])
        cfg = TrainerConfig(save_every=rng.choice([0, 7, 50]), save_every_minutes=minutes)
        steps = [rng.uniform(0.1, 40.0) for _ in range(300)]
        _, times = simulate(cfg, steps, len(steps))
        ends = [0.0] + times
        worst_gap = max(b - a for a, b in zip(ends, ends[1:]))
        assert worst_gap <= 60 * minutes + max(steps) + 1e-9, (minutes, worst_gap)


def test_the_main_job_old_default_lost_every_step_and_a_minute_cadence_does_not():
    """Issue 24: kill -9 after step 8 of the main job lost all 8 steps (save_every=50 only). Its
    steps take 2-5 s here; 3 s steps after a 30 s start: with saves every minute, a kill after
    step 40 (2 min in) keeps step 20; with the old cadence, nothing before step 50."""
    step_s = [3.0] * 400
    old = TrainerConfig(save_every=50, save_every_minutes=0.0)
    assert simulate(old, step_s, 400)[0][:1] == [50]
    every_minute = TrainerConfig(save_every=50, save_every_minutes=1.0)
    assert simulate(every_minute, step_s, 400)[0][:3] == [20, 40, 50]
    assert TrainerConfig().save_every_minutes == 10.0  # the default, for runs whose saves cost minutes
    assert load_config("examples/tiny/addition.yaml").trainer.save_every_minutes > 0


def test_cost_line():
    assert save_cost_line("step_000008", 0.234, 9 << 20) == "checkpoint step_000008 saved in 0.2 s (9.0 MiB)"
