"""Run output: runs/<name>/{config.yaml, metrics.jsonl, tb/, wandb/, curves.png}, a progress bar.

Only rank 0 writes. metrics.jsonl is the source of truth (one JSON object per step, strict JSON:
a value that is not finite, NaN or +-inf, is written as null, which read_metrics reads back as
NaN); TensorBoard and wandb (offline unless configured) get the same scalars.

A step is written in the order that loses nothing: a step that saves a checkpoint first stages its
row (PENDING, beside metrics.jsonl), then saves, then appends the row to metrics.jsonl. A resume
continues after the checkpoint's step and keeps the rows up to it; when the run stopped between
the save and the append, the staged row of exactly that step is appended (without the save's cost
keys, which were not known yet), so no step that a checkpoint claims lacks its row and no step is
written twice.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

from megatron_dppo.run.profiling import phase_totals

PENDING = ".metrics-pending.json"  # the row of a step whose checkpoint is being saved


def json_row(metrics: dict) -> str:
    """One metrics row as strict JSON: a non-finite float (NaN, +-inf) becomes null."""
    return json.dumps(
        {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()},
        allow_nan=False,
    )


def parse_row(line: str) -> dict:
    """A metrics.jsonl line -> the row, null read back as NaN (json_row's inverse for numbers)."""
    return {k: math.nan if v is None else v for k, v in json.loads(line).items()}


class RunLogger:
    def __init__(self, run_dir: str, cfg, total_steps: int, first_step: int = 1, enabled: bool = True):
        self.run_dir, self.enabled = run_dir, enabled
        self.metrics_path = os.path.join(run_dir, "metrics.jsonl")
        self.pending_path = os.path.join(run_dir, PENDING)
        self.tb = self.wandb = self.bar = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self._truncate_after(first_step - 1)  # a resumed run rewrites the steps it repeats
        self._restore_pending(first_step - 1)
        lc = cfg.logging
        if lc.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=first_step)
        if lc.wandb != "disabled":
            import wandb

            self.wandb = wandb.init(
                project=lc.wandb_project,
                name=cfg.trainer.run_name,
                dir=run_dir,
                mode=lc.wandb,
                config=dataclasses.asdict(cfg),
                resume="allow",
                settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
            )
        if lc.progress:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_steps,
                initial=first_step - 1,
                desc=cfg.trainer.run_name,
                dynamic_ncols=True,
                mininterval=1.0,
            )

    def _truncate_after(self, step: int) -> None:
        """Keep the rows of steps <= step (a resumed run rewrites the steps it repeats). A kill while a
        row was being written leaves a partial last line: it is dropped (its step is repeated); a bad
        line anywhere else is an error naming the file and line."""
        if not os.path.exists(self.metrics_path):
            return
        rows = []
        for line, row in _metric_lines(self.metrics_path):
            if row is None:
                self.message(f"{self.metrics_path}: dropping the partial last line (a kill while it was written)")
            elif row.get("step", 0) <= step:
                rows.append(line if line.endswith("\n") else line + "\n")
        tmp = self.metrics_path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(rows)
        os.replace(tmp, self.metrics_path)

    def _restore_pending(self, step: int) -> None:
        """The staged row of `step` (the checkpoint resumed from) when metrics.jsonl lacks it; a
        staged row of any other step belongs to a save that did not finish: dropped."""
        if not os.path.exists(self.pending_path):
            return
        try:
            with open(self.pending_path) as f:
                row = json.load(f)
        except (OSError, ValueError):  # a kill while it was written: its checkpoint was not saved either
            row = None
        if isinstance(row, dict) and row.get("step") == step and step not in _logged_steps(self.metrics_path):
            with open(self.metrics_path, "a") as f:
                f.write(json_row(row) + "\n")
            self.message(f"{self.metrics_path}: step {step}'s row restored (the run stopped after its checkpoint)")
        os.remove(self.pending_path)

    def stage(self, metrics: dict) -> None:
        """Before a checkpoint of metrics["step"] is saved: its row, kept until log() writes it."""
        if not self.enabled:
            return
        tmp = self.pending_path + ".tmp"
        with open(tmp, "w") as f:
            f.write(json_row(dict(metrics, wall_time=time.time())))
        os.replace(tmp, self.pending_path)

    def log(self, metrics: dict) -> None:
        if not self.enabled:
            return
        metrics = dict(metrics, wall_time=time.time())
        with open(self.metrics_path, "a") as f:
            f.write(json_row(metrics) + "\n")
        if os.path.exists(self.pending_path):
            os.remove(self.pending_path)
        step = metrics["step"]
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)
        if self.bar is not None and "time/step" in metrics:  # an evaluation before step 1 is no step
            post = {"reward": f"{metrics.get('reward/mean', 0):.3f}", "step_s": f"{metrics.get('time/step', 0):.2f}"}
            if "eval/accuracy" in metrics:
                post["eval"] = f"{metrics['eval/accuracy']:.3f}"
            self.bar.set_postfix(post, refresh=False)
            self.bar.update(1)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        (self.bar.write if self.bar is not None else print)(text)

    def close(self) -> None:
        if not self.enabled:
            return
        self.enabled = False  # closing twice (the trainer's close after its loop) does nothing
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        plot_curves(self.metrics_path, os.path.join(self.run_dir, "curves.png"))


def phase_summary(rows: list[dict]) -> str:
    """The run's last line: steps, time per phase, held-out accuracy first -> last."""
    steps = [h for h in rows if "time/step" in h]
    if not steps:
        return "no training steps run"
    total = sum(h["time/step"] for h in steps)
    parts = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in phase_totals(steps).items())
    if any("time/rollout_wait" in h for h in steps):  # dedicated rollout ranks: rollout and reward are theirs
        parts += f"; waiting for the rollout ranks {sum(h.get('time/rollout_wait', 0.0) for h in steps):.1f}s"
    evals = [h["eval/accuracy"] for h in rows if "eval/accuracy" in h]
    acc = f"; held-out accuracy {evals[0]:.3f} -> {evals[-1]:.3f}" if len(evals) > 1 else ""
    return f"{len(steps)} steps in {total:.1f}s ({parts}){acc}"


def _logged_steps(path: str) -> set:
    return {row.get("step") for row in read_metrics(path)}


def _metric_lines(path: str):
    """(line, row) of each row of a metrics.jsonl; a partial last line (a kill while it was
    written) comes as (line, None); a bad line anywhere else is a ValueError naming file and line."""
    with open(path) as f:
        lines = f.readlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield line, parse_row(line)
        except json.JSONDecodeError:
            if i == len(lines) and not line.endswith("\n"):
                yield line, None
                return
            raise ValueError(f"{path}:{i}: not a JSON metrics row: {line[:80]!r}") from None


def read_metrics(path) -> list[dict]:
    """The rows of a metrics.jsonl (str or Path); none for a file not written yet (a run before its
    first step); a partial last line (a kill while it was written) is left out, a bad line anywhere
    else is a ValueError naming the file and line."""
    if not os.path.exists(path):
        return []
    return [row for _, row in _metric_lines(path) if row is not None]


def plot_curves(metrics_path: str, png_path: str) -> None:
    """Reward and held-out accuracy against step and wall-clock time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    if not rows:
        return
    t0 = rows[0]["wall_time"] - rows[0].get("time/step", 0)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, x_key in zip(axes, ("step", "elapsed")):
        xs = [r["step"] if x_key == "step" else r["wall_time"] - t0 for r in rows]
        ax.plot(xs, [r.get("reward/mean", float("nan")) for r in rows], label="train reward (mean)", alpha=0.6)
        ev = [(x, r["eval/accuracy"]) for x, r in zip(xs, rows) if "eval/accuracy" in r]
        if ev:
            ax.plot(*zip(*ev), "o-", label="held-out accuracy (greedy)")
        ax.set_xlabel("step" if x_key == "step" else "seconds")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
