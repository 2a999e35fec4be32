"""The rollout of one step: the prompts of a round split over the vLLM engines, generated, scored
by each engine's leader, gathered on every rank, and recorded in the prompt history.

Every rank of an engine generates the same slice with the same seeds; a completion's seed comes
from (trainer.seed, step, round, its prompt's slot) only, so it is the same whatever rank or engine
generates it. With BPPO's waves a prompt is rolled out g0 completions at a time until its group is
mixed or full.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from megatron_dppo.algorithms.records import Group, RolloutCounts, size_runs, stack_rewards
from megatron_dppo.rewards import overlong_penalty
from megatron_dppo.run import collectives as mdist


@dataclass
class EnginePart:
    """What one engine's leader sends to every rank after a rollout: its slice's scored groups and
    its counts (other ranks send an empty part)."""

    groups: list[Group] = field(default_factory=list)
    generated_tokens: int = 0
    checks: int = 0
    failures: dict = field(default_factory=dict)  # reward failure kind -> count
    first_failures: list = field(default_factory=list)
    error: str | None = None  # the scorer's error, raised on every rank


@dataclass(frozen=True)
class EnginePlace:
    """This rank's vLLM engine: ranks [kR, (k+1)R) share engine k (vLLM tensor parallel over
    them, R = parallel.rollout_tp); the first rank of each engine scores its completions."""

    index: int
    count: int
    leader: bool

    @classmethod
    def of_rank(cls, rank: int, world: int, rollout_tp: int) -> EnginePlace:
        return cls(rank // rollout_tp, world // rollout_tp, rank % rollout_tp == 0)


def routed_experts(completion):
    """A completion's routed experts under rollout.routing_replay; a named error when the engine
    returned none (a dense model has no routers: vLLM refuses the option there)."""
    if completion.routed_experts is None:
        raise ValueError(
            "rollout.routing_replay=true but vLLM returned no routed experts with a completion "
            "(enable_return_routed_experts needs an MoE model and vLLM's Model Runner V2)"
        )
    return completion.routed_experts


def rollout_seed(seed: int, step: int, rnd: int, slot: int) -> int:
    """A prompt's sampling seed: from (trainer.seed, step, round, its slot in the draw) only, so a
    completion is the same whatever rank or engine generates it (completion k adds k in vLLM)."""
    from megatron_dppo.rollout.vllm_engine import request_seed

    return request_seed("rollout", seed, step, rnd, slot)


class StepRollout:
    """`rollout(step, rnd, items, counts, timer)` -> the scored groups of the prompts `items`,
    gathered on every rank in slot order."""

    def __init__(
        self, cfg, method, *, engine, place: EnginePlace, renderer, tokenizer, scorer, history, curriculum, watchdog
    ):
        self.cfg, self.method, self.engine, self.place = cfg, method, engine, place
        self.renderer, self.tokenizer, self.scorer = renderer, tokenizer, scorer
        self.history, self.curriculum, self.watchdog = history, curriculum, watchdog

    def __call__(self, step, rnd, items, counts: RolloutCounts, timer) -> list[Group]:
        """items: (record, slot, w_q) of the prompts to roll out. Each engine generates a contiguous
        slice, its leader scores it, the groups are gathered in slot order and every one is
        recorded in the prompt history. With BPPO's waves (algorithm.bppo.schedule=waves) a prompt
        gets g0 completions at a time until its group is mixed or full (bppo.next_wave); every rank
        sees every group after each wave's gather, so all decide the next wave alike."""
        counts.prompts_rolled += len(items)
        per = math.ceil(len(items) / self.place.count)
        mine = items[self.place.index * per : (self.place.index + 1) * per]
        prompt_ids = [self.renderer.token_ids(rec) for rec, _, _ in mine]
        prefix_lens = [0] * len(mine)
        if self.curriculum:  # AdaPrefix: the reference's prefix opens the completion (as prompt tokens)
            assisted = [self.curriculum.assisted(rec, ids, step) for (rec, _, _), ids in zip(mine, prompt_ids)]
            prompt_ids, prefix_lens = [ids for ids, _ in assisted], [n for _, n in assisted]
        by_slot: dict[int, Group] = {}
        while True:
            drawn = {slot: by_slot[slot].group_size if slot in by_slot else 0 for _, slot, _ in items}
            want = self._completions_wanted(by_slot, drawn)
            if not any(want.values()):
                break
            todo = [i for i, (_, slot, _) in enumerate(mine) if want[slot] > 0]
            for g in self._roll_wave(step, rnd, mine, prompt_ids, prefix_lens, todo, want, drawn, counts, timer):
                if g.slot in by_slot:
                    by_slot[g.slot].extend(g)
                else:
                    by_slot[g.slot] = g
        groups = sorted(by_slot.values(), key=lambda g: g.slot)
        for run in size_runs(groups):
            self.history.update([g.record.id for g in run], stack_rewards(run))
        return groups

    def _completions_wanted(self, by_slot: dict[int, Group], drawn: dict[int, int]) -> dict[int, int]:
        """How many more completions each prompt (slot) gets: its whole group in one call, or the
        selection's next wave (BPPO's, decided on its own verdicts before reward shaping)."""
        group_size = self.cfg.rollout.group_size
        return {slot: self.method.selection.completions_wanted(by_slot.get(slot), group_size) for slot in drawn}

    def _roll_wave(self, step, rnd, mine, prompt_ids, prefix_lens, todo, want, drawn, counts, timer) -> list[Group]:
        """One engine call for this engine's prompts `todo` (indices into mine), want[slot]
        completions each, continuing their seeds' streams after drawn[slot]; scored by the
        engine's leader and gathered from every engine."""
        sub = [mine[i] for i in todo]
        with timer("rollout"):
            outs = self._generate(step, rnd, sub, [prompt_ids[i] for i in todo], want, drawn)
        part = EnginePart()
        if self.place.leader and sub:
            with timer("reward"):
                part = self._score(rnd, sub, [prompt_ids[i] for i in todo], outs, [prefix_lens[i] for i in todo])
        self.watchdog.phase("gather rollouts", step)
        parts = mdist.all_gather_objects(part)
        errors = [p.error for p in parts if p.error]
        if errors:
            raise RuntimeError(errors[0])
        groups = []
        for p in parts:
            counts.generated_tokens += p.generated_tokens
            counts.reward_checks += p.checks
            counts.add_failures(p.failures, p.first_failures)
            groups += p.groups
        return groups

    def _generate(self, step, rnd, mine, prompt_ids, want, drawn) -> list:
        """want[slot] completions (rollout.vllm_engine.Completion) for each of this engine's
        prompts. vLLM gives completion k of a request seed s the seed s + k, so starting a prompt's
        later wave at s + drawn[slot] continues the stream: its completions are the ones a single
        call for all of them would have drawn."""
        rc = self.cfg.rollout
        if not mine:
            return []
        return self.engine.generate(
            prompt_ids,
            n=[want[slot] for _, slot, _ in mine],
            max_new_tokens=rc.max_new_tokens,
            temperature=rc.temperature,
            top_p=rc.top_p,
            top_k=rc.top_k,
            stop=rc.stop or None,
            seeds=[rollout_seed(self.cfg.trainer.seed, step, rnd, slot) + drawn[slot] for _, slot, _ in mine],
        )

    def _score(self, rnd, mine, prompt_ids, outs, prefix_lens) -> EnginePart:
        """The engine leader's groups for its slice, scored (and shaped: DAPO's soft overlong
        penalty). The verifier reads an AdaPrefix prefix and its continuation as one answer. A
        scorer error travels to every rank (or the others would hang in the gather)."""
        rc, wc = self.cfg.rollout, self.cfg.reward
        sizes = [len(group) for group in outs]
        starts = [0, *itertools.accumulate(sizes)]
        flat = [c for group in outs for c in group]
        prefixes = [p[len(p) - n :] if n else [] for p, n, k in zip(prompt_ids, prefix_lens, sizes) for _ in range(k)]
        texts = [self.tokenizer.decode(pre + c.token_ids, skip_special_tokens=True) for pre, c in zip(prefixes, flat)]
        recs = [rec for (rec, _, _), k in zip(mine, sizes) for _ in range(k)]
        error = None
        try:
            rewards, info = self.scorer.score(texts, [r.answer for r in recs], recs)
        except Exception as e:  # noqa: BLE001 - re-raised on every rank after the gather
            rewards, info, error = [0.0] * len(texts), {}, str(e)
        extras = info.get("extras") or [{} for _ in texts]
        if wc.overlong_buffer:
            for i, c in enumerate(flat):
                penalty = overlong_penalty(len(c.token_ids), rc.max_new_tokens, wc.overlong_buffer, wc.overlong_penalty)
                rewards[i] += penalty
                extras[i] = {**extras[i], "overlong_penalty": penalty}
        groups = [
            Group(
                rec,
                rnd,
                slot,
                p,
                [c.token_ids for c in group],
                [float(x) for x in rewards[starts[q] : starts[q + 1]]],
                prompt_weight=w_q,
                truncated=[c.finish_reason == "length" for c in group],
                sampling_logprobs=[list(c.logprobs) for c in group],
                routed_experts=[routed_experts(c) for c in group] if rc.routing_replay else [],
                reward_extras=extras[starts[q] : starts[q + 1]],
                prefix_len=prefix_lens[q],
            )
            for q, ((rec, slot, w_q), p, group) in enumerate(zip(mine, prompt_ids, outs))
        ]
        return EnginePart(
            groups=groups,
            generated_tokens=sum(len(c.token_ids) for c in flat),
            checks=len(texts),
            failures=info.get("failures_by_kind", {}),
            first_failures=info.get("first_failures", []),
            error=error,
        )
