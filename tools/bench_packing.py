"""Packing density and speed on RL-like length distributions (DPPO.md section 6).

A rollout batch: B prompts of 80-300 tokens (uniform), G completions each with log-normal
lengths (long tail) clipped to the max response length, then a random half of each group's
completions pruned as DPPO does (r_o = 0.5). Sequences arrive group by group.
For each capacity it prints, side by side: padded batching (rows padded to the batch's
longest; and per-micro-batch padding), first-fit-decreasing and the window greedy at several
windows: micro-batches, density, packing time, and the dp imbalance (max/mean estimated cost)
after balance_packs.

    .venv/bin/python tools/bench_packing.py [--prompts 1024] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from megatron_dppo.packing import balance_packs, density, dp_imbalance, pack, pack_ffd, pack_padded


def rollout_lengths(rng, prompts, group, max_response, median, sigma, keep_frac):
    prompt = rng.integers(80, 301, size=prompts)
    completion = np.clip(rng.lognormal(np.log(median), sigma, size=(prompts, group)), 1, max_response)
    lengths = []
    for q in range(prompts):
        kept = np.sort(rng.choice(group, size=int(round(group * keep_frac)), replace=False))
        lengths += [int(prompt[q] + completion[q, i]) for i in kept]
    return lengths


def timed(fn, *args, repeat=3):
    """(result, best wall ms of `repeat` runs): the minimum filters GC pauses and noise."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn(*args)
        best = min(best, 1e3 * (time.perf_counter() - t0))
    return out, best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-response", type=int, default=4096)
    ap.add_argument("--median", type=float, default=600.0, help="median completion length")
    ap.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma (tail weight)")
    ap.add_argument("--keep", type=float, default=0.5, help="fraction of completions kept")
    ap.add_argument("--capacities", type=int, nargs="+", default=[4608, 8192, 16384])
    ap.add_argument("--windows", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()

    lengths = rollout_lengths(np.random.default_rng(args.seed), args.prompts, args.group,
                              args.max_response, args.median, args.sigma, args.keep)
    n = len(lengths)
    print(f"{n} sequences ({args.prompts} prompts x {args.group}, keep {args.keep}); length "
          f"mean {np.mean(lengths):.0f} median {np.median(lengths):.0f} max {max(lengths)}, "
          f"{sum(lengths)} tokens; dp={args.dp}")

    methods = [("padded", lambda c: pack_padded(lengths, c)),
               ("padded/mb", lambda c: pack_padded(lengths, c, per_microbatch=True)),
               ("ffd", lambda c: pack_ffd(lengths, c))]
    methods += [(f"window={w}", lambda c, w=w: pack(lengths, c, w)) for w in args.windows]
    methods += [("window=all", lambda c: pack(lengths, c, n))]

    results = []
    for cap in args.capacities:
        print(f"\ncapacity {cap}")
        print(f"  {'method':<12}{'micro-batches':>14}{'density':>9}{'pack ms':>9}"
              f"{'mb/rank':>9}{'dp imbalance':>14}")
        for name, fn in methods:
            packs, ms = timed(fn, cap)
            ranks = balance_packs(packs, lengths, args.dp)
            row = dict(capacity=cap, method=name, micro_batches=len(packs),
                       density=density(lengths, packs, cap), pack_ms=ms,
                       mb_per_rank=len(ranks[0]), dp_imbalance=dp_imbalance(ranks, lengths))
            results.append(row)
            print(f"  {name:<12}{row['micro_batches']:>14}{row['density']:>9.4f}{ms:>9.1f}"
                  f"{row['mb_per_rank']:>9}{row['dp_imbalance']:>14.4f}")

    # Speed at the size the docs promise (~10k sequences).
    big = rollout_lengths(np.random.default_rng(args.seed + 1), 2500, args.group, args.max_response,
                          args.median, args.sigma, args.keep)
    timing = {}
    for w in [*args.windows, len(big)]:
        timing[w] = timed(pack, big, args.capacities[0], w)[1]
    print(f"\npack() on {len(big)} sequences, capacity {args.capacities[0]}: "
          + ", ".join(f"window={w if w < len(big) else 'all'} {ms:.0f} ms" for w, ms in timing.items()))

    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), num_sequences=n, results=results,
                           pack_ms_10k={str(w): ms for w, ms in timing.items()}), f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
