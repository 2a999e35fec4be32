"""Held-out evaluation during training: the data.eval sets (rollout/validation.py), run by the
step's own engines (this rank's, or the rollout ranks' over the bridge) before the first step, every
trainer.eval_every steps and after the last. Collective: every training rank calls it, every rank
gets the same metrics."""

from __future__ import annotations

import os
import time


class Evaluation:
    def __init__(self, eval_every: int, sets: list, *, engines, renderer, run_dir: str, is_main: bool, watchdog):
        """engines: the step's train/step_rollout LocalEngines or RemoteEngines; the sets' dumps go
        to <run dir>/val."""
        self.every, self.sets, self.engines, self.renderer = eval_every, sets, engines, renderer
        self.dump_dir, self.is_main, self.watchdog = os.path.join(run_dir, "val"), is_main, watchdog

    def before_training(self) -> dict | None:
        """Step 0's row (the starting weights' accuracy) for a run that starts at step 1; None without one."""
        if not self.every:
            return None
        row = {"step": 0, **self.run(0)}
        return row if len(row) > 1 else None

    def after_step(self, step: int, final: bool) -> dict:
        """The step's eval metrics and their time, on every trainer.eval_every-th and the final step; {} otherwise."""
        if not (self.every and (step % self.every == 0 or final)):
            return {}
        self.watchdog.phase("eval", step)
        t0 = time.perf_counter()
        metrics = self.run(step)
        return {**metrics, "time/eval": time.perf_counter() - t0}

    def run(self, step: int) -> dict:
        """{val/<set>/<source>/<metric>, eval/accuracy} on every rank; {} without sets. The sets are
        split over the engines like a rollout; rewards are the scorer's own (no overlong shaping: it
        is not a verdict)."""
        if not self.sets:
            return {}
        if self.engines.remote:  # the rollout ranks' engines run the sets (after the rounds in flight)
            ticket = self.engines.request("eval", {"step": step, "dump_dir": self.dump_dir})
            return self.engines.reply(ticket)[0]
        return self.engines.worker.evaluate(
            self.sets, renderer=self.renderer, step=step, dump_dir=self.dump_dir, is_main=self.is_main
        )
