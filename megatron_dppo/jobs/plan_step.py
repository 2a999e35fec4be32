"""`megatron-dppo plan`'s step time: colocated against dedicated rollout ranks (parallel.rollout_ranks),
from per-phase throughput measured on a run. Nothing here is measured: every number comes from
the inputs, which the plan prints beside the result.

Inputs (plan's flags; docs/scaling.md, "Dedicated rollout ranks"):
  G   generated tokens per step (the trainer's tokens/generated; default the cap,
      prompts_per_step x group_size x rollout.max_new_tokens)
  T   trained tokens per step (tokens/trained; default prompts_per_step x group_size x
      rollout.max_model_len)
  g   generation rate: generated tokens/s per GPU, colocated (tokens/generated / time/rollout / GPUs)
  t   training rate: trained tokens/s per GPU over the log-prob and update passes, colocated
      (tokens/trained / (time/logprob + time/train) / GPUs)
  g', t'  the same rates on a dedicated rollout GPU and a dedicated training GPU (default g and t):
      a dedicated engine has the whole GPU for its KV cache and never sleeps or reloads, a training
      GPU holds no vLLM share; measure them where they differ
  B   GB/s of the weight transfer from the training to the rollout ranks
  Bc  GB/s of the colocated weight sync (default B)

With N GPUs in all, R of them rollout ranks and N - R training ranks, W the weights' bytes in
model.dtype (what the sync sends; with model.lora the adapters' only, plan.sync_bytes_per_step):

  colocated                 G / (g N) + T / (t N) + W / Bc
  dedicated, staleness 0    G / (g' R) + T / (t' (N - R)) + W / B    (generation waits for the new weights)
  dedicated, staleness 1    max(G / (g' R), T / (t' (N - R))) + W / B   (step t+1's rollout overlaps
                            step t's training; the weights move between the two)

Balanced split: both sides take as long at R = N a / (a + b), a = G / g', b = T / t'; the
staleness-1 step is then (a + b) / N + W / B, its best at N GPUs. With g' = g and t' = t that is
the colocated step with the sync swapped for the transfer: max(a / R, b / (N - R)) >= (a + b) / N
for every R, so in this model dedicated ranks gain only what their GPUs do faster (g' > g,
t' > t: the tail of a long-tailed rollout no longer idles the training GPUs, a larger KV cache)
or a cheaper weight move. Assumed: a GPU's rates do not change with the number of GPUs (an
engine's batch, the training DP do change them: measure at the layout you plan); reward scoring
and the host's work between phases are left out of every row alike.
"""

from __future__ import annotations

import dataclasses

GB = 1e9  # bandwidths in GB/s, as interconnects are quoted


@dataclasses.dataclass
class StepInputs:
    generated_tokens: int
    trained_tokens: int
    gen_tokens_per_s: float  # per GPU, colocated
    train_tokens_per_s: float  # per GPU, log-prob + update, colocated
    dedicated_gen_tokens_per_s: float | None = None  # per dedicated rollout GPU; None: gen_tokens_per_s
    dedicated_train_tokens_per_s: float | None = None  # per dedicated training GPU; None: train_tokens_per_s
    transfer_gb_per_s: float | None = None  # training -> rollout ranks
    sync_gb_per_s: float | None = None  # colocated; None: transfer_gb_per_s
    sources: dict = dataclasses.field(default_factory=dict)  # input -> where it came from (printed)


def check_inputs(inp: StepInputs, disaggregated: bool) -> None:
    """ValueError naming the flag of an input that cannot be used."""
    for flag, value in (
        ("--generated-tokens", inp.generated_tokens),
        ("--trained-tokens", inp.trained_tokens),
        ("--gen-tokens-per-s", inp.gen_tokens_per_s),
        ("--train-tokens-per-s", inp.train_tokens_per_s),
        ("--dedicated-gen-tokens-per-s", inp.dedicated_gen_tokens_per_s),
        ("--dedicated-train-tokens-per-s", inp.dedicated_train_tokens_per_s),
        ("--transfer-gb-per-s", inp.transfer_gb_per_s),
        ("--sync-gb-per-s", inp.sync_gb_per_s),
    ):
        if value is not None and not value > 0:
            raise ValueError(f"{flag}: expected a number > 0, got {value}")
    if inp.sync_gb_per_s is None and inp.transfer_gb_per_s is None:
        need = "--transfer-gb-per-s" if disaggregated else "--sync-gb-per-s (or --transfer-gb-per-s)"
        raise ValueError(f"{need}: the step time needs the weight transfer's measured bandwidth in GB/s")
    if disaggregated and inp.transfer_gb_per_s is None:
        raise ValueError("--transfer-gb-per-s: dedicated rollout ranks need the training -> rollout bandwidth in GB/s")


def step_times(inp: StepInputs, *, gpus: int, rollout_gpus: int, weight_bytes: float) -> dict:
    """Seconds per phase and per step for the colocated layout on all `gpus` and, when
    rollout_gpus > 0, for dedicated rollout ranks at staleness 0 and 1 (module docstring)."""

    G, T = inp.generated_tokens, inp.trained_tokens
    g_ded = inp.dedicated_gen_tokens_per_s or inp.gen_tokens_per_s
    t_ded = inp.dedicated_train_tokens_per_s or inp.train_tokens_per_s
    sync_bw = inp.sync_gb_per_s or inp.transfer_gb_per_s
    colocated = _row(
        gpus,
        0,
        G / (inp.gen_tokens_per_s * gpus),
        T / (inp.train_tokens_per_s * gpus),
        weight_bytes / (sync_bw * GB),
        overlap=False,
    )
    rows = {"colocated": colocated}
    a, b = G / g_ded, T / t_ded  # GPU-seconds of each phase on dedicated GPUs
    out = {"inputs": dataclasses.asdict(inp), "weight_bytes": weight_bytes, "rows": rows, "trained_tokens": T}
    out["balanced_rollout_gpus"] = gpus * a / (a + b)
    if rollout_gpus:
        r, t = a / rollout_gpus, b / (gpus - rollout_gpus)
        transfer = weight_bytes / (inp.transfer_gb_per_s * GB)
        rows["staleness 0"] = _row(gpus - rollout_gpus, rollout_gpus, r, t, transfer, overlap=False)
        rows["staleness 1"] = _row(gpus - rollout_gpus, rollout_gpus, r, t, transfer, overlap=True)
        out["balanced_step_s"] = (a + b) / gpus + transfer
    return out


def _row(train_gpus: int, rollout_gpus: int, rollout_s: float, train_s: float, weights_s: float, overlap: bool):
    """One layout's step: colocated (rollout_gpus 0: every GPU does both phases in turn) or dedicated
    rollout ranks, overlapped (staleness 1) or in turn (staleness 0). idle: the share of the step a
    kind of GPU does neither its phase nor the weight move."""
    step = (max(rollout_s, train_s) if overlap else rollout_s + train_s) + weights_s
    gpus = train_gpus + rollout_gpus
    return dict(
        train_gpus=train_gpus,
        rollout_gpus=rollout_gpus,
        rollout_s=rollout_s,
        train_s=train_s,
        weights_s=weights_s,
        step_s=step,
        idle_train=max(0.0, (step - train_s - weights_s) / step) if rollout_gpus else 0.0,
        idle_rollout=max(0.0, (step - rollout_s - weights_s) / step) if rollout_gpus else 0.0,
        gpus=gpus,
    )


def format_step_times(st: dict) -> list[str]:
    inp, rows = st["inputs"], st["rows"]
    src = inp["sources"]

    def given(key, text):
        return f"{text} ({src.get(key, 'given')})"

    sync = inp["sync_gb_per_s"] or inp["transfer_gb_per_s"]
    lines = [
        "step time from these inputs (not measured by plan):",
        "  " + given("generated_tokens", f"generated tokens per step {inp['generated_tokens']:,}"),
        "  " + given("trained_tokens", f"trained tokens per step {inp['trained_tokens']:,}"),
        f"  per GPU, colocated: generation {inp['gen_tokens_per_s']:g} tokens/s, training (log-prob + update) "
        f"{inp['train_tokens_per_s']:g} tokens/s",
        f"  weights {st['weight_bytes'] / GB:.1f} GB; colocated sync {sync:g} GB/s"
        + ("" if inp["sync_gb_per_s"] else " (= --transfer-gb-per-s)")
        + (f"; transfer to the rollout ranks {inp['transfer_gb_per_s']:g} GB/s" if "staleness 0" in rows else ""),
        f"  {'':<24}{'GPUs':>9}{'rollout s':>11}{'train s':>9}{'weights s':>11}{'step s':>9}"
        f"{'idle train':>12}{'idle rollout':>14}{'trained tok/s/GPU':>19}",
    ]
    if "staleness 0" in rows:
        g_ded, t_ded = inp["dedicated_gen_tokens_per_s"], inp["dedicated_train_tokens_per_s"]
        lines.insert(
            4,
            f"  per dedicated GPU: generation {g_ded or inp['gen_tokens_per_s']:g} tokens/s"
            + ("" if g_ded else " (not given: the colocated rate)")
            + f", training {t_ded or inp['train_tokens_per_s']:g} tokens/s"
            + ("" if t_ded else " (not given: the colocated rate)"),
        )
    names = {"colocated": "colocated", "staleness 0": "dedicated, staleness 0", "staleness 1": "dedicated, staleness 1"}
    for key, r in rows.items():
        shape = f"{r['train_gpus']}+{r['rollout_gpus']}" if r["rollout_gpus"] else f"{r['gpus']}"
        idle = f"{r['idle_train']:>12.0%}{r['idle_rollout']:>14.0%}" if r["rollout_gpus"] else f"{'-':>12}{'-':>14}"
        lines.append(
            f"  {names[key]:<24}{shape:>9}{r['rollout_s']:>11.1f}{r['train_s']:>9.1f}{r['weights_s']:>11.2f}"
            f"{r['step_s']:>9.1f}{idle}{st['trained_tokens'] / (r['step_s'] * r['gpus']):>19.0f}"
        )
    if "staleness 1" in rows:
        c = rows["colocated"]["step_s"]
        lines.append(
            f"  colocated step / dedicated step: {c / rows['staleness 0']['step_s']:.2f} at staleness 0, "
            f"{c / rows['staleness 1']['step_s']:.2f} at staleness 1"
        )
    gpus = rows["colocated"]["gpus"]
    lines.append(
        f"  balanced split of the {gpus} GPUs (rollout time = training time on dedicated GPUs): "
        f"{st['balanced_rollout_gpus']:.1f} rollout GPUs (parallel.rollout_ranks: a multiple of parallel.rollout_tp "
        "that leaves a training layout that divides)"
        + (
            f"; staleness-1 step there {st['balanced_step_s']:.1f} s, colocated step / that "
            f"{rows['colocated']['step_s'] / st['balanced_step_s']:.2f}"
            if "balanced_step_s" in st
            else ""
        )
    )
    return lines
