"""When the trainer saves a checkpoint: every trainer.save_every steps or trainer.save_every_minutes,
whichever comes first, and at the end.

A hard kill (kill -9, a node lost, an OOM kill) loses what was trained since the last save; a
cadence in steps alone bounds that loss in steps, which can be hours at scale. The time bound
caps it in minutes whatever a step costs. The decision reads the wall clock, which differs
between ranks: every rank must act on the same answer, so the caller takes rank 0's
(megatron_dppo.run.collectives.agree).
"""

from __future__ import annotations


def should_save(step: int, now: float, last_save_time: float, cfg, final: bool) -> bool:
    """Save after `step`? cfg: the TrainerConfig (save_every, save_every_minutes; 0 turns either
    off). now and last_save_time are seconds on one monotonic clock; last_save_time is when the
    last checkpoint was written, or when training started when none has been yet."""
    if final:
        return True
    if cfg.save_every and step % cfg.save_every == 0:
        return True
    return bool(cfg.save_every_minutes) and now - last_save_time >= 60.0 * cfg.save_every_minutes


def save_cost_line(step_dir: str, seconds: float, num_bytes: int) -> str:
    """The log line of one save, so that a user can weigh the cadence against what a save costs."""
    return f"checkpoint {step_dir} saved in {seconds:.1f} s ({num_bytes / 2**20:.1f} MiB)"
