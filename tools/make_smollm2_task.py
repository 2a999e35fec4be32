"""Write the SmolLM2 example's addition task as verl-layout Parquet files.

    python tools/make_smollm2_task.py            # examples/smollm2/data/{train,test}.parquet

Each row: {data_source, prompt: [{role: user, content}], ability, reward_model: {style: rule,
ground_truth}, extra_info: {split, index, a, b}}, the layout verl's data preprocessors write. The
problems are "What is a + b? Answer with just the number." with a, b drawn from [1, 49]; train and
test are disjoint (a problem is an ordered pair), deterministic in --seed. SmolLM2-135M-Instruct
answers ~40% of these right greedily and ~15% at temperature 1 (docs/results.md), so a group of 8
usually holds both rewards: what GRPO needs to learn from, and what DPPO prunes among.
"""

from __future__ import annotations

import argparse
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_SOURCE = "smollm2/addition"
TEMPLATE = "What is {a} + {b}? Answer with just the number."


def problems(seed: int, lo: int, hi: int, sizes: dict[str, int]) -> dict[str, list[tuple[int, int]]]:
    pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
    if sum(sizes.values()) > len(pairs):
        raise SystemExit(
            f"error: {sum(sizes.values())} problems asked, only {len(pairs)} distinct pairs in [{lo}, {hi}]"
        )
    random.Random(seed).shuffle(pairs)
    out, start = {}, 0
    for split, n in sizes.items():
        out[split], start = pairs[start : start + n], start + n
    return out


def rows(split: str, pairs: list[tuple[int, int]]) -> list[dict]:
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": TEMPLATE.format(a=a, b=b)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": i, "a": a, "b": b},
        }
        for i, (a, b) in enumerate(pairs)
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(REPO, "examples", "smollm2", "data"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lo", type=int, default=1)
    p.add_argument("--hi", type=int, default=49)
    p.add_argument("--train", type=int, default=1800)
    p.add_argument("--test", type=int, default=200)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for split, pairs in problems(args.seed, args.lo, args.hi, {"train": args.train, "test": args.test}).items():
        path = os.path.join(args.out, f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist(rows(split, pairs)), path)
        print(f"wrote {path}: {len(pairs)} problems")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
