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
import math
import random

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


# ---- staleness k >= 1 and partial rollouts: a long tail, a k-deep queue (issue 46 item 5) ----------
#
# The formulas above charge a rollout G / (g R): a rate that already holds the long tail at the
# layout it was measured on. An asynchronous pipeline changes what the tail costs, so here the
# rollout of one step (a "round") is two things:
#
#   bulk   the GPU-seconds the round's tokens take on a saturated engine, a = (1 - f) G / g: it
#          shrinks with more rollout GPUs (a / R seconds);
#   tail   the seconds the round then waits on its longest completions with the engine nearly
#          empty, tau = f G / (g N) at the N colocated GPUs g was measured on: a decode latency,
#          the same on any number of GPUs. Per round it is drawn (seeded) from a lognormal of mean
#          tau and log-sd tail_sigma: a step's longest completion varies from step to step.
#
# f (tail_share) is the share of a synchronous (colocated) rollout spent in the tail; with every
# completion in flight at once and a constant decode step it is 1 - mean length / longest length.
# Two engines, the two ways a rollout rank can meet new weights:
#
#   without partial rollouts  rounds one after another, each bulk then its own tail (a round ends
#                             when its longest completion does); weights load between rounds.
#   partial rollouts          the engine pauses for the weights and goes on: a round's unfinished
#                             completions continue under the new weights while the freed batch
#                             slots take the next admitted round's prompts, so a tail runs beside
#                             the next round's bulk and costs the engine nothing.
#
# Staleness k: round r may start once the engine holds version r - k (the weights after r - k
# updates); step r trains round r once it is complete, so its oldest token is at most k updates
# old. Each update's weights are pushed (weights_s, the trainer's side) into one staged copy that
# the engine loads (weights_s again, its side): at once with partial rollouts (the engine pauses
# for the push), between rounds without; a trainer that is a push ahead of the engine's loads waits
# (docs/scaling.md 2d; train/rollout_mail.py's one staged copy). When the engine waits for the
# weights the load streams with the push: one weights_s for both. Rewards and the host's work are
# in fixed_s (the trainer's, per step) or left out. With tail_share 0 at k = 0 and 1 this is
# step_times' staleness 0 and 1 rows exactly (tests/unit/test_plan_async.py).


@dataclasses.dataclass
class AsyncInputs:
    generated_tokens: float  # per step
    trained_tokens: float  # per step
    gen_tokens_per_s: float  # per GPU, a colocated synchronous rollout's rate as measured (its tail included)
    train_tokens_per_s: float  # per training GPU, log-prob + update
    tail_share: float = 0.0  # f: the share of that colocated rollout spent waiting on the longest completions
    tail_sigma: float = 0.5  # log-sd of a round's tail (lognormal, mean tail_share x the colocated rollout)
    weights_s: float = 0.0  # one weight move, seconds (W / B), each side
    fixed_s: float = 0.0  # per step on the trainer, seconds that do not shrink with GPUs (rewards, host)
    colocated_train_tokens_per_s: float | None = None  # per GPU colocated; None: train_tokens_per_s
    colocated_weights_s: float | None = None  # the colocated sync; None: weights_s


def check_async_inputs(inp: AsyncInputs) -> None:
    """ValueError naming the field of an input that cannot be used."""
    for name in ("generated_tokens", "trained_tokens", "gen_tokens_per_s", "train_tokens_per_s"):
        if not getattr(inp, name) > 0:
            raise ValueError(f"{name}: expected a number > 0, got {getattr(inp, name)}")
    if not 0 <= inp.tail_share < 1:
        raise ValueError(f"tail_share: expected 0 <= f < 1 (the share of a rollout in its tail), got {inp.tail_share}")
    for name in ("tail_sigma", "weights_s", "fixed_s"):
        if not getattr(inp, name) >= 0:
            raise ValueError(f"{name}: expected a number >= 0, got {getattr(inp, name)}")
    if inp.colocated_train_tokens_per_s is not None and not inp.colocated_train_tokens_per_s > 0:
        raise ValueError(f"colocated_train_tokens_per_s: expected a number > 0, got {inp.colocated_train_tokens_per_s}")
    if inp.colocated_weights_s is not None and not inp.colocated_weights_s >= 0:
        raise ValueError(f"colocated_weights_s: expected a number >= 0, got {inp.colocated_weights_s}")


def rollout_parts(inp: AsyncInputs, gpus: int) -> tuple[float, float]:
    """(bulk GPU-seconds of a round, mean tail seconds), from the colocated rate on `gpus` GPUs."""
    colocated_rollout_s = inp.generated_tokens / (inp.gen_tokens_per_s * gpus)
    return (1 - inp.tail_share) * colocated_rollout_s * gpus, inp.tail_share * colocated_rollout_s


def colocated_step_s(inp: AsyncInputs, gpus: int) -> float:
    """Mean colocated step: every GPU generates (bulk / N + the tail), trains, then syncs."""
    bulk, tail = rollout_parts(inp, gpus)
    t_colo = inp.colocated_train_tokens_per_s or inp.train_tokens_per_s
    w_colo = inp.weights_s if inp.colocated_weights_s is None else inp.colocated_weights_s
    return bulk / gpus + tail + inp.trained_tokens / (t_colo * gpus) + w_colo + inp.fixed_s


def with_pruning(inp: AsyncInputs, gpus: int, *, generated_kept: float, trained_kept: float) -> AsyncInputs:
    """The same run with DPPO's pruning: prompt pruning generates generated_kept of the tokens (the
    bulk shrinks by that), completion pruning trains trained_kept of them; a round's tail stays as
    long in seconds (the longest completion among fewer prompts is about as long: the cap). The
    colocated rate and tail share are restated so that rollout_parts gives that bulk and that tail."""
    for name, kept in (("generated_kept", generated_kept), ("trained_kept", trained_kept)):
        if not 0 < kept <= 1:
            raise ValueError(f"{name}: expected a fraction in (0, 1], got {kept}")
    bulk, tail = rollout_parts(inp, gpus)
    rollout_s = generated_kept * bulk / gpus + tail  # the pruned colocated rollout
    generated = inp.generated_tokens * generated_kept
    return dataclasses.replace(
        inp,
        generated_tokens=generated,
        trained_tokens=inp.trained_tokens * trained_kept,
        gen_tokens_per_s=generated / (rollout_s * gpus),
        tail_share=tail / rollout_s,
    )


def async_step_times(
    inp: AsyncInputs, *, gpus: int, rollout_gpus: int, staleness: int, partial: bool, steps: int = 200, seed: int = 0
) -> dict:
    """The dedicated layout's steady-state step (rollout_gpus of `gpus` generating) at staleness k,
    beside the colocated step on all `gpus`: simulate_pipeline with the rates turned into seconds."""
    check_async_inputs(inp)
    if not 0 < rollout_gpus < gpus:
        raise ValueError(f"rollout_gpus: expected 0 < R < gpus={gpus}, got {rollout_gpus}")
    bulk, tail = rollout_parts(inp, gpus)
    out = simulate_pipeline(
        rollout_s=bulk / rollout_gpus,
        train_s=inp.trained_tokens / (inp.train_tokens_per_s * (gpus - rollout_gpus)) + inp.fixed_s,
        tail_s=tail,
        tail_sigma=inp.tail_sigma,
        weights_s=inp.weights_s,
        staleness=staleness,
        partial=partial,
        steps=steps,
        seed=seed,
    )
    out.update(gpus=gpus, rollout_gpus=rollout_gpus, colocated_s=colocated_step_s(inp, gpus))
    out["speedup"] = out["colocated_s"] / out["step_s"]
    return out


def balanced_split(
    inp: AsyncInputs, *, gpus: int, staleness: int, partial: bool, multiple: int = 1, steps: int = 200, seed: int = 0
) -> dict:
    """The number of rollout GPUs R (a multiple of `multiple`, e.g. parallel.rollout_tp, leaving at
    least one training GPU) whose predicted steady-state step is shortest at staleness k, and that
    step. Every R is simulated with the same tail draws (seed), so the comparison is not noise.
    Returns async_step_times' dict at the best R, plus by_rollout_gpus {R: step_s}."""
    if not (isinstance(multiple, int) and multiple >= 1):
        raise ValueError(f"multiple: expected an integer >= 1 (parallel.rollout_tp), got {multiple}")
    if not (isinstance(gpus, int) and gpus > multiple):
        raise ValueError(f"gpus: expected an integer > multiple={multiple} (rollout and training GPUs), got {gpus}")
    runs = {
        r: async_step_times(
            inp, gpus=gpus, rollout_gpus=r, staleness=staleness, partial=partial, steps=steps, seed=seed
        )
        for r in range(multiple, gpus, multiple)
    }
    best = min(runs, key=lambda r: (runs[r]["step_s"], r))
    return {**runs[best], "by_rollout_gpus": {r: run["step_s"] for r, run in runs.items()}}


def simulate_pipeline(
    *,
    rollout_s: float,
    train_s: float,
    tail_s: float = 0.0,
    tail_sigma: float = 0.5,
    weights_s: float = 0.0,
    staleness: int,
    partial: bool,
    steps: int = 200,
    seed: int = 0,
) -> dict:
    """Discrete-event simulation of `steps` steps of one trainer and one rollout engine (section
    comment above). rollout_s: a round's bulk on the rollout GPUs; train_s: a step's training on the
    training GPUs; tail_s: a round's mean tail. Returns the steady-state step (the mean over the
    steps between the first and the last fifth), the trainer's mean wait for its round there, the
    engine's bulk share of the step, and the policy lag of the trained rounds (updates between the
    weights of a round's oldest token and the trainer's)."""
    if not (isinstance(staleness, int) and staleness >= 0):
        raise ValueError(f"staleness: expected an integer k >= 0 (trainer.max_staleness), got {staleness}")
    if not (isinstance(steps, int) and steps >= 5):
        raise ValueError(f"steps: expected an integer >= 5, got {steps}")
    for name, value in (("rollout_s", rollout_s), ("train_s", train_s)):
        if not value > 0:
            raise ValueError(f"{name}: expected seconds > 0, got {value}")
    tails = _tail_draws(tail_s, tail_sigma, steps, seed)
    run = (_PartialEngineRun if partial else _RoundEngineRun)(rollout_s, train_s, tails, weights_s, staleness, steps)
    run.simulate()
    warm = steps // 5  # the first and last fifth left out: the queue filling, the last rounds' tails
    done, started = run.step_done, run.step_start
    step_s = (done[steps - warm - 1] - done[warm - 1]) / (steps - 2 * warm)
    waits = [started[s] - done[s - 1] for s in range(warm, steps - warm)]
    lags = [s - run.start_version[s] for s in range(steps)]
    return dict(
        step_s=step_s,
        rollout_s=rollout_s,
        train_s=train_s,
        tail_s=tail_s,
        weights_s=weights_s,
        staleness=staleness,
        partial=partial,
        trainer_wait_s=sum(waits) / len(waits),
        engine_bulk_share=min(1.0, rollout_s / step_s),
        lag_mean=sum(lags) / len(lags),
        lag_max=max(lags),
    )


def _tail_draws(mean: float, sigma: float, n: int, seed: int) -> list[float]:
    """n lognormal draws of the given mean (sigma 0: the mean every time), seeded."""
    rng = random.Random(seed)
    return [mean * math.exp(sigma * rng.gauss(0.0, 1.0) - sigma * sigma / 2) for _ in range(n)]


class _PipelineRun:
    """The trainer's side, common to both engines: step s waits for round s, trains train_s, waits
    until the engine has loaded the previous push (one staged copy), pushes weights_s. Subclasses
    move the engine; `simulate` advances time from event to event."""

    def __init__(self, rollout_s, train_s, tails, weights_s, staleness, steps):
        self.rollout_s, self.train_s, self.tails = rollout_s, train_s, tails
        self.w, self.k, self.n = weights_s, staleness, steps
        self.t = 0.0
        self.complete = [math.inf] * steps  # when round r's last completion ended
        self.start_version = [0] * steps  # the weights round r's first tokens were sampled with
        self.loaded, self.next_round = 0, 0  # the engine's weights version; the next round to start
        self.push = None  # (version, start, end) of the push in progress or staged, not yet loaded
        self.step, self.phase, self.phase_end = 0, "wait", math.inf  # trainer: wait | train | slot | push
        self.step_start, self.step_done = [0.0] * steps, [0.0] * steps

    def simulate(self) -> None:
        while self.step < self.n:
            while self._advance_trainer() | self._advance_engine():
                pass
            if self.step >= self.n:
                break
            nxt = min(self.phase_end, self._engine_next_event())
            if nxt == math.inf:
                raise RuntimeError(f"pipeline stalled at step {self.step} (t={self.t})")  # a modelling bug
            self.t = nxt

    def _admissible(self) -> bool:
        return self.next_round < self.n and self.loaded >= self.next_round - self.k

    def _advance_trainer(self) -> bool:
        s, t = self.step, self.t
        if s >= self.n:
            return False
        if self.phase == "wait" and self.complete[s] <= t:
            self.step_start[s], self.phase, self.phase_end = t, "train", t + self.train_s
        elif self.phase == "train" and self.phase_end <= t:
            self.phase, self.phase_end = "slot", math.inf
        elif self.phase == "slot" and self.push is None:  # the previous push is loaded
            self.push = (s + 1, t, t + self.w)
            self.phase, self.phase_end = "push", t + self.w
            self._on_push()
        elif self.phase == "push" and self.phase_end <= t:
            self.step_done[s] = t
            self.step, self.phase, self.phase_end = s + 1, "wait", math.inf
        else:
            return False
        return True

    def _on_push(self) -> None:
        """A push has just begun (the partial engine pauses for it)."""

    def _advance_engine(self) -> bool:
        raise NotImplementedError

    def _engine_next_event(self) -> float:
        raise NotImplementedError


class _RoundEngineRun(_PipelineRun):
    """Without partial rollouts: one round at a time (bulk, then its tail), weights between rounds."""

    def __init__(self, *args):
        super().__init__(*args)
        self.busy_until, self.doing = 0.0, None  # ("round", r) | ("load", version) | None

    def _advance_engine(self) -> bool:
        t = self.t
        if self.doing is not None:
            if self.busy_until > t:
                return False
            kind, x = self.doing
            if kind == "round":
                self.complete[x] = t
            else:
                self.loaded, self.push = x, None
            self.doing = None
            return True
        if self.push is not None and self.push[1] <= t:  # a push has begun: load it first (freshest weights)
            version, _, end = self.push
            self.doing, self.busy_until = ("load", version), max(end, t + self.w)  # streamed when waiting
            return True
        if self._admissible():
            r = self.next_round
            self.start_version[r], self.next_round = self.loaded, r + 1
            self.doing, self.busy_until = ("round", r), t + self.rollout_s + self.tails[r]
            return True
        return False

    def _engine_next_event(self) -> float:
        return self.busy_until if self.doing is not None else math.inf


class _PartialEngineRun(_PipelineRun):
    """Partial rollouts: the bulk of admitted rounds runs back to back; each round's tail runs beside
    whatever follows; every push pauses the engine (it loads as the weights stream in), which moves
    every running end time later by the pause."""

    def __init__(self, *args):
        super().__init__(*args)
        self.bulk = None  # (round, end time of its bulk)
        self.tail_end: dict[int, float] = {}  # round -> end time of its tail (its last completion)

    def _start_at(self) -> float:
        """When work begun now starts running: at once, or after the push that pauses the engine."""
        return self.push[2] if self.push is not None and self.push[1] <= self.t else self.t

    def _on_push(self) -> None:
        pause = self.push[2] - self.push[1]
        if self.bulk is not None and self.bulk[1] > self.t:
            self.bulk = (self.bulk[0], self.bulk[1] + pause)
        for r, end in self.tail_end.items():
            if end > self.t:
                self.tail_end[r] = end + pause

    def _advance_engine(self) -> bool:
        t = self.t
        if self.push is not None and self.push[2] <= t:  # the push has ended: those weights are loaded
            self.loaded, self.push = self.push[0], None
            return True
        if self.bulk is not None and self.bulk[1] <= t:
            self.tail_end[self.bulk[0]] = self._start_at() + self.tails[self.bulk[0]]
            self.bulk = None
            return True
        for r, end in self.tail_end.items():
            if end <= t:
                del self.tail_end[r]
                self.complete[r] = t
                return True
        if self.bulk is None and self._admissible():
            r = self.next_round
            self.start_version[r], self.next_round = self.loaded, r + 1
            self.bulk = (r, self._start_at() + self.rollout_s)
            return True
        return False

    def _engine_next_event(self) -> float:
        ends = list(self.tail_end.values()) + ([self.bulk[1]] if self.bulk is not None else [])
        if self.push is not None:
            ends.append(self.push[2])
        return min(ends, default=math.inf)
