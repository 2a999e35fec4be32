"""The SEED methods' own claims, in shape, from a tools/compare_methods.py output dir.

    python tools/methods_report.py --runs runs/compare-methods [--methods grpo,bppo,...]

Reads each run's metrics.jsonl and validation dumps (<run>/val/step_N.jsonl) and prints, per method
(mean and standard error over its seeds):
  final     held-out greedy accuracy at the last evaluation (all problems)
  hard      the same on the problems the START model got wrong (its step-0 dump): AdaPrefix's
            "hardest prompts"
  length    mean completion length over the first and the last 10 steps: BPPO's "shorter responses"
  tokens    tokens trained per step (prompt + completion: AdaPrefix's prefix tokens count), the
            FLOP proxy for "equal FLOPs" (training FLOPs are proportional to them at a fixed model)
  aux       SSOPD's aux loss over the first and the last 10 steps ("the aux loss falls")
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from compare_methods import _mean, _se, read_metrics  # tools/: this script's own folder


def _mean_se(xs):
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return _mean(xs), _se(xs)


def _fmt(pair, spec="{:.3f}"):
    m, se = pair
    if m is None:
        return "-"
    return spec.format(m) + ("" if se is None else " +- " + spec.format(se))


def run_summary(run: Path) -> dict:
    rows = read_metrics(run / "metrics.jsonl")
    steps = [r for r in rows if "time/step" in r]
    dumps = sorted((run / "val").glob("step_*.jsonl"))
    start = {r["prompt_id"]: r["correct"] for r in map(json.loads, dumps[0].read_text().splitlines())}
    last = [json.loads(line) for line in dumps[-1].read_text().splitlines()]
    hard = [r["correct"] for r in last if not start.get(r["prompt_id"], True)]

    def window(key, part):
        vals = [r[key] for r in (steps[:10] if part == "first" else steps[-10:]) if key in r]
        return statistics.fmean(vals) if vals else None

    return {
        "final": sum(r["correct"] for r in last) / len(last),
        "hard": sum(hard) / len(hard) if hard else None,
        "length_first": window("completion/mean_length", "first"),
        "length_last": window("completion/mean_length", "last"),
        "tokens": statistics.fmean(r.get("tokens/trained", 0) for r in steps),
        "aux_first": window("train/aux_loss", "first"),
        "aux_last": window("train/aux_loss", "last"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", required=True, help="the compare_methods output dir (<method>-s<seed> runs)")
    ap.add_argument("--methods", default="grpo,bppo,bppo-dppo-0.5,reco,adaprefix,ssopd,ssopd-dppo-0.5-0.5")
    args = ap.parse_args()
    root = Path(args.runs)
    head = "| method | final acc | acc on the start model's wrong problems | length first -> last 10 steps | "
    print(head + "tokens trained / step | aux loss first -> last |")
    print("|---|---:|---:|---:|---:|---:|")
    for method in args.methods.split(","):
        runs = sorted(p for p in root.glob(f"{method}-s*") if (p / "metrics.jsonl").exists())
        if not runs:
            continue
        s = [run_summary(r) for r in runs]
        col = {k: _mean_se([x[k] for x in s]) for k in s[0]}
        aux_first, aux_last = _fmt(col["aux_first"], "{:.4f}"), _fmt(col["aux_last"], "{:.4f}")
        no_aux = col["aux_first"][0] is None or col["aux_first"][0] == col["aux_last"][0] == 0
        aux = "-" if no_aux else f"{aux_first} -> {aux_last}"
        print(
            f"| {method} ({len(runs)} seeds) | {_fmt(col['final'])} | {_fmt(col['hard'])} | "
            f"{_fmt(col['length_first'], '{:.1f}')} -> {_fmt(col['length_last'], '{:.1f}')} | "
            f"{_fmt(col['tokens'], '{:.0f}')} | {aux} |"
        )


if __name__ == "__main__":
    main()
