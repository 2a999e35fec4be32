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
  (--json only: group_size, the mean completions drawn per group: fewer than G under BPPO's waves)
and a second table of the methods' own logs, per step window (--windows, default 33-75,76-120: after
the first epoch of addition's 1024 prompts, the controller's rise and its withdrawal):
  AdaPrefix adaprefix/assisted_success (what the controller steers toward 0.5), assisted_frac and
            prefix_tokens_mean
  BPPO      bppo/pair_abs_adv and bppo/group_abs_adv (mean |A| of the pair and of its group), pairs
            per step, and the trained prefix lengths' histogram (bppo/prefix_len/<bucket>, summed
            over all steps, as shares)
--json writes every number of both tables.
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


def run_summary(run: Path, windows: list[tuple[int, int]]) -> dict:
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
        "method_logs": method_logs(steps, windows),
        "final": sum(r["correct"] for r in last) / len(last),
        "hard": sum(hard) / len(hard) if hard else None,
        "length_first": window("completion/mean_length", "first"),
        "length_last": window("completion/mean_length", "last"),
        "tokens": statistics.fmean(r.get("tokens/trained", 0) for r in steps),
        "aux_first": window("train/aux_loss", "first"),
        "aux_last": window("train/aux_loss", "last"),
        # completions drawn per group: G, or fewer under BPPO's waves (a group stops once mixed)
        "group_size": statistics.fmean(r["rollout/group_size"] for r in steps)
        if steps and all("rollout/group_size" in r for r in steps)
        else None,
    }


def method_logs(steps: list[dict], windows: list[tuple[int, int]]) -> dict:
    """AdaPrefix's and BPPO's per-step logs, averaged over each step window [lo, hi] (steps that
    logged the key only: assisted_success is absent when no group was assisted)."""
    out: dict = {}
    for key in ("adaprefix/assisted_success", "adaprefix/assisted_frac", "adaprefix/prefix_tokens_mean"):
        for lo, hi in windows:
            vals = [r[key] for r in steps if lo <= r.get("step", -1) <= hi and key in r]
            if vals:
                out[f"{key}@{lo}-{hi}"] = statistics.fmean(vals)
    for key in ("bppo/pair_abs_adv", "bppo/group_abs_adv", "bppo/pairs"):
        vals = [r[key] for r in steps if key in r]
        if vals:
            out[key] = statistics.fmean(vals)
    buckets: dict[str, float] = {}
    for r in steps:
        for k, v in r.items():
            if k.startswith("bppo/prefix_len/"):
                buckets[k.removeprefix("bppo/prefix_len/")] = buckets.get(k.removeprefix("bppo/prefix_len/"), 0) + v
    total = sum(buckets.values())
    if total:
        out.update({f"bppo/prefix_len_share/{k}": v / total for k, v in buckets.items()})
    return out


def _log_order(key: str):
    """Histogram buckets by their lower edge ("bppo/prefix_len_share/16-31" after ".../8-15")."""
    head, _, bucket = key.rpartition("/")
    return (head, int(bucket.split("-")[0])) if bucket[:1].isdigit() else (key, 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", required=True, help="the compare_methods output dir (<method>-s<seed> runs)")
    ap.add_argument("--methods", default="grpo,bppo,bppo-dppo-0.5,reco,adaprefix,ssopd,ssopd-dppo-0.5-0.5")
    ap.add_argument("--windows", default="33-75,76-120", help="step windows [lo-hi] of the method-log table")
    ap.add_argument("--json", help="write every number of both tables here")
    args = ap.parse_args()
    windows = [tuple(int(x) for x in w.split("-")) for w in args.windows.split(",")]
    root = Path(args.runs)
    report: dict = {"runs": str(root), "windows": args.windows, "methods": {}}
    logs_rows = []
    head = "| method | final acc | acc on the start model's wrong problems | length first -> last 10 steps | "
    print(head + "tokens trained / step | aux loss first -> last |")
    print("|---|---:|---:|---:|---:|---:|")
    for method in args.methods.split(","):
        runs = sorted(p for p in root.glob(f"{method}-s*") if (p / "metrics.jsonl").exists())
        if not runs:
            continue
        s = [run_summary(r, windows) for r in runs]
        col = {k: _mean_se([x[k] for x in s]) for k in s[0] if k != "method_logs"}
        keys = sorted({k for x in s for k in x["method_logs"]}, key=_log_order)
        logs = {k: _mean_se([x["method_logs"].get(k) for x in s]) for k in keys}
        report["methods"][method] = {"seeds": [r.name for r in runs], "per_run": s, "mean_se": {**col, **logs}}
        if logs:
            shown = {k: v for k, v in logs.items() if v[0]}  # empty histogram buckets left out of the table
            logs_rows.append(f"| {method} | " + "; ".join(f"{k} {_fmt(v)}" for k, v in shown.items()) + " |")
        aux_first, aux_last = _fmt(col["aux_first"], "{:.4f}"), _fmt(col["aux_last"], "{:.4f}")
        no_aux = col["aux_first"][0] is None or col["aux_first"][0] == col["aux_last"][0] == 0
        aux = "-" if no_aux else f"{aux_first} -> {aux_last}"
        print(
            f"| {method} ({len(runs)} seeds) | {_fmt(col['final'])} | {_fmt(col['hard'])} | "
            f"{_fmt(col['length_first'], '{:.1f}')} -> {_fmt(col['length_last'], '{:.1f}')} | "
            f"{_fmt(col['tokens'], '{:.0f}')} | {aux} |"
        )
    if logs_rows:
        print("\n| method | its own logs (mean +- SE over seeds; @lo-hi = mean over steps lo..hi) |\n|---|---|")
        print("\n".join(logs_rows))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
