#!/usr/bin/env python
"""The numbers docs/results.md quotes that no generated table shows, computed from the committed
comparison JSONs (tools/compare_methods.py's docs/<name>.json), so that each has a command.

    # the most DPPO could save, from GRPO's own phase times (section "The goals, plainly")
    python tools/results_derived.py bound docs/results.json dppo-0.5-0.5 dppo-0.7-0.7
    # a method against another than GRPO (the paper's composition speedups are against the base)
    python tools/results_derived.py versus docs/results_paper_tables.json dapo:dapo-dppo-0.5-0.5

bound: a step's wall time is split as GRPO measured it into rollout, rewards, update (log-probs +
train) and the rest (weight sync, Python); rollout and rewards are scaled by the method's fraction of
prompts kept and the update by its trained tokens over GRPO's; the rest stays. GRPO's time over
that is the speedup a perfect implementation of the method's pruning could reach at equal steps.

versus: CPU-time speedup at equal steps with the delta-method standard error, the final-accuracy
difference with both standard errors in quadrature, and the speedup to the base's final accuracy by
the same monotone-fit rule as compare_methods' own table (`time_to_target`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: compare_methods beside this file

from compare_methods import time_to_target  # noqa: E402


def load_rows(path: str) -> dict[str, dict]:
    result = json.loads(Path(path).read_text())
    return {r["method"]: r for r in result["rows"]}


def bound(rows: dict[str, dict], methods: list[str]) -> list[str]:
    g = rows["grpo"]
    ph, total = g["phase_time_s"], g["train_time_s"]
    update = ph.get("logprob", 0.0) + ph["train"]
    rest = total - ph["rollout"] - ph["reward"] - update
    out = [
        f"GRPO: rollout / update / rewards + sync + other = {ph['rollout'] / total:.0%} / {update / total:.0%} / "
        f"{(total - ph['rollout'] - update) / total:.0%} of {total:.1f} s"
    ]
    for name in methods:
        m = rows[name]
        kept, tokens = m["prompts_kept_frac"], m["tokens_trained"] / g["tokens_trained"]
        t = (ph["rollout"] + ph["reward"]) * kept + update * tokens + rest
        out.append(f"{name}: prompts kept {kept:.2f}, trained tokens vs GRPO {tokens:.2f}: bound {total / t:.2f}x")
    return out


def versus(rows: dict[str, dict], pairs: list[str]) -> list[str]:
    out = []
    for pair in pairs:
        base, name = pair.split(":")
        b, r = rows[base], rows[name]
        s = b["train_cpu_s"] / r["train_cpu_s"]
        se = s * math.hypot(b["train_cpu_se"] / b["train_cpu_s"], r["train_cpu_se"] / r["train_cpu_s"])
        d = 100 * (r["acc_final"] - b["acc_final"])
        dse = 100 * math.hypot(r["acc_final_se"] or 0.0, b["acc_final_se"] or 0.0)
        target = b["curve"][-1]["acc_fit"]
        tt = [time_to_target([(p["train_cpu_s"], p["acc_fit"]) for p in x["curve"]], target) for x in (b, r)]
        eq = f"{tt[0] / tt[1]:.2f}x" if None not in tt else "never reaches it"
        out.append(
            f"{name} vs {base}: CPU {s:.2f}x +- {se:.2f}; acc {d:+.1f} +- {dse:.1f} points; "
            f"at {base}'s final accuracy ({100 * target:.1f}%): {eq}"
        )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("bound", "versus"))
    p.add_argument("json", help="a comparison's docs/<name>.json")
    p.add_argument("items", nargs="+", help="bound: method names; versus: base:method pairs")
    args = p.parse_args(argv)
    rows = load_rows(args.json)
    missing = sorted({n for item in args.items for n in item.split(":")} - set(rows))
    if missing:
        p.error(f"{args.json} has no rows for {', '.join(missing)} (it has {', '.join(rows)})")
    print("\n".join((bound if args.what == "bound" else versus)(rows, args.items)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
