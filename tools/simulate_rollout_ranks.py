"""From phase times measured here to the GPU shapes others published (issue 32 item 4): what the
step-time model of `megatron-dppo plan` (megatron_dppo/jobs/plan_step.py) predicts for
colocated against dedicated rollout ranks at staleness 1, with its inputs taken from
tools/bench_rollout_ranks.py's JSON, printed beside the peers' published speed-ups.

Inputs, per GPU and per step, from the bench's steady state (steps 2 .. N-1):
  g   colocated generation rate: generated tokens / (rollout s x 2 GPUs)
  g'  dedicated generation rate: generated tokens / (the rollout rank's rollout s x 1 GPU), at
      staleness 0 (its engine generates the whole batch: the long tail is paid once per batch,
      not once per engine)
  t, t'  training rates (log-prob + update) colocated (2 GPUs) and on the dedicated trainer (1)
  sync, transfer  the measured weight-move seconds, kept as they are at every shape (the tiny
      model's weights; a real model's move is in plan's own table, docs/scaling.md 2d)
Each shape keeps the measured tokens per GPU (the batch grows with the GPUs), the only way the
same rates apply. Nothing here is a measurement at those shapes: it says what the measured
ratio of rollout to training work, and the measured dedicated-engine gain, would give there.

    .venv/bin/python tools/simulate_rollout_ranks.py docs/results_rollout_ranks.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_dppo.jobs.plan_step import GB, StepInputs, step_times  # noqa: E402

# Published one-step-off / asynchronous speed-ups over synchronous colocated runs (issue 32's list;
# read from the peers' docs and papers, not re-measured): (who, model, GPUs colocated, rollout +
# train split or None when not stated, speed-up).
PEERS = [
    ("verl fully_async", "Qwen3-30B-A3B, 8k responses", 128, (96, 32), 1.72),
    ("NeMo-RL async GRPO", "Qwen3-30B-A3B, 32 H100 (1102 -> 1414 tokens/s/GPU)", 32, None, 1414 / 1102),
    ("AReaL", "1.5B", None, None, 2.77),
]


def inputs_from_bench(bench: dict) -> tuple[StepInputs, dict]:
    runs = {r["run"]: r for r in bench["results"]}
    colo, ded = runs["colocated"], runs["staleness0"]
    pc, pd = colo["phases_s"], ded["phases_s"]
    per_gpu_gen, per_gpu_train = colo["generated_tokens"] / 2, colo["trained_tokens"] / 2
    inp = StepInputs(
        generated_tokens=int(round(per_gpu_gen)),
        trained_tokens=int(round(per_gpu_train)),
        gen_tokens_per_s=colo["generated_tokens"] / (pc["rollout"] * 2),
        train_tokens_per_s=colo["trained_tokens"] / ((pc["logprob"] + pc["train"]) * 2),
        dedicated_gen_tokens_per_s=ded["generated_tokens"] / pd["rollout"],
        dedicated_train_tokens_per_s=ded["trained_tokens"] / (pd["logprob"] + pd["train"]),
        transfer_gb_per_s=1.0,  # with weight_bytes = the measured seconds x 1 GB/s: the measured move
        sync_gb_per_s=pd["sync"] / pc["sync"] if pc["sync"] else 1.0,  # W / Bc = the colocated sync time
        sources={"bench": bench.get("meta", {})},
    )
    return inp, {"transfer_s": pd["sync"], "sync_s": pc["sync"]}


def simulate(inp: StepInputs, moved: dict, gpus: int, rollout_gpus: int) -> dict:
    scaled = StepInputs(**{**inp.__dict__, "generated_tokens": inp.generated_tokens * gpus})
    scaled.trained_tokens = inp.trained_tokens * gpus
    return step_times(scaled, gpus=gpus, rollout_gpus=rollout_gpus, weight_bytes=moved["transfer_s"] * GB)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", help="tools/bench_rollout_ranks.py --out JSON")
    parser.add_argument("--json", help="write the predictions here")
    args = parser.parse_args(argv)
    with open(args.bench) as f:
        bench = json.load(f)
    inp, moved = inputs_from_bench(bench)
    print(f"inputs (from {args.bench}, commit {bench.get('meta', {}).get('commit', '?')}), per GPU and step:")
    print(
        f"  generated {inp.generated_tokens} tokens, trained {inp.trained_tokens} tokens; generation "
        f"{inp.gen_tokens_per_s:.0f} tokens/s colocated, {inp.dedicated_gen_tokens_per_s:.0f} dedicated "
        f"(g'/g = {inp.dedicated_gen_tokens_per_s / inp.gen_tokens_per_s:.2f}); training "
        f"{inp.train_tokens_per_s:.0f} colocated, {inp.dedicated_train_tokens_per_s:.0f} dedicated; weight move "
        f"{moved['transfer_s']:.3f} s dedicated, {moved['sync_s']:.3f} s colocated"
    )
    out = []
    print(
        "| shape | colocated step s | dedicated split | staleness-1 step s | predicted speed-up | balanced split "
        "(rollout GPUs) | speed-up there | published |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for who, what, gpus, split, published in PEERS:
        if gpus is None:
            print(f"| {who}: {what} | - | - | - | - | - | - | {published:.2f}x (shape not stated) |")
            continue
        rollout_gpus = split[0] if split else gpus // 2
        st = simulate(inp, moved, gpus, rollout_gpus)
        colo, stale = st["rows"]["colocated"]["step_s"], st["rows"]["staleness 1"]["step_s"]
        balanced = st["balanced_rollout_gpus"]
        best = colo / st["balanced_step_s"]
        shown = f"{gpus - rollout_gpus}+{rollout_gpus}" + ("" if split else " (not stated: half)")
        print(
            f"| {who}: {what} | {colo:.2f} | {shown} | {stale:.2f} | {colo / stale:.2f}x | {balanced:.1f} | "
            f"{best:.2f}x | {published:.2f}x |"
        )
        out.append(
            dict(
                who=who,
                gpus=gpus,
                split=[gpus - rollout_gpus, rollout_gpus],
                colocated_s=colo,
                staleness1_s=stale,
                speedup=colo / stale,
                balanced_rollout_gpus=balanced,
                balanced_speedup=best,
                published=published,
            )
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"inputs": inp.__dict__, "moved": moved, "shapes": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
