#!/usr/bin/env python
"""The paper's own claim on a real model, measured: GRPO against DPPO (r_q = r_o = 0.5) on
SmolLM2-135M-Instruct (examples/smollm2), with prompts that come back within the run so that the
prompt history prunes. Hours on the 2-core CPU; kill it and start the same command again at any
time: it continues where it stopped.

    .venv/bin/python tools/build_smollm2.py          # once: .cache/smollm2/SmolLM2-135M-Instruct
    .venv/bin/python tools/smollm2_claim.py          # 3 seeds each, 2 runs at a time, 1 thread each
    .venv/bin/python tools/smollm2_claim.py --dry-run   # the runs, their state and their commands
    .venv/bin/python tools/smollm2_claim.py --report    # the report of the runs on disk; runs nothing

The runs. GRPO and DPPO (0.5, 0.5) as tools/compare_methods.py defines them (its COMMON settings, its
METHODS, its run plan: seed 0 GRPO first, seed 1 DPPO first, ...), each its own `python -m
megatron_dppo.cli train` process under <out>/<method>-s<seed>, with trainer.threads=1 and
OMP_NUM_THREADS=1. data.train_size = prompts_per_step * (steps // visits), so the train set is
drawn through at least `--visits` times and every prompt comes back with a history DPPO's prompt
rule can prune by. Held-out avg@4 (eval.n=4 at temperature 1, the first --eval-size problems of the
config's eval set) before the first step and after every step.

Resumable. Each run's state is read from its run dir: metrics reaching max_steps with an
evaluation = done (skipped); checkpoints (trainer.save_every_minutes, and on SIGTERM) = continued
with --resume; a run dir of this project with no checkpoint (killed before its first save) =
started again with --overwrite (the trainer deletes only a dir with its marker); none = started.
Stopping this script (Ctrl-C, SIGTERM, or its death: the runs get SIGTERM from the kernel) makes
every run save a checkpoint and exit. Checkpoints are kept (about 1.6 GB a SmolLM2 run).

CPU time. compare_methods' measure: the run's process CPU time, sampled when each metrics line
appears (<out>/<run>.cpu.json keeps the samples across restarts). Every step here is evaluated, so
the interval between two lines holds the step, its evaluation and any save: a step's train CPU is
its `time/step` times that interval's CPU seconds per wall second (with one thread it counts the
work, not the waiting for the shared cores). Steps without a sampled interval (the first after a
resume) get the run's mean CPU per wall second.

The report (<out>/claim.{json,md,png}; also at the end of a run-through): per method, held-out
avg@4 per step and against cumulative train CPU seconds (mean +- standard error over seeds); GRPO's
final accuracy (the last value of a monotone fit of its seed-mean curve, as compare_methods takes
it); the CPU seconds and steps DPPO takes to reach it (per seed and on the seed-mean curve), or
"not reached" with the gap; the share of drawn prompts DPPO pruned (a run that pruned none does not
measure the claim, and is flagged); and a row for docs/results.md's claims table.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: compare_methods beside this file
import compare_methods as cm  # noqa: E402

from megatron_dppo.run.log import read_metrics  # noqa: E402
from megatron_dppo.run.process import die_with_parent  # noqa: E402

REPO = cm.REPO
DEFAULT_CONFIG = "examples/smollm2/dppo.yaml"
DEFAULT_OUT = "runs/smollm2-claim"
GRPO, DPPO = "grpo", "dppo-0.5-0.5"  # compare_methods.METHODS' names
METHODS = [cm.METHOD_BY_NAME[GRPO], cm.METHOD_BY_NAME[DPPO]]
EVAL_N = 4  # avg@4: the held-out measure the claim is stated in
PAPER_SPEEDUP = 1.65  # DPPO (0.5, 0.5) to GRPO's accuracy, Qwen3-4B on GSM8K (docs/results.md's claims table)
GOAL_SPEEDUP = 1.6  # the project's goal for (0.5, 0.5) (compare_methods.GOALS)
MIN_SEEDS = 3
LOCK = ".claim.lock"
# --out's mark: this script writes (ledgers, claim.*, run dirs) only into a new or empty directory,
# or one that carries it, so a directory a user named that holds their files is refused, not written into
OUT_MARKER = ".smollm2-claim"
DONE, RESUME, RESTART, FRESH = "done", "resume", "restart", "fresh"
STATE_FLAGS = {RESUME: ["--resume"], RESTART: ["--overwrite"], FRESH: []}


# ---------------------------------------------------------------------------------------------
# The plan


def train_size_for(prompts_per_step: int, steps: int, visits: int) -> int:
    """The train set's size that a run of `steps` steps of `prompts_per_step` prompts draws through
    at least `visits` times (whole epochs: the sampler starts a new epoch for a batch that does not fit)."""
    if visits < 2:
        raise ValueError(f"--visits must be >= 2 (a prompt needs a history to be pruned), got {visits}")
    if steps < visits:
        raise ValueError(f"--steps {steps} is too few for every prompt to be drawn --visits {visits} times")
    return prompts_per_step * (steps // visits)


def count_train_prompts(cfg) -> int:
    from megatron_dppo.data.files import data_paths, read_rows

    paths = [p if os.path.isabs(p) else str(REPO / p) for p in data_paths(cfg.data.train)]  # as the runs see them
    return sum(1 for path in paths for _ in read_rows(path))


def claim_overrides(train_size: int, save_minutes: float) -> list[str]:
    """Every run's settings on top of compare_methods' (COMMON, the method, the budget)."""
    return [
        f"data.train_size={train_size}",
        f"eval.n={EVAL_N}",
        "eval.temperature=1.0",
        # Resumable: a checkpoint every few minutes (compare_methods saves only at the end), one kept.
        f"trainer.save_every_minutes={save_minutes}",
        "trainer.keep_checkpoints=1",
        "logging.rollouts=false",
    ]


def plan(args, out_dir: Path, train_size: int) -> list:
    """compare_methods.plan_runs for GRPO and DPPO (0.5, 0.5), evaluated every step."""
    budget = argparse.Namespace(
        quick=False,
        steps=args.steps,
        eval_every=1,
        eval_size=args.eval_size,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        threads=args.threads,
        config=args.config,
        override=claim_overrides(train_size, args.save_minutes) + list(args.override or []),
    )
    return cm.plan_runs(budget, METHODS, cm.parse_seeds(args.seeds), out_dir)


# ---------------------------------------------------------------------------------------------
# A run's state on disk, and the command that continues it


def is_done(run_dir: Path, max_steps: int) -> bool:
    return any(r.get("step") == max_steps and "eval/accuracy" in r for r in read_metrics(run_dir / "metrics.jsonl"))


def run_state(run, max_steps: int) -> str:
    """DONE, RESUME (checkpoints), RESTART (this project's run dir, no checkpoint) or FRESH; a dir
    the trainer would refuse either way (not this project's) is a one-line ValueError."""
    from megatron_dppo.run.run_dir import RunDirError, plan_run_dir, read_marker

    if is_done(run.run_dir, max_steps):
        return DONE
    out, name = str(run.run_dir.parent), run.run_dir.name
    try:
        plan_run_dir(out, name, resume=True, overwrite=False)
        return RESUME
    except RunDirError:
        pass
    try:
        plan_run_dir(out, name, resume=False, overwrite=False)
        return FRESH
    except RunDirError as e:
        if read_marker(str(run.run_dir)) is not None:
            return RESTART
        raise ValueError(f"{name}: {e}") from None


def train_command(config: str, run, state: str) -> list[str]:
    return [cm.PYTHON, "-m", "megatron_dppo.cli", "train", "--config", config, *run.overrides, *STATE_FLAGS[state]]


# ---------------------------------------------------------------------------------------------
# The ledger: <out>/<run>.cpu.json, each process that worked on the run (a segment) with its CPU samples


def ledger_path(run) -> Path:
    return run.run_dir.parent / f"{run.name}.cpu.json"


def read_ledger(run) -> dict:
    path = ledger_path(run)
    if not path.exists():
        return {"overrides": None, "segments": []}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        raise ValueError(f"{path}: not valid JSON (this script's record of {run.name}'s CPU samples)") from None


def write_ledger(run, ledger: dict) -> None:
    path = ledger_path(run)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(ledger))
    os.replace(tmp, path)  # a kill mid-write leaves the previous version


def check_same_settings(run, state: str) -> None:
    """A run done or to be continued with other overrides than it was started with is refused (its
    steps, or the report, would mix two settings); one without a checkpoint just starts over."""
    recorded = read_ledger(run)["overrides"]
    if state not in (DONE, RESUME) or recorded is None or recorded == run.overrides:
        return
    was, now = set(recorded) - set(run.overrides), set(run.overrides) - set(recorded)
    raise ValueError(
        f"{run.name}: {run.run_dir} was started with other settings (then {sorted(was)[:3]}, now "
        f"{sorted(now)[:3]}): use another --out, or move that run dir away yourself"
    )


# ---------------------------------------------------------------------------------------------
# Running


class ClaimJob(cm.Launched):
    """One training process: compare_methods.Launched's poll and kill; its own start (no forced
    --overwrite: a run continues with --resume) and CPU samples kept in the run's ledger."""

    def __init__(self, run, config: str, threads: int, state: str):
        self.run, self.state = run, state
        self.cmd = train_command(config, run, state)
        run.run_dir.parent.mkdir(parents=True, exist_ok=True)
        self.ledger = read_ledger(run)
        if state != RESUME:  # the run starts over: so do its samples
            self.ledger = {"overrides": run.overrides, "segments": []}
        self.ledger["overrides"] = run.overrides
        self.ledger["environment"] = cm.environment()
        self.ledger["segments"].append(
            {"state": state, "command": self.cmd, "started": time.time(), "code": cm.code_version(), "marks": []}
        )
        write_ledger(run, self.ledger)
        self._rows = 0 if state != RESUME else len(read_metrics(run.run_dir / "metrics.jsonl"))
        self._metrics_size = -1
        self.log = open(cm.run_log(run), "a")
        self.log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {state}: {shlex.join(self.cmd)}\n")
        self.log.flush()
        self.t0, self.rusage = time.time(), None
        self.proc = subprocess.Popen(
            self.cmd,
            cwd=REPO,
            env=cm._env(threads),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches this script only: it asks the runs to save first
            # This script killed hard: each run still gets SIGTERM, saves and exits.
            preexec_fn=lambda: die_with_parent(signal.SIGTERM),
        )

    def sample(self) -> None:
        """A CPU sample when metrics.jsonl gained a row; a resume's truncation of repeated steps is none."""
        grown = self.grown_metrics()
        if grown is None:
            return
        (rows, cpu), wall = grown, time.time()
        if len(rows) > self._rows and cpu is not None:
            self.ledger["segments"][-1]["marks"].append([int(rows[-1]["step"]), cpu, wall])
            write_ledger(self.run, self.ledger)
        self._rows = len(rows)

    def finish(self) -> int:
        segment = self.ledger["segments"][-1]
        segment.update(
            returncode=self.proc.returncode,
            ended=time.time(),
            process_cpu_s=self.rusage.ru_utime + self.rusage.ru_stime if self.rusage else None,
        )
        write_ledger(self.run, self.ledger)
        self.log.close()
        return self.proc.returncode

    def stop(self, grace_s: float) -> None:
        """SIGTERM (the trainer saves a checkpoint and exits), SIGKILL after grace_s."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)  # our own child's process group only
                self.proc.wait(timeout=wait_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self.finish()


def execute(runs, config: str, max_steps: int, args, start=ClaimJob, log=print) -> dict:
    """Every run not done, `args.parallel` at a time; a failed run is tried again (from its state
    then) up to args.retries times. start(run, config, threads, state) -> a job (ClaimJob's interface)."""
    states = {r.name: run_state(r, max_steps) for r in runs}
    queue = [r for r in runs if states[r.name] != DONE]
    log(
        f"{len(runs) - len(queue)} run(s) done, {len(queue)} to run: "
        + ", ".join(f"{r.name} ({states[r.name]})" for r in queue)
    )
    attempts, failed, active = {r.name: 0 for r in queue}, [], []
    try:
        while queue or active:
            while queue and len(active) < args.parallel:
                run = queue.pop(0)
                state = run_state(run, max_steps)
                attempts[run.name] += 1
                now = time.strftime("%H:%M:%S")
                log(f"[{now}] {state} {run.name} (attempt {attempts[run.name]}; log {cm.run_log(run)})")
                active.append(start(run, config, args.threads, state))
            time.sleep(args.poll_s)
            for job in active:
                job.sample()
            for job in [j for j in active if j.poll()]:
                active.remove(job)
                rc = job.finish()
                done = is_done(job.run.run_dir, max_steps)
                log(f"[{time.strftime('%H:%M:%S')}] {job.run.name}: exit {rc}{', done' if done else ''}")
                if not done and attempts[job.run.name] <= args.retries:
                    queue.append(job.run)
                elif not done:
                    failed.append(job.run.name)
                    log(f"    FAILED: see {cm.run_log(job.run)}")
    except BaseException:
        log(f"stopping {len(active)} run(s): each saves a checkpoint first (up to {args.stop_grace_s:.0f} s)")
        for job in active:
            job.stop(args.stop_grace_s)
        raise
    return {"failed": failed}


# ---------------------------------------------------------------------------------------------
# A run's numbers


def cpu_per_wall(ledger: dict) -> dict[int, float]:
    """step -> CPU seconds per wall second over the interval that ended with its metrics line,
    from consecutive samples of one process. A resumed process's first sample is no interval's
    start (the lines written at its start-up are not a step's end)."""
    ratios: dict[int, float] = {}
    for seg in ledger.get("segments", []):
        marks = seg.get("marks", [])[1 if seg.get("state") == RESUME else 0 :]
        for (s0, c0, w0), (s1, c1, w1) in zip(marks, marks[1:]):
            if s1 == s0 + 1 and w1 > w0:
                ratios[s1] = (c1 - c0) / (w1 - w0)  # a later process's sample of a repeated step wins
    return ratios


def step_train_cpu(rows: list[dict], ledger: dict) -> dict[int, float] | None:
    """step -> its train CPU seconds (time/step x the interval's CPU per wall second; the run's
    mean ratio where the step's interval was not sampled); None without any sample."""
    steps = {r["step"]: r["time/step"] for r in rows if "time/step" in r}
    ratios = {s: v for s, v in cpu_per_wall(ledger).items() if s in steps}
    if not ratios:
        return None
    mean_ratio = sum(steps[s] * ratios[s] for s in ratios) / sum(steps[s] for s in ratios)
    return {s: t * ratios.get(s, mean_ratio) for s, t in sorted(steps.items())}


def summarize(run, rows: list[dict], ledger: dict, max_steps: int) -> dict:
    """One run: its accuracy curve against step, cumulative train CPU and wall seconds, and its pruning."""
    cpu = step_train_cpu(rows, ledger)
    curve, cum_cpu, cum_wall = [], 0.0, 0.0
    for r in sorted(rows, key=lambda r: r["step"]):
        cum_wall += r.get("time/step", 0.0)
        cum_cpu += cpu.get(r["step"], 0.0) if cpu else 0.0
        if "eval/accuracy" in r:
            curve.append(
                {"step": r["step"], "acc": r["eval/accuracy"], "cpu_s": cum_cpu if cpu else None, "wall_s": cum_wall}
            )
    kept = [r["prune/prompts_kept_frac"] for r in rows if "time/step" in r and "prune/prompts_kept_frac" in r]
    drawn = [r.get("rollout/prompts_drawn", 0) for r in rows if "time/step" in r]
    segments = ledger.get("segments", [])
    return {
        "run": run.name,
        "method": run.method,
        "seed": run.seed,
        "finished": any(p["step"] == max_steps for p in curve),
        "steps": sum(1 for r in rows if "time/step" in r),
        "curve": curve,
        "step_cpu_s": cpu,
        "train_cpu_s": sum(cpu.values()) if cpu else None,
        "train_wall_s": cum_wall,
        "cpu_sampled_steps": len(cpu_per_wall(ledger)),
        "prompts_drawn": sum(drawn),
        "prompts_pruned_frac": 1 - sum(k * d for k, d in zip(kept, drawn)) / sum(drawn) if sum(drawn) else None,
        "steps_with_pruning": sum(1 for k in kept if k < 1),
        "min_prompts_kept_frac": min(kept, default=None),
        "completions_kept_frac": cm._mean([r.get("prune/completions_kept_frac") for r in rows if "time/step" in r]),
        "code": sorted({_code_label(s.get("code")) for s in segments if s.get("code")}),
        "commands": [shlex.join(s["command"]) for s in segments if s.get("command")],
        "processes": len(segments),
        "environment": ledger.get("environment"),
    }


def _code_label(code: dict | None) -> str:
    if not code or not code.get("head"):
        return "unknown"
    return code["head"] + (f"+{code['dirty']}" if code.get("dirty") else "")


# ---------------------------------------------------------------------------------------------
# The claim: pure functions of the runs' summaries


def mean_curve(runs: list[dict]) -> list[dict]:
    """Mean and standard error over the runs at every evaluated step all of them have."""
    if not runs:
        return []
    common = set.intersection(*({p["step"] for p in r["curve"]} for r in runs))
    out = []
    for step in sorted(common):
        pts = [next(p for p in r["curve"] if p["step"] == step) for r in runs]
        accs, cpus, walls = [p["acc"] for p in pts], [p["cpu_s"] for p in pts], [p["wall_s"] for p in pts]
        has_cpu = all(c is not None for c in cpus)
        out.append(
            {
                "step": step,
                "acc": cm._mean(accs),
                "acc_se": cm._se(accs),
                "cpu_s": cm._mean(cpus) if has_cpu else None,
                "cpu_se": cm._se(cpus) if has_cpu else None,
                "wall_s": cm._mean(walls),
                "n": len(pts),
            }
        )
    for p, fit in zip(out, cm.isotonic([p["acc"] for p in out])):
        p["acc_fit"] = fit
    return out


def reach(curve: list[dict], target: float | None, fit: list[float] | None = None) -> dict:
    """Where a curve's monotone fit first reaches `target` (cpu seconds and step, linearly
    interpolated between evaluations), or reached=False with the gap at its end."""
    if target is None or not curve:
        return {"reached": False, "cpu_s": None, "step": None, "gap": None}
    fit = fit or cm.isotonic([p["acc"] for p in curve])
    step = cm.time_to_target([(p["step"], f) for p, f in zip(curve, fit)], target)
    has_cpu = all(p["cpu_s"] is not None for p in curve)
    cpu = cm.time_to_target([(p["cpu_s"], f) for p, f in zip(curve, fit)], target) if has_cpu else None
    return {
        "reached": step is not None,
        "cpu_s": cpu,
        "step": step,
        "gap": None if step is not None else target - fit[-1],
    }


def method_summary(runs: list[dict]) -> dict:
    curve = mean_curve(runs)
    finals = [r["curve"][-1]["acc"] for r in runs if r["curve"]]
    cpus = [r["train_cpu_s"] for r in runs if r["train_cpu_s"] is not None]
    steps = [r["steps"] for r in runs]
    return {
        "seeds": sorted(r["seed"] for r in runs),
        "curve": curve,
        "acc_final": cm._mean(finals),
        "acc_final_se": cm._se(finals),
        "acc_initial": curve[0]["acc"] if curve and curve[0]["step"] == 0 else None,
        "train_cpu_s": cm._mean(cpus),
        "train_cpu_se": cm._se(cpus),
        "cpu_per_step_s": cm._mean([c / s for c, s in zip(cpus, steps) if s]),
        "prompts_pruned_frac": cm._mean([r["prompts_pruned_frac"] for r in runs]),
    }


def claim(grpo_runs: list[dict], dppo_runs: list[dict], planned: int) -> dict:
    """GRPO's final accuracy (its fitted seed-mean curve's last value); the CPU time and steps each
    method takes to reach it (DPPO per seed and on its mean curve); the verdict."""
    grpo, dppo = method_summary(grpo_runs), method_summary(dppo_runs)
    target = grpo["curve"][-1]["acc_fit"] if grpo["curve"] else None
    grpo_reach = reach(grpo["curve"], target, [p["acc_fit"] for p in grpo["curve"]])
    dppo_reach = reach(dppo["curve"], target, [p["acc_fit"] for p in dppo["curve"]])
    per_seed = [{"seed": r["seed"], **reach(r["curve"], target)} for r in dppo_runs]
    speedup = cm._ratio(grpo_reach["cpu_s"], dppo_reach["cpu_s"]) if dppo_reach["reached"] else None
    result = {
        "target_acc": target,
        "grpo": grpo,
        "dppo": dppo,
        "grpo_reach": grpo_reach,
        "dppo_reach": dppo_reach,
        "dppo_reach_per_seed": per_seed,
        "dppo_reach_per_seed_mean_cpu_s": cm._mean([p["cpu_s"] for p in per_seed if p["reached"]]),
        "speedup_to_target_cpu": speedup,
        "speedup_at_equal_steps_cpu": cm._ratio(grpo["train_cpu_s"], dppo["train_cpu_s"]),
        "dppo_runs_without_pruning": sorted(r["seed"] for r in dppo_runs if not r["steps_with_pruning"]),
        "runs_finished": len(grpo_runs) + len(dppo_runs),
        "runs_planned": planned,
    }
    result["verdict"] = verdict(result)
    return result


def verdict(c: dict) -> str:
    seeds = min(len(c["grpo"]["seeds"]), len(c["dppo"]["seeds"]))
    few = f"; {seeds} seed(s), fewer than {MIN_SEEDS}" if seeds < MIN_SEEDS else ""
    if c["runs_finished"] < c["runs_planned"]:
        return f"partial: {c['runs_finished']} of {c['runs_planned']} runs finished"
    if c["dppo_runs_without_pruning"]:
        return f"not measuring the claim: DPPO seed(s) {c['dppo_runs_without_pruning']} pruned no prompt{few}"
    if c["grpo_reach"]["step"] == (c["grpo"]["curve"] or [{"step": None}])[0]["step"]:
        return f"not measured: GRPO's final accuracy is no better than its first evaluation{few}"
    if not c["dppo_reach"]["reached"]:
        gap = c["dppo_reach"]["gap"]
        return f"not met: DPPO does not reach GRPO's final accuracy ({_pts(gap)} points short){few}"
    s = c["speedup_to_target_cpu"]
    if s is None:
        return f"not measured: no CPU time sampled{few}"
    if s >= GOAL_SPEEDUP:
        return f"met: {s:.2f}x{few}"
    if s > 1:
        return f"in direction ({s:.2f}x), not in size (paper {PAPER_SPEEDUP}x){few}"
    return f"not met: {s:.2f}x{few}"


def _pts(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _acc(x, se) -> str:
    return "-" if x is None else f"{100 * x:.1f}%" + (f" ± {100 * se:.1f}" if se is not None else "")


def _reach_text(r: dict) -> str:
    if r["reached"]:
        return f"{cm._f(r['cpu_s'], '{:.0f}')} s (step {r['step']:.1f})"
    return "not reached" + (f" (gap {_pts(r['gap'])} points)" if r["gap"] is not None else "")


def _reach_against_grpo(c: dict) -> str:
    """DPPO's train CPU time to GRPO's final accuracy beside GRPO's own, or the gap it stopped short by."""
    dppo, grpo = c["dppo_reach"], c["grpo_reach"]
    if not dppo["reached"]:
        return f"DPPO: {_reach_text(dppo)}; GRPO reached it in {_reach_text(grpo)} of train CPU"
    speedup = f", {c['speedup_to_target_cpu']:.2f}x" if c["speedup_to_target_cpu"] else ""
    return f"DPPO: {_reach_text(dppo)} of train CPU against GRPO's {_reach_text(grpo)}{speedup}"


def claim_row(c: dict, settings: dict, png_name: str) -> str:
    """One row of docs/results.md's claims table: claim | measured | runs | met | picture."""
    g, d = c["grpo"], c["dppo"]
    claim_text = (
        "DPPO (0.5, 0.5) reaches GRPO's final accuracy in less CPU time on a real model with both pruning rules "
        f"active (the paper's premise: {PAPER_SPEEDUP}x on Qwen3-4B; {settings.get('model', 'SmolLM2-135M-Instruct')} "
        f"on {settings.get('config', DEFAULT_CONFIG)}, {settings['train_size']} train prompts drawn "
        f"{settings['visits']}+ times)"
    )
    measured = (
        f"GRPO's final held-out avg@4 {_acc(c['target_acc'], None)} "
        f"(last step {_acc(g['acc_final'], g['acc_final_se'])}); "
        + _reach_against_grpo(c)
        + f"; at equal steps {cm._f(c['speedup_at_equal_steps_cpu'], '{:.2f}x')} by CPU time; "
        f"DPPO pruned {cm._f(d['prompts_pruned_frac'], '{:.0%}')} of drawn prompts; "
        f"final avg@4 DPPO {_acc(d['acc_final'], d['acc_final_se'])}"
    )
    runs = f"{', '.join(settings['code_versions']) or 'unknown'}, seeds {settings['seeds']}, `{settings['command']}`"
    return f"| {claim_text} | {measured} | {runs} | {c['verdict']} | [SmolLM2 claim]({png_name}) |"


# ---------------------------------------------------------------------------------------------
# The report


def report(runs, out_dir: Path, max_steps: int, settings: dict, png_copy: str = "") -> dict:
    summaries = [summarize(r, read_metrics(r.run_dir / "metrics.jsonl"), read_ledger(r), max_steps) for r in runs]
    finished = [s for s in summaries if s["finished"]]
    c = claim([s for s in finished if s["method"] == GRPO], [s for s in finished if s["method"] == DPPO], len(runs))
    settings = {**settings, "code_versions": sorted({v for s in summaries for v in s["code"]})}
    png_name = Path(png_copy).name if png_copy else "claim.png"
    result = {"settings": settings, "claim": c, "runs": summaries}
    result["claim_row"] = claim_row(c, settings, png_name)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "claim.json").write_text(json.dumps(result, indent=1))
    (out_dir / "claim.md").write_text(markdown(result))
    try:
        for path in [out_dir / "claim.png"] + ([Path(png_copy)] if png_copy else []):
            plot(result, path)
    except Exception as e:  # noqa: BLE001 - a picture must not lose the numbers, already written
        print(f"warning: the picture failed: {e}", file=sys.stderr)
    return result


def markdown(result: dict) -> str:
    s, c = result["settings"], result["claim"]
    lines = [
        f"Config `{s['config']}`, {s['steps']} steps, {s['prompts_per_step']} prompts x {s['group_size']} "
        f"completions a step, {s['train_size']} train prompts (each drawn >= {s['visits']} times), held-out "
        f"avg@{EVAL_N} on {s['eval_size']} problems after every step; seeds {s['seeds']}, {s['parallel']} run(s) at "
        f"a time with {s['threads']} thread each; code {', '.join(s['code_versions']) or 'unknown'}.",
        "",
        f"**Verdict: {c['verdict']}.** GRPO's final accuracy (its fitted seed-mean curve's last value): "
        f"{_acc(c['target_acc'], None)}.",
        "",
        "| Method | Seeds | Initial avg@4 | Final avg@4 (± SE) | Train CPU (s, ± SE) | CPU per step (s) "
        "| Prompts pruned | CPU time to GRPO's final acc |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, key in (("GRPO", "grpo"), ("DPPO (0.5, 0.5)", "dppo")):
        m, r = c[key], c[f"{key}_reach"]
        lines.append(
            f"| {name} | {m['seeds']} | {_acc(m['acc_initial'], None)} | {_acc(m['acc_final'], m['acc_final_se'])} | "
            f"{cm._f(m['train_cpu_s'], '{:.0f}')}{cm._f(m['train_cpu_se'], ' ± {:.0f}', none='')} | "
            f"{cm._f(m['cpu_per_step_s'])} | {cm._f(m['prompts_pruned_frac'], '{:.0%}')} | {_reach_text(r)} |"
        )
    lines += ["", "DPPO per seed, to GRPO's final accuracy (each seed's own fitted curve):", ""]
    dppo_runs = {r["seed"]: r for r in result["runs"] if r["method"] == DPPO}
    for p in c["dppo_reach_per_seed"]:
        r = dppo_runs[p["seed"]]
        lines.append(
            f"- seed {p['seed']}: {_reach_text(p)}; pruned {cm._f(r['prompts_pruned_frac'], '{:.0%}')} of "
            f"{r['prompts_drawn']} drawn prompts, at {r['steps_with_pruning']} of {r['steps']} steps"
        )
    lines += ["", "Held-out avg@4 per step (mean ± SE over seeds; cumulative train CPU seconds):", ""]
    lines += ["| Step | GRPO avg@4 | GRPO CPU (s) | DPPO avg@4 | DPPO CPU (s) |", "|---:|---:|---:|---:|---:|"]
    dppo = {p["step"]: p for p in c["dppo"]["curve"]}
    for p in c["grpo"]["curve"]:
        q = dppo.get(p["step"], {"acc": None, "acc_se": None, "cpu_s": None})
        lines.append(
            f"| {p['step']} | {_acc(p['acc'], p['acc_se'])} | {cm._f(p['cpu_s'], '{:.0f}')} | "
            f"{_acc(q['acc'], q['acc_se'])} | {cm._f(q['cpu_s'], '{:.0f}')} |"
        )
    lines += ["", "The runs (steps done of the planned; processes that worked on each; CPU-sampled steps):", ""]
    lines += [
        f"- {r['run']}: {r['steps']} of {s['steps']} steps{' (finished)' if r['finished'] else ''}, "
        f"{r['processes']} process(es), {r['cpu_sampled_steps']} steps CPU-sampled"
        for r in result["runs"]
    ]
    lines += ["", "The row for docs/results.md's claims table:", "", result["claim_row"], ""]
    return "\n".join(lines)


def plot(result: dict, png: Path) -> None:
    """Held-out avg@4 against step and against cumulative train CPU seconds: mean ± SE band per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c, s = result["claim"], result["settings"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label, color in (("grpo", "GRPO", "black"), ("dppo", "DPPO (0.5, 0.5)", "C0")):
        curve = c[key]["curve"]
        for ax, x_key in zip(axes, ("step", "cpu_s")):
            pts = [p for p in curve if p[x_key] is not None]
            xs, ys = [p[x_key] for p in pts], [100 * p["acc"] for p in pts]
            se = [100 * (p["acc_se"] or 0.0) for p in pts]
            ax.plot(xs, ys, "o-", ms=2.5, lw=1.6, color=color, label=f"{label} ({len(c[key]['seeds'])} seeds)")
            ax.fill_between(
                xs, [y - e for y, e in zip(ys, se)], [y + e for y, e in zip(ys, se)], color=color, alpha=0.15
            )
    for ax, xlabel in zip(axes, ("step", "cumulative train CPU time (s)")):
        if c["target_acc"] is not None:
            ax.axhline(100 * c["target_acc"], color="gray", ls=":", lw=1, label="GRPO's final (fitted)")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"held-out avg@{EVAL_N} (%), mean ± SE")
        ax.grid(alpha=0.3)
    for key, color in (("grpo_reach", "black"), ("dppo_reach", "C0")):  # where each reaches GRPO's final
        if c[key]["cpu_s"] is not None:
            axes[1].axvline(c[key]["cpu_s"], color=color, ls="--", lw=1)
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(
        f"SmolLM2 claim ({s['config']}): {s['steps']} steps, {s['train_size']} train prompts; {c['verdict']}",
        fontsize=9,
    )
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"the task YAML (default {DEFAULT_CONFIG})")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"the runs and the report (default {DEFAULT_OUT})")
    p.add_argument("--seeds", default=str(MIN_SEEDS), help="a count (3 -> seeds 0,1,2) or a comma-separated list")
    p.add_argument("--steps", type=int, default=40, help="steps per run (default 40)")
    p.add_argument("--visits", type=int, default=3, help="times every train prompt is drawn at least (default 3)")
    p.add_argument("--prompts-per-step", type=int, default=0, help="trainer.prompts_per_step (default: the config's)")
    p.add_argument("--group-size", type=int, default=0, help="rollout.group_size (default: the config's)")
    p.add_argument("--eval-size", type=int, default=32, help="held-out problems per evaluation (default 32)")
    p.add_argument("--parallel", type=int, default=2, help="runs at a time (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch and OpenMP threads per run (default 1)")
    p.add_argument("--save-minutes", type=float, default=10.0, help="minutes between checkpoints (default 10)")
    p.add_argument("--override", action="append", help="an extra dotted override for every run (repeatable)")
    p.add_argument("--retries", type=int, default=1, help="times a failed run is started again (default 1)")
    p.add_argument("--report", action="store_true", help="report the runs on disk; run nothing")
    p.add_argument("--dry-run", action="store_true", help="list the runs, their state and command; run nothing")
    p.add_argument("--png", default="", help="also write the picture here (e.g. docs/results_smollm2_claim.png)")
    p.add_argument("--poll-s", type=float, default=0.2, help=argparse.SUPPRESS)
    p.add_argument("--stop-grace-s", type=float, default=180.0, help=argparse.SUPPRESS)
    return p


def resolve_paths(args) -> Path:
    if not os.path.exists(args.config) and (REPO / args.config).exists():
        args.config = str(REPO / args.config)
    if not os.path.isfile(args.config):
        raise ValueError(f"--config {args.config}: no such file")
    args.config = os.path.abspath(args.config)
    out = Path(args.out)
    return out if out.is_absolute() else REPO / out


def check_model(cfg) -> None:
    hf_dir = cfg.model.hf_dir if os.path.isabs(cfg.model.hf_dir) else str(REPO / cfg.model.hf_dir)
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ValueError(
            f"model.hf_dir {cfg.model.hf_dir}: no model there (no config.json); for SmolLM2 build it first with "
            "`.venv/bin/python tools/build_smollm2.py` (make smollm2 does too)"
        )


def claim_out_dir(out_dir: Path, marker: str = OUT_MARKER) -> None:
    """Make --out this script's (its mark), or a one-line ValueError when it is a directory of
    someone else's files: a new or empty directory is taken, a marked one is ours already.
    marker: the script's own mark (tools/bench_lora.py's is .bench-lora)."""
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise ValueError(f"--out {out_dir} is not a directory: choose a new or empty directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / marker).is_file():
        raise ValueError(
            f"--out {out_dir} holds files this script did not write (it has no {marker}): choose a new or "
            "empty directory"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / marker).touch()


def lock(out_dir: Path):
    """One invocation per --out at a time (two would start the same runs twice)."""
    f = open(out_dir / LOCK, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ValueError(
            f"--out {out_dir}: another smollm2_claim.py is running on it (lock {out_dir / LOCK})"
        ) from None
    return f


def settings_of(args, cfg, runs, train_size: int, argv) -> dict:
    return {
        "config": os.path.relpath(args.config, REPO),
        "steps": args.steps,
        "visits": args.visits,
        "train_size": train_size,
        "prompts_per_step": cfg.trainer.prompts_per_step,
        "group_size": cfg.rollout.group_size,
        "eval_size": cfg.trainer.eval_size,
        "eval_n": EVAL_N,
        "seeds": cm.parse_seeds(args.seeds),
        "parallel": args.parallel,
        "threads": args.threads,
        "model": Path(cfg.model.hf_dir).name,
        # The measurement's command: what made the runs (a --report or --dry-run of them made none).
        "command": shlex.join([".venv/bin/python", "tools/smollm2_claim.py", *measurement_argv(argv)]),
        "run_commands": {r.name: shlex.join(train_command(os.path.relpath(args.config, REPO), r, FRESH)) for r in runs},
        "environment": cm.environment(),
        "head": cm.code_version(),
    }


def measurement_argv(argv: list[str]) -> list[str]:
    return [a for a in argv if a not in ("--report", "--dry-run")]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return _main(args, argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the runs saved checkpoints; the same command continues them", file=sys.stderr)
        return 130


def _main(args, argv) -> int:
    from megatron_dppo.config import load_config

    out_dir = resolve_paths(args)
    if args.parallel < 1 or args.threads < 1:
        raise ValueError("--parallel and --threads must be >= 1")
    base = load_config(args.config, list(args.override or []))
    prompts_per_step = args.prompts_per_step or base.trainer.prompts_per_step
    train_size = min(train_size_for(prompts_per_step, args.steps, args.visits), count_train_prompts(base))
    runs = plan(args, out_dir, train_size)
    cm.validate_runs(args.config, runs)
    cfg = load_config(args.config, runs[0].overrides)
    settings = settings_of(args, cfg, runs, train_size, argv)
    draws = prompts_per_step * args.steps / train_size
    print(
        f"{len(runs)} runs (GRPO, DPPO (0.5, 0.5) x seeds {settings['seeds']}), {args.steps} steps of "
        f"{prompts_per_step} prompts: data.train_size={train_size}, each prompt drawn {draws:.1f} times",
        flush=True,
    )
    if not args.dry_run:  # before anything reads or writes there
        claim_out_dir(out_dir)
    states = {r.name: run_state(r, args.steps) for r in runs}
    for r in runs:
        check_same_settings(r, states[r.name])
    if args.dry_run:
        for r in runs:
            state = states[r.name]
            print(
                f"{r.name:18s} [{state}] " + ("" if state == DONE else shlex.join(train_command(args.config, r, state)))
            )
        return 0
    rc = 0
    if not args.report:
        check_model(cfg)
        held = lock(out_dir)
        try:
            rc = 1 if execute(runs, args.config, args.steps, args)["failed"] else 0
        finally:
            held.close()
    result = report(runs, out_dir, args.steps, settings, args.png)
    print(markdown(result))
    unpruned = result["claim"]["dppo_runs_without_pruning"]
    if unpruned:
        print(f"WARNING: DPPO seed(s) {unpruned} pruned no prompt: not a measurement of the claim", file=sys.stderr)
    print(f"wrote {out_dir / 'claim.json'}, claim.md, claim.png")
    return rc


if __name__ == "__main__":
    sys.exit(main())
