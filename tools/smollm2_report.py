"""Report of side-by-side runs of examples/smollm2 (GRPO and DPPO from the same start).

    python tools/smollm2_report.py --runs runs/smollm2-addition-grpo runs/smollm2-addition-dppo \
        [--rss peak_rss.json] [--png docs/results_smollm2.png]

Reads each run's metrics.jsonl (the trainer's rows) and prints a Markdown table: held-out avg@n and
pass@k of the eval section at the first and the last evaluation, steps done, mean step time and its
phases, generated tokens per rollout second, trained tokens per train second, and the peak RSS of
the run's process tree when --rss names a {run name: GiB} JSON file (sampled outside the trainer).
The PNG shows held-out avg@n and the train reward against step and against cumulative step time.
Nothing is stored or compared from elsewhere: every number comes from the runs named.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_dppo.run.log import read_metrics  # noqa: E402

PHASES = ("rollout", "reward", "logprob", "train", "sync")


def eval_rows(rows: list[dict], prefix: str) -> list[dict]:
    return [r for r in rows if any(k.startswith(prefix) for k in r)]


def summarize(run_dir: str, set_name: str) -> dict:
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    steps = [r for r in rows if "time/step" in r]
    prefix = f"val/{set_name}/all/"
    evals = eval_rows(rows, prefix)
    if not steps or len(evals) < 2:
        raise SystemExit(f"error: {run_dir}: needs training steps and at least 2 evaluations of set {set_name!r}")
    metrics = sorted(k[len(prefix) :] for k in evals[-1] if k.startswith(prefix))
    total = sum(r["time/step"] for r in steps)
    return {
        "name": os.path.basename(os.path.normpath(run_dir)),
        "steps": len(steps),
        "first": {m: evals[0][prefix + m] for m in metrics},
        "last": {m: evals[-1][prefix + m] for m in metrics},
        "last_step": evals[-1]["step"],
        "step_s": total / len(steps),
        "phases": {p: sum(r.get(f"time/{p}", 0.0) for r in steps) / len(steps) for p in PHASES},
        "gen_tok_s": sum(r["tokens/generated"] for r in steps) / max(1e-9, sum(r["time/rollout"] for r in steps)),
        "train_tok_s": sum(r.get("tokens/trained", 0) for r in steps) / max(1e-9, sum(r["time/train"] for r in steps)),
        "train_s": total,
        "curve": [(r["step"], r[prefix + metrics[0]]) for r in evals],
        "rows": steps,
    }


def table(runs: list[dict], rss: dict) -> str:
    metrics = list(runs[0]["last"])
    head = ["run", "steps", *[f"{m} start -> end" for m in metrics], "s/step", *[f"{p} s" for p in PHASES]]
    head += ["gen tok/s", "train tok/s", "step time total s", "peak RSS GiB"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        cells = [r["name"], str(r["steps"])]
        cells += [f"{r['first'][m]:.3f} -> {r['last'][m]:.3f}" for m in metrics]
        cells += [f"{r['step_s']:.1f}", *[f"{r['phases'][p]:.1f}" for p in PHASES]]
        cells += [f"{r['gen_tok_s']:.0f}", f"{r['train_tok_s']:.0f}", f"{r['train_s']:.0f}"]
        cells.append(f"{rss[r['name']]:.2f}" if r["name"] in rss else "-")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(runs: list[dict], png: str, set_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in runs:
        cum, t = {}, 0.0
        for row in r["rows"]:
            t += row["time/step"]
            cum[row["step"]] = t
        xs_step = [s for s, _ in r["curve"]]
        ys = [v for _, v in r["curve"]]
        line = axes[0].plot(xs_step, ys, "o-", label=f"{r['name']} held-out")[0]
        axes[0].plot(
            [w["step"] for w in r["rows"]], [w["reward/mean"] for w in r["rows"]], alpha=0.35, color=line.get_color()
        )
        axes[1].plot([cum.get(s, 0.0) for s in xs_step], ys, "o-", color=line.get_color(), label=r["name"])
    metric = next(iter(runs[0]["last"]))
    axes[0].set_xlabel("step")
    axes[0].set_ylabel(f"{set_name} {metric} (dots); train reward (faint)")
    axes[1].set_xlabel("cumulative step time (s)")
    axes[1].set_ylabel(f"{set_name} {metric}")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", nargs="+", required=True)
    p.add_argument("--set", default="test", help="the eval set's name (eval.sets)")
    p.add_argument("--rss", default="", help="JSON {run name: peak RSS GiB}")
    p.add_argument("--png", default="")
    args = p.parse_args(argv)
    runs = [summarize(d, args.set) for d in args.runs]
    rss = json.load(open(args.rss)) if args.rss else {}
    print(table(runs, rss))
    if args.png:
        plot(runs, args.png, args.set)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
