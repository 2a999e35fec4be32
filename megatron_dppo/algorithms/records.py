"""One step's rollout data as typed records: a `Group` per rolled-out prompt.

A Group is created when its prompt is rolled out (prompt, G completions, rewards, the prompt
weight w_q from pruning), gets its advantages on the full group and its completion weights
w_o from completion pruning, and turns into the packing.Samples it trains with. The step's
metrics about the rollout are computed here too, from the groups.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field

import numpy as np
import torch

from megatron_dppo.algorithms.packing import Sample, sample_routing
from megatron_dppo.data.prompts import PromptRecord


@dataclass
class Group:
    """A prompt and its G completions. `slot` is the prompt's position in its round's draw: the
    sampling seed and (without refill) the mini-batch derive from it, never from a rank."""

    record: PromptRecord
    round: int  # which draw of the step (DAPO / GRESO refills draw again)
    slot: int
    prompt_ids: list[int]
    completions: list[list[int]]  # token ids; ends with eos when the completion stopped
    rewards: list[float]
    prompt_weight: float = 1.0  # w_q, as prompt pruning drew it
    train_weight: float = 0.0  # what it trains with: w_q, or its share of B under refill (algorithms/batch.py)
    minibatch: int = 0
    advantages: list[float] = field(default_factory=list)  # on the full group
    completion_weights: list[float] = field(default_factory=list)  # w_o; 0 = not trained
    truncated: list[bool] = field(default_factory=list)  # stopped by max_new_tokens, not by eos/stop
    sampling_logprobs: list[list[float]] = field(default_factory=list)  # vLLM's, per sampled token
    # rollout.routing_replay: vLLM's routed experts per completion, [positions, layers, top-k] ints
    # over prompt + completion (routing.sample_routing says which positions); empty: off
    routed_experts: list = field(default_factory=list)
    reward_extras: list[dict] = field(default_factory=list)  # a reward's extra numbers, per completion
    # How many leading completion tokens carry loss, per completion (BPPO's prefix; 0 under DAPO's
    # overlong filter); empty: all of them. Set by the step's planning (algorithms/batch.py).
    trained_tokens: list[int] = field(default_factory=list)
    prefix_len: int = 0  # AdaPrefix: tokens it added at the end of prompt_ids (thinking opener + prefix; no loss)
    # The weights it was sampled with: the step whose update they hold (0 = the starting weights).
    # Behind the trainer's by up to trainer.max_staleness steps with dedicated rollout ranks.
    policy_version: int = 0
    # Each completion's own version when they differ: BPPO's later waves of a group are sampled
    # after its first, possibly by newer weights (extend); empty: all of them policy_version.
    completion_versions: list[int] = field(default_factory=list)
    # rollout.partial: per completion, [token index, version] where new weights took over mid-completion
    # (its first tokens are versions()'s); empty: no completion of the group changed weights
    version_switches: list[list[list[int]]] = field(default_factory=list)

    @property
    def group_size(self) -> int:
        return len(self.completions)

    def to_state(self) -> dict:
        """JSON-able: the record by its id, routed experts as nested lists with their dtype."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "record"}
        out["record_id"] = self.record.id
        routed = [np.asarray(a) for a in self.routed_experts]
        out["routed_experts"] = [{"dtype": str(a.dtype), "data": a.tolist()} for a in routed]
        return out

    @classmethod
    def from_state(cls, state: dict, record: PromptRecord) -> Group:
        fields = {k: v for k, v in state.items() if k not in ("record_id", "routed_experts")}
        routed = [np.asarray(a["data"], dtype=a["dtype"]) for a in state["routed_experts"]]
        return cls(record=record, routed_experts=routed, **fields)

    def extend(self, more: Group) -> None:
        """Append a later wave's completions of the same prompt (BPPO's waves), before planning."""
        if (more.record.id, more.round, more.slot) != (self.record.id, self.round, self.slot):
            raise ValueError(f"cannot extend group {self.record.id!r} with one of {more.record.id!r}")
        mine, theirs = self.versions(), more.versions()
        if mine + theirs != [self.policy_version] * (len(mine) + len(theirs)):
            self.completion_versions = mine + theirs
        if self.version_switches or more.version_switches:
            self.version_switches = self.switches() + more.switches()
        self.completions += more.completions
        self.rewards += more.rewards
        self.truncated += more.truncated
        self.sampling_logprobs += more.sampling_logprobs
        self.routed_experts += more.routed_experts
        self.reward_extras += more.reward_extras

    def versions(self) -> list[int]:
        """The weights' version that sampled each completion (partial rollouts: its first tokens,
        the oldest, by which its lag counts)."""
        return list(self.completion_versions) or [self.policy_version] * len(self.completions)

    def switches(self) -> list[list[list[int]]]:
        """Each completion's [token index, version] weight switches (rollout.partial; [] for none)."""
        return [list(s) for s in self.version_switches] or [[] for _ in self.completions]

    def completion_lengths(self) -> list[int]:
        return [len(c) for c in self.completions]

    def loss_lengths(self) -> list[int]:
        """Completion tokens that carry loss: what token-mean normalisers count."""
        return list(self.trained_tokens) if self.trained_tokens else self.completion_lengths()

    def correct(self) -> list[bool]:
        """Each completion's verdict before reward shaping (DAPO's overlong penalty is not a verdict)."""
        extras = self.reward_extras or [{}] * len(self.rewards)
        return [r - e.get("overlong_penalty", 0.0) >= 1.0 - 1e-6 for r, e in zip(self.rewards, extras)]

    def informative(self) -> bool:
        """Not all rewards equal: the group has a non-zero advantage somewhere."""
        return len(set(self.rewards)) > 1

    def samples(self, first_seq_id: int) -> list[Sample]:
        """The trained completions as packing samples (prompt + completion), weight train_weight * w_o.
        A completion trained on a prefix (trained_tokens) is cut after it: under causal attention
        the tail changes nothing before it, so it costs no forward, log-prob or backward."""
        out = []
        for i, (c, a, w) in enumerate(zip(self.completions, self.advantages, self.completion_weights)):
            if w <= 0:
                continue
            n = self.trained_tokens[i] if self.trained_tokens else len(c)
            out.append(
                Sample(
                    tokens=self.prompt_ids + c[:n],
                    prompt_len=len(self.prompt_ids),
                    advantage=a,
                    weight=self.train_weight * w,
                    seq_id=first_seq_id + i,
                    rollout_logp=torch.tensor(self.sampling_logprobs[i][:n]) if self.sampling_logprobs else None,
                    routed_experts=self._routing(i, n),
                )
            )
        return out

    def _routing(self, i: int, n: int) -> torch.Tensor | None:
        """Completion i's routed experts over its sample's tokens (prompt + its first n), if carried."""
        return sample_routing(self.routed_experts[i], len(self.prompt_ids) + n) if self.routed_experts else None

    def rollout_rows(self, decode) -> list[dict]:
        """logging.rollouts rows, one per completion; decode(token ids) -> text. A completion that
        was generated but not trained (pruned, uninformative, past the refill) has weight 0."""
        weights = self.completion_weights or [0.0] * self.group_size
        advantages = self.advantages or [None] * self.group_size
        prompt, versions, switches = decode(self.prompt_ids), self.versions(), self.switches()
        return [
            {
                "id": self.record.id,
                "data_source": getattr(self.record, "data_source", ""),
                "round": self.round,
                "slot": self.slot,
                "index": i,
                "prompt": prompt,
                "completion": decode(c),
                "completion_ids": list(c),
                "reward": self.rewards[i],
                "advantage": advantages[i],
                "weight": self.train_weight * weights[i],
                "prompt_weight": self.prompt_weight,
                "length": len(c),
                "truncated": self.truncated[i] if self.truncated else None,
                # sum of log pi_rollout over the completion's tokens (the engine's, as sampled)
                "rollout_logprob_sum": sum(self.sampling_logprobs[i]) if self.sampling_logprobs else None,
                "policy_version": versions[i],  # the weights that sampled it: those after this step's update
                **self._switch_fields(i, switches[i]),
            }
            for i, c in enumerate(self.completions)
        ]

    def _switch_fields(self, i: int, switches: list) -> dict:
        """A partial rollout's row also says where the weights changed and each token's log-prob (to
        check each stretch against its own weights); {} for a completion that did not change."""
        if not switches:
            return {}
        return {"version_switches": switches, "rollout_logprobs": list(self.sampling_logprobs[i])}


def stack_rewards(groups: list[Group]) -> torch.Tensor:
    """[P, G] float32 (an empty [0, 0] tensor for no groups)."""
    return torch.tensor([g.rewards for g in groups], dtype=torch.float32).reshape(len(groups), -1)


def size_runs(groups: list[Group]) -> list[list[Group]]:
    """The groups in order, cut where the group size changes: each run stacks into a [P, G] tensor.
    One run unless BPPO's waves gave prompts their own group sizes."""
    runs: list[list[Group]] = []
    for g in groups:
        if runs and runs[-1][0].group_size == g.group_size:
            runs[-1].append(g)
        else:
            runs.append([g])
    return runs


@dataclass
class RolloutCounts:
    """What a step drew, generated and scored (summed over rounds and ranks)."""

    prompts_drawn: int = 0
    prompts_rolled: int = 0
    generated_tokens: int = 0
    reward_checks: int = 0
    reward_failures: dict = field(default_factory=dict)  # kind -> count
    first_failures: list = field(default_factory=list)  # "record <id>: <kind>: <message>"
    # Dedicated rollout ranks: the engines' own seconds per phase (rollout, reward), the slowest
    # engine's per wave; colocated, the trainer's phase timer measures them instead.
    engine_seconds: dict = field(default_factory=dict)

    def add_failures(self, by_kind: dict, first: list) -> None:
        for kind, n in by_kind.items():
            self.reward_failures[kind] = self.reward_failures.get(kind, 0) + n
        self.first_failures += first[: max(0, 5 - len(self.first_failures))]


def policy_lags(groups: list[Group], trained_version: int) -> list[int]:
    """How many updates each completion's sampling weights are behind `trained_version` (the
    weights the step trains from), completion by completion: a group whose later waves came from
    newer weights counts each wave at its own lag."""
    return [trained_version - v for g in groups for v in g.versions()]


def rollout_metrics(trained: list[Group], rolled: list[Group], counts: RolloutCounts) -> dict:
    """The step's rollout-side metrics: rewards over every rolled-out group, the trained weight;
    completion pruning's own metrics come from algorithms/batch.weigh_completions."""
    rewards = [r for g in rolled for r in g.rewards]
    lengths = [n for g in rolled for n in g.completion_lengths()]
    correct = [c for g in rolled for c in g.correct()]
    truncated = [t for g in rolled for t in g.truncated]
    sizes = {g.group_size for g in rolled}
    G = sizes.pop() if len(sizes) == 1 else statistics.fmean(g.group_size for g in rolled) if rolled else 0
    out = {
        "reward/mean": statistics.fmean(rewards) if rewards else 0.0,
        "reward/accuracy": sum(correct) / len(correct) if correct else 0.0,
        "reward/failures": sum(counts.reward_failures.values()),
        "prune/prompts_kept_frac": counts.prompts_rolled / max(counts.prompts_drawn, 1),
        "groups/zero_variance_frac": sum(not g.informative() for g in rolled) / len(rolled) if rolled else 0.0,
        "groups/trained_weight": sum(g.train_weight for g in trained),
        "tokens/generated": counts.generated_tokens,
        "completion/mean_length": statistics.fmean(lengths) if lengths else 0.0,
        "completion/min_length": min(lengths, default=0),
        "completion/max_length": max(lengths, default=0),
        "completion/truncated_frac": sum(truncated) / len(truncated) if truncated else 0.0,
        "rollout/prompts_drawn": counts.prompts_drawn,
        "rollout/groups": len(rolled),
    }
    if any(g.version_switches for g in rolled):  # rollout.partial: completions that changed weights mid-way
        switched = [bool(s) for g in rolled for s in g.switches()]
        out["rollout/weight_switched_frac"] = sum(switched) / len(switched)
    for kind, n in counts.reward_failures.items():
        out[f"reward/failures/{kind}"] = n
    if G:
        out["rollout/group_size"] = G
    return out
