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

Staleness k >= 1 and partial rollouts (issue 46 item 5; plan_step.simulate_pipeline's model: a
round's bulk shrinks with rollout GPUs, its long tail does not; partial rollouts let the tail run
beside the next rounds' bulk):

    .venv/bin/python tools/simulate_rollout_ranks.py --staleness 2 --partial

first checks the model against verl's published fully async runs (their colocated and trainer
phase times as inputs, one tail share calibrated on the 128-GPU run, the other runs predicted),
with two controls that must miss (no tail; the tail without partial rollouts), then predicts the
Qwen3-32B shape with DPPO (0.7, 0.7) at k = 0, 1, 2, 4 with and without partial rollouts, each at
its balanced split. docs/scaling.md 2d has the output and what is assumed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_dppo.jobs.plan_step import (  # noqa: E402
    GB,
    AsyncInputs,
    StepInputs,
    async_step_times,
    balanced_split,
    colocated_step_s,
    simulate_pipeline,
    step_times,
    with_pruning,
)

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


# verl's fully async runs as published (verl docs/advance/fully_async.md, "Experiments":
# github.com/volcengine/verl at 2147009, the same tables in verl-project/verl, whose copy swaps
# the 32-GPU rows' update_actor cells; the values here are the self-consistent ones: the async
# step 294.77 cannot hold a 313.81 s update). Seconds per step, means over 400 steps on H20s.
# 7B: Qwen2.5-Math-7B, DAPO, max_response_length 28k, 512 prompts x 16, FSDP2 + vLLM (TP 4),
# fully async with staleness_threshold 0.5, partial_rollout, trigger_parameter_sync_step 4,
# require_batches 4; the rollout log-probs replace old_log_prob. 30B: Qwen3-30B-A3B-Base, GRPO,
# 8k, Megatron + vLLM, same async settings, ref on the trainer. published: colocated / async
# total time at 400 steps (the headline figure); the per-step ratio is within 2.5% of it.
VERL = [
    dict(
        shape="Qwen2.5-Math-7B, 32 GPUs",
        gpus=32,
        rollout_gpus=16,
        colocated=dict(step=790.10, gen=357.41, logprob=107.71, update=313.81),
        dedicated=dict(step=294.77, wait=21.26, update=269.80),
        published=2.66,
    ),
    dict(
        shape="Qwen2.5-Math-7B, 64 GPUs",
        gpus=64,
        rollout_gpus=32,
        colocated=dict(step=365.28, gen=150.72, logprob=70.26, update=133.41),
        dedicated=dict(step=189.26, wait=28.46, update=156.98),
        published=1.92,
    ),
    dict(
        shape="Qwen2.5-Math-7B, 128 GPUs",
        gpus=128,
        rollout_gpus=64,
        colocated=dict(step=356.30, gen=177.85, logprob=53.92, update=113.81),
        dedicated=dict(step=150.63, wait=33.14, update=113.16),
        published=2.35,
    ),
    dict(
        shape="Qwen3-30B-A3B, 128 GPUs",
        gpus=128,
        rollout_gpus=96,
        colocated=dict(step=497.89, gen=348.05, logprob=28.73, ref=20.86, update=86.27),
        dedicated=dict(step=282.75, wait=22.06, ref=50.05, update=206.63),
        published=1.72,
    ),
]
CALIBRATION_SHAPE = "Qwen2.5-Math-7B, 128 GPUs"
# verl's trainer takes whichever samples finish first; ours trains step r on round r. k = 2 with
# partial rollouts is the smallest round queue that keeps the engine fed at verl's 128-GPU shape.
CALIBRATION_SETTING = dict(staleness=2, partial=True)

# The paper's Qwen3-32B shape (DPPO r_q = r_o = 0.7: 2.02x colocated, docs/dppo.md) on the
# qwen3_32b_disagg preset's cluster, at docs/scaling.md 2d's illustrative rates (not measured):
# 32 GPUs, 128 prompts x 8, completions of mean 1536 of the 3072 cap (assumed), ~200 prompt tokens;
# colocated generation 922 tokens/s/GPU (from NeMo-RL's 571 end to end), training 1500 (MFU 0.40
# with the log-prob pass); 61.02 GiB of weights at 50 GB/s; tail share 1 - mean/cap = 0.5.
# DPPO (0.7, 0.7) as measured on the long-tailed task (docs/results.md): 0.68 of the prompts
# generated, 0.45 of the tokens trained.
QWEN3_32B = dict(gpus=32, split_multiple=8, sequences=128 * 8, mean_completion=1536, prompt_tokens=200)
DPPO_KEPT = dict(generated_kept=0.68, trained_kept=0.45)


def verl_prediction(row: dict, tail_share: float, staleness: int, partial: bool, steps=400, seed=0) -> dict:
    """The model's async step for one verl run: their colocated rollout split into bulk and tail by
    tail_share (bulk on N GPUs -> on R), their trainer's busy seconds a step (the async step less
    its wait: update, ref, the rest) as the training side; no weight move on top (verl syncs a 7B in
    0.12 s, and the trainer's step holds its sync)."""
    n, r = row["gpus"], row["rollout_gpus"]
    gen, ded = row["colocated"]["gen"], row["dedicated"]
    out = simulate_pipeline(
        rollout_s=(1 - tail_share) * gen * n / r,
        train_s=ded["step"] - ded["wait"],
        tail_s=tail_share * gen,
        staleness=staleness,
        partial=partial,
        steps=steps,
        seed=seed,
    )
    out["speedup"] = row["colocated"]["step"] / out["step_s"]
    return out


def calibrate_tail_share(row: dict, staleness: int, partial: bool) -> float:
    """The tail share at which the model's async step is the published one (bisection: the step
    falls as the share grows, the bulk left on the rollout GPUs shrinking)."""
    lo, hi = 0.0, 0.95
    for _ in range(40):
        mid = (lo + hi) / 2
        if verl_prediction(row, mid, staleness, partial)["step_s"] > row["dedicated"]["step"]:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def verl_check(staleness: int, partial: bool) -> dict:
    """Each verl run: published speed-up beside the model's at (staleness, partial) with the
    calibrated tail share, and the two controls: no tail (share 0), the tail without partial."""
    calib = next(r for r in VERL if r["shape"] == CALIBRATION_SHAPE)
    f = calibrate_tail_share(calib, **CALIBRATION_SETTING)
    rows = []
    for row in VERL:
        model = verl_prediction(row, f, staleness, partial)
        rows.append(
            dict(
                shape=row["shape"],
                split=[row["gpus"] - row["rollout_gpus"], row["rollout_gpus"]],
                published=row["published"],
                published_step_ratio=row["colocated"]["step"] / row["dedicated"]["step"],
                model=model["speedup"],
                model_step_s=model["step_s"],
                published_step_s=row["dedicated"]["step"],
                no_tail=verl_prediction(row, 0.0, staleness, partial)["speedup"],
                no_partial=verl_prediction(row, f, staleness, False)["speedup"],
                calibrated=row["shape"] == CALIBRATION_SHAPE,
            )
        )
    return dict(tail_share=f, staleness=staleness, partial=partial, rows=rows)


def print_verl_check(check: dict) -> None:
    k, partial = check["staleness"], check["partial"]
    print(
        f"verl's fully async runs against the model at k = {k}{', partial rollouts' if partial else ''}: tail share "
        f"f = {check['tail_share']:.3f}, calibrated on the {CALIBRATION_SHAPE} run at k = 2 with partial rollouts"
    )
    print(
        "| run | split (train + rollout) | published speed-up (per step) | model | model async step s (published) "
        f"| control: no tail (f = 0) | control: tail, no partial (k = {k}) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in check["rows"]:
        tag = " (calibration)" if r["calibrated"] else ""
        print(
            f"| {r['shape']}{tag} | {r['split'][0]} + {r['split'][1]} | {r['published']:.2f}x "
            f"({r['published_step_ratio']:.2f}x) | {r['model']:.2f}x | {r['model_step_s']:.1f} "
            f"({r['published_step_s']:.1f}) "
            f"| {r['no_tail']:.2f}x | {r['no_partial']:.2f}x |"
        )


def qwen3_32b_inputs(tail_share: float) -> tuple[AsyncInputs, AsyncInputs]:
    """(GRPO, DPPO (0.7, 0.7)) at the paper's Qwen3-32B shape (QWEN3_32B's comment)."""
    q = QWEN3_32B
    weights_s = 61.02 * (1 << 30) / (50 * GB)
    grpo = AsyncInputs(
        generated_tokens=q["sequences"] * q["mean_completion"],
        trained_tokens=q["sequences"] * (q["mean_completion"] + q["prompt_tokens"]),
        gen_tokens_per_s=922.0,
        train_tokens_per_s=1500.0,
        tail_share=tail_share,
        weights_s=weights_s,
    )
    return grpo, with_pruning(grpo, q["gpus"], **DPPO_KEPT)


def qwen3_32b_table(tail_share: float, steps: int, seed: int) -> dict:
    grpo, dppo = qwen3_32b_inputs(tail_share)
    n = QWEN3_32B["gpus"]
    out = dict(
        tail_share=tail_share,
        grpo_colocated_s=colocated_step_s(grpo, n),
        dppo_colocated_s=colocated_step_s(dppo, n),
        rows=[],
    )
    for k in (0, 1, 2, 4):
        for partial in (False, True):
            best = balanced_split(
                dppo, gpus=n, staleness=k, partial=partial, multiple=QWEN3_32B["split_multiple"], steps=steps, seed=seed
            )
            half = async_step_times(
                dppo, gpus=n, rollout_gpus=n // 2, staleness=k, partial=partial, steps=steps, seed=seed
            )
            out["rows"].append(
                dict(
                    staleness=k,
                    partial=partial,
                    half_step_s=half["step_s"],
                    rollout_gpus=best["rollout_gpus"],
                    step_s=best["step_s"],
                    trainer_wait_s=best["trainer_wait_s"],
                    lag_mean=best["lag_mean"],
                    lag_max=best["lag_max"],
                )
            )
    return out


def print_qwen3_32b(table: dict) -> None:
    n, g, d = QWEN3_32B["gpus"], table["grpo_colocated_s"], table["dppo_colocated_s"]
    print(
        f"Qwen3-32B, {n} GPUs, 128 prompts x 8, DPPO (0.7, 0.7) (inputs: tools/simulate_rollout_ranks.py "
        f"QWEN3_32B; tail share {table['tail_share']:.2f}): colocated GRPO {g:.1f} s a step, colocated DPPO "
        f"{d:.1f} s ({g / d:.2f}x)"
    )
    print(
        "| k | partial rollouts | 16 + 16 step s | balanced split (train + rollout) | step s there | trainer wait s "
        "| policy lag mean / max | vs colocated DPPO | vs colocated GRPO |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in table["rows"]:
        print(
            f"| {r['staleness']} | {'yes' if r['partial'] else 'no'} | {r['half_step_s']:.1f} | "
            f"{n - r['rollout_gpus']} + {r['rollout_gpus']} | {r['step_s']:.1f} | {r['trainer_wait_s']:.1f} | "
            f"{r['lag_mean']:.2f} / {r['lag_max']} | {d / r['step_s']:.2f}x | {g / r['step_s']:.2f}x |"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", nargs="?", help="tools/bench_rollout_ranks.py --out JSON (the staleness-1 table)")
    parser.add_argument("--staleness", type=int, help="k for the verl check (default 2; the async tables)")
    parser.add_argument("--partial", action="store_true", help="partial rollouts in the verl check")
    parser.add_argument("--tail-share", type=float, default=0.5, help="Qwen3-32B's tail share f (default 0.5)")
    parser.add_argument("--steps", type=int, default=200, help="simulated steps per Qwen3-32B row (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="the tail draws' seed (default 0)")
    parser.add_argument("--json", help="write the predictions here")
    args = parser.parse_args(argv)
    if args.staleness is not None and args.staleness < 0:
        parser.error(f"--staleness: expected an integer k >= 0, got {args.staleness}")
    if not 0 <= args.tail_share < 1:
        parser.error(f"--tail-share: expected 0 <= f < 1, got {args.tail_share}")
    if args.steps < 5:
        parser.error(f"--steps: expected an integer >= 5, got {args.steps}")
    result = {}
    if args.staleness is not None or args.bench is None:
        result["verl"] = verl_check(2 if args.staleness is None else args.staleness, args.partial)
        print_verl_check(result["verl"])
        print()
        result["qwen3_32b_dppo"] = qwen3_32b_table(args.tail_share, args.steps, args.seed)
        print_qwen3_32b(result["qwen3_32b_dppo"])
    if args.bench is not None:
        if result:
            print()
        result.update(bench_table(args.bench))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def bench_table(path: str) -> dict:
    """The staleness-1 table from a bench's measured rates (issue 32 item 4)."""
    with open(path) as f:
        bench = json.load(f)
    inp, moved = inputs_from_bench(bench)
    print(f"inputs (from {path}, commit {bench.get('meta', {}).get('commit', '?')}), per GPU and step:")
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
    return {"inputs": inp.__dict__, "moved": moved, "shapes": out}


if __name__ == "__main__":
    sys.exit(main())
