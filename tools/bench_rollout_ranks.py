"""Colocated against dedicated rollout ranks, side by side in one run of this tool (issue 32 item 4).

`megatron-dppo train` runs of one config under torchrun with 2 processes, one after the
other, each with one thread per process:

  colocated   parallel.rollout_ranks=0: DP=2, an engine per rank; every rank generates, then trains
  staleness0  parallel.rollout_ranks=1: 1 training + 1 rollout rank; the rollout waits for the weights
  staleness1  ... trainer.max_staleness=1 (tis): step t+1 rolls out while step t trains
  staleness2, staleness4  ... trainer.max_staleness=k: the next k steps' rounds queued on the rollout rank
  staleness1-partial, staleness2-partial  ... and rollout.partial=true: weights that arrive mid-round
              take over between 64-token chunks

each for every method of --methods (e.g. grpo,dppo: pruning.strategy none / dppo on the config),

and a table of what each measured: seconds per step and per phase (the trainer's own phases; for
dedicated ranks rollout and reward are the engine's time and `rollout wait` the trainer's idle
time, `engine idle` the rollout rank's), the idle share of each kind of rank, held-out accuracy
before and after, accuracy gained per step and per minute, and the off-policy gap (rollout KL,
updates behind). On this 2-core machine the split gives generation one core and training one,
where colocated DP=2 gives each phase both in turn: what the ratio means is in docs/scaling.md 2d.

    .venv/bin/python tools/bench_rollout_ranks.py --config examples/tiny/longtail.yaml --steps 30 \
        --out docs/results_rollout_ranks.json

`tools/simulate_rollout_ranks.py` takes the JSON to the published GPU shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_dppo.run.log import read_metrics  # noqa: E402
from megatron_dppo.run.process import free_port  # noqa: E402

RUNS = {
    "colocated": [],
    "staleness0": ["parallel.rollout_ranks=1"],
    "staleness1": ["parallel.rollout_ranks=1", "trainer.max_staleness=1", "algorithm.rollout_correction=tis"],
    "staleness2": ["parallel.rollout_ranks=1", "trainer.max_staleness=2", "algorithm.rollout_correction=tis"],
    "staleness4": ["parallel.rollout_ranks=1", "trainer.max_staleness=4", "algorithm.rollout_correction=tis"],
    "staleness1-partial": [
        "parallel.rollout_ranks=1",
        "trainer.max_staleness=1",
        "algorithm.rollout_correction=tis",
        "rollout.partial=true",
    ],
    "staleness2-partial": [
        "parallel.rollout_ranks=1",
        "trainer.max_staleness=2",
        "algorithm.rollout_correction=tis",
        "rollout.partial=true",
    ],
}
# --methods: the method's overrides on top of the config (its own method is "config")
METHODS = {"config": [], "grpo": ["pruning.strategy=none"], "dppo": ["pruning.strategy=dppo"]}
PHASES = ("rollout", "reward", "logprob", "train", "sync", "rollout_wait", "engine_idle")


def run_one(name: str, args, out_dir: str, method: str = "config") -> dict:
    label = name if method == "config" else f"{method}-{name}"
    overrides = [
        f"trainer.output_dir={out_dir}",
        f"trainer.run_name={label}",
        f"trainer.max_steps={args.steps}",
        "trainer.max_time_s=0",
        f"trainer.eval_every={args.steps}",
        "trainer.save_every=0",
        "trainer.save_every_minutes=0",
        "trainer.threads=1",
        "logging.wandb=disabled",
        "logging.tensorboard=false",
        "logging.progress=false",
        *RUNS[name],
        *METHODS[method],
        *args.overrides,
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"]
    cmd += [f"--master_port={free_port()}", "-m", "megatron_dppo.cli", "train", "--config", args.config, *overrides]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"bench_rollout_ranks: run {label} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    rows = read_metrics(os.path.join(out_dir, label, "metrics.jsonl"))
    return summarize(label, rows, wall, " ".join(cmd[cmd.index("train") :]))


def summarize(name: str, rows: list[dict], wall: float, command: str) -> dict:
    steps = [r for r in rows if "time/step" in r]
    # The steady state: step 1 pays the engines' warm-up and, at staleness 1, rolls out its own
    # round; the last step has no next round in flight. Each step's rollout is the engines' time
    # for the completions it trains on.
    later = steps[1:-1] if len(steps) >= 3 else steps
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]

    def mean(key, of=later):
        vals = [r.get(key, 0.0) for r in of]
        vals = [v for v in vals if v is not None]
        return statistics.fmean(vals) if vals else 0.0

    step_s = mean("time/step")
    out = {
        "run": name,
        "command": command,
        "steps": len(steps),
        "wall_s": wall,
        "train_s": sum(r["time/step"] for r in steps),
        "step_s": step_s,  # steady state (steps 2 .. N-1)
        "phases_s": {p: mean(f"time/{p}") for p in PHASES},
        "eval": evals,
        "reward_mean": [r["reward/mean"] for r in steps],
        "generated_tokens": mean("tokens/generated"),
        "trained_tokens": mean("tokens/trained"),
        "rollout_kl_k3": mean("train/rollout_kl_k3"),
        "rollout_ratio_max": max((r.get("train/rollout_ratio_max") or 0.0) for r in later),
        "policy_lag": mean("rollout/policy_lag_mean"),
        "weight_switched": mean("rollout/weight_switched_frac"),  # rollout.partial: completions that changed weights
    }
    out["idle_train"] = out["phases_s"]["rollout_wait"] / step_s if step_s else 0.0
    out["idle_rollout"] = out["phases_s"]["engine_idle"] / step_s if step_s else 0.0
    if len(evals) >= 2:
        gain = evals[-1][1] - evals[0][1]
        out["acc_gain_per_step"] = gain / len(steps)
        out["acc_gain_per_min"] = gain / (out["train_s"] / 60)
    return out


def table(results: list[dict]) -> str:
    head = (
        "| run | steps | s/step | rollout | reward | logprob | train | sync | rollout wait | engine idle "
        "| idle train / rollout | held-out acc | gain/step | gain/min | rollout KL k3 | updates behind |"
    )
    lines = [head, "|" + "---|" * 16]
    base = results[0]["step_s"]
    for r in results:
        p = r["phases_s"]
        acc = " -> ".join(f"{a:.3f}" for _, a in (r["eval"][0], r["eval"][-1])) if r["eval"] else "-"
        lines.append(
            f"| {r['run']} | {r['steps']} | {r['step_s']:.2f} ({base / r['step_s']:.2f}x) | {p['rollout']:.2f} | "
            f"{p['reward']:.2f} | {p['logprob']:.2f} | {p['train']:.2f} | {p['sync']:.2f} | {p['rollout_wait']:.2f} | "
            f"{p['engine_idle']:.2f} | {r['idle_train']:.0%} / {r['idle_rollout']:.0%} | {acc} | "
            f"{r.get('acc_gain_per_step', 0):+.4f} | {r.get('acc_gain_per_min', 0):+.4f} | {r['rollout_kl_k3']:.2e} | "
            f"{r['policy_lag']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="examples/tiny/longtail.yaml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {list(RUNS)}")
    parser.add_argument("--methods", default="config", help=f"comma-separated, of {list(METHODS)}")
    parser.add_argument("--work-dir", default="runs/bench_rollout_ranks")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides for every run")
    args = parser.parse_args(argv)
    names = args.runs.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"--runs: unknown run {unknown[0]!r}; expected some of {list(RUNS)}")
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown method {unknown[0]!r}; expected some of {list(METHODS)}")
    results = []
    for method in methods:
        for name in names:
            results.append(run_one(name, args, os.path.abspath(args.work_dir), method))
            print(f"{results[-1]['run']}: {results[-1]['steps']} steps, {results[-1]['step_s']:.2f} s/step", flush=True)
    print(table(results))
    if args.out:
        git = dict(cwd=REPO, capture_output=True, text=True)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], **git).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], **git).stdout.strip()
        meta = {"commit": commit, "clean": not dirty, "argv": sys.argv}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
