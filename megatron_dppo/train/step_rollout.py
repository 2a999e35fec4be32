"""The rollout of one step: the prompts of a round split over the vLLM engines, generated, scored
by each engine's leader, gathered on every training rank, and recorded in the prompt history.

Two halves, so that the engines can live on other ranks than the trainer:
  * `StepRollout` (every training rank) turns a round's prompts into `WaveRequest`s (BPPO's waves:
    one request per wave) and the engines' replies into Groups, identically on every rank;
  * `EngineWorker` (wherever an engine lives) generates its engine's slice of a request, and its
    leader scores it: an `EnginePart`.
Between them, `LocalEngines` (colocated: this rank's own engine, parts all-gathered) or
`RemoteEngines` (parallel.rollout_ranks > 0: training rank 0 sends the request over the bridge
to the rollout ranks, megatron_dppo/train/rollout_rank.py, and passes their parts on).

Every rank of an engine generates the same slice with the same seeds; a completion's seed comes
from (trainer.seed, step, round, its prompt's slot) only, so it is the same whatever rank or engine
generates it: a run with dedicated rollout ranks samples what the colocated run samples.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass, field

import torch

from megatron_dppo.algorithms.records import Group, RolloutCounts, size_runs, stack_rewards
from megatron_dppo.rewards import overlong_penalty
from megatron_dppo.rollout.validation import engine_generate, run_validation
from megatron_dppo.run import collectives as mdist


@dataclass
class WaveRequest:
    """One engine call for a round's prompts: every engine takes its contiguous slice of `items`
    (EnginePlace) and generates want[slot] completions for each of its prompts, continuing their
    seeds' streams after drawn[slot]."""

    step: int
    rnd: int
    items: list[tuple]  # (record, slot, w_q) of every prompt of the round, in slot order
    prompt_ids: list[list[int]]  # per item (AdaPrefix's assisted prompt where it adds one)
    prefix_lens: list[int]  # per item: AdaPrefix's prefix tokens at the end of prompt_ids
    want: dict[int, int]  # slot -> completions this wave (0: none)
    drawn: dict[int, int]  # slot -> completions drawn in earlier waves


@dataclass
class EnginePart:
    """What one engine's leader sends to every rank after a wave: its slice's scored groups, its
    counts and timings (other ranks send an empty part)."""

    groups: list[Group] = field(default_factory=list)
    generated_tokens: int = 0
    checks: int = 0
    failures: dict = field(default_factory=dict)  # reward failure kind -> count
    first_failures: list = field(default_factory=list)
    error: str | None = None  # the scorer's error, raised on every rank
    seconds: dict = field(default_factory=dict)  # phase -> seconds this engine spent (rollout, reward)


@dataclass(frozen=True)
class EnginePlace:
    """This rank's vLLM engine: ranks [kR, (k+1)R) of the engines' world share engine k (vLLM
    tensor parallel over them, R = parallel.rollout_tp); the first rank of each engine scores its
    completions. The engines' world is the whole world when colocated, the rollout ranks' otherwise."""

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


class EngineWorker:
    """The engine's side of a wave: generate this engine's slice of a request, and (its leader)
    score it. `weights_version` is the step whose update the engine's weights hold (0: the
    starting weights); every group it returns carries it."""

    def __init__(self, cfg, *, engine, place: EnginePlace, tokenizer, scorer):
        self.cfg, self.engine, self.place, self.tokenizer, self.scorer = cfg, engine, place, tokenizer, scorer
        self.weights_version = 0

    def part(self, req: WaveRequest, timer=None) -> EnginePart:
        sub, prompt_ids, prefix_lens = self.slice_of(req)
        version = self.weights_version
        t0 = time.perf_counter()
        with _phase(timer, "rollout"):
            outs = self._generate(req, sub, prompt_ids)
        return self.scored_part(req, sub, prompt_ids, prefix_lens, outs, version, None, t0, timer)

    def slice_of(self, req: WaveRequest) -> tuple[list, list, list]:
        """This engine's contiguous slice of a request's prompts that want completions: (items,
        prompt ids, prefix lengths)."""
        per = math.ceil(len(req.items) / self.place.count)
        first = self.place.index * per
        todo = [i for i in range(first, min(first + per, len(req.items))) if req.want[req.items[i][1]] > 0]
        return [req.items[i] for i in todo], [req.prompt_ids[i] for i in todo], [req.prefix_lens[i] for i in todo]

    def scored_part(self, req, sub, prompt_ids, prefix_lens, outs, version, switches, t0, timer=None) -> EnginePart:
        """The leader's scored EnginePart of generated completions (an empty part elsewhere);
        seconds: the rollout since t0, then the reward. version: the weights of the first tokens;
        switches: rollout.partial's [prompt][completion] weight switches (None: none)."""
        seconds = {"rollout": time.perf_counter() - t0}
        part = EnginePart()
        if self.place.leader and sub:
            t0 = time.perf_counter()
            with _phase(timer, "reward"):
                part = self._score(req.rnd, sub, prompt_ids, outs, prefix_lens, version, switches)
            seconds["reward"] = time.perf_counter() - t0
        part.seconds = seconds if self.place.leader else {}
        return part

    def evaluate(self, sets, *, renderer, step: int, dump_dir: str, is_main: bool) -> dict:
        """The eval: sets on this engine and its peers (collective over the engines' world), each
        engine its share, as a rollout splits its prompts."""
        rc = self.cfg.rollout
        return run_validation(
            sets,
            generate=engine_generate(self.engine, rc.max_new_tokens, rc.stop),
            scorer=self.scorer,
            renderer=renderer,
            cfg=self.cfg.eval,
            step=step,
            dump_dir=dump_dir,
            seed=self.cfg.trainer.seed,
            engine_index=self.place.index,
            num_engines=self.place.count,
            engine_leader=self.place.leader,
            is_main=is_main,
        )

    def _generate(self, req: WaveRequest, mine, prompt_ids) -> list:
        """want[slot] completions (rollout.vllm_engine.Completion) for each of this engine's
        prompts (rollout.partial on a rollout rank: train/partial_rollout.py instead)."""
        if not mine:
            return []
        return self.call_engine(
            prompt_ids,
            [req.want[slot] for _, slot, _ in mine],
            self.cfg.rollout.max_new_tokens,
            self.round_seeds(req, mine),
        )

    def round_seeds(self, req: WaveRequest, mine) -> list[int]:
        """Each prompt's request seed. vLLM gives completion k of a request seed s the seed s + k, so
        starting a prompt's later wave at s + drawn[slot] continues the stream: its completions are
        the ones a single call for all of them would have drawn."""
        return [rollout_seed(self.cfg.trainer.seed, req.step, req.rnd, slot) + req.drawn[slot] for _, slot, _ in mine]

    def call_engine(self, prompt_ids, n, max_new_tokens: int, seeds) -> list:
        rc = self.cfg.rollout
        return self.engine.generate(
            prompt_ids,
            n=n,
            max_new_tokens=max_new_tokens,
            temperature=rc.temperature,
            top_p=rc.top_p,
            top_k=rc.top_k,
            stop=rc.stop or None,
            seeds=seeds,
        )

    def _score(self, rnd, mine, prompt_ids, outs, prefix_lens, version, switches) -> EnginePart:
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
                policy_version=version,
                version_switches=switches[q] if switches and any(switches[q]) else [],
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


class _phase:
    """timer(name) when there is a timer (the trainer's PhaseTimer), else nothing."""

    def __init__(self, timer, name: str):
        self.cm = timer(name) if timer is not None else None

    def __enter__(self):
        return self.cm.__enter__() if self.cm is not None else None

    def __exit__(self, *exc):
        return self.cm.__exit__(*exc) if self.cm is not None else False


class LocalEngines:
    """Colocated: this rank's own engine generates (and its leader scores) its slice at once; the
    parts are all-gathered over the training world."""

    remote = False

    def __init__(self, worker: EngineWorker):
        self.worker = worker
        self._part: EnginePart | None = None

    def submit(self, req: WaveRequest, timer=None) -> None:
        self._part = self.worker.part(req, timer)

    def parts(self, timer=None, ticket=None) -> list[EnginePart]:
        part, self._part = self._part, None
        return mdist.all_gather_objects(part)

    def set_weights_version(self, version: int) -> None:
        self.worker.weights_version = version


class RemoteEngines:
    """Dedicated rollout ranks: training rank 0 sends each request over the control bridge and
    returns at once (a thread of every rollout rank is always there to take it, train/rollout_rank.py);
    the rollout ranks answer in the order of the requests on the replies bridge. `submit` gives the
    request a ticket (its place in that order, the same on every training rank); `parts(ticket)`
    waits for that reply, keeping any earlier one it reads on the way (a round in flight for a later
    step, trainer.max_staleness = k) until it is asked for."""

    remote = True

    def __init__(self, control, replies, watchdog=None):
        # run/bridge.Bridge on training rank 0, None on the other training ranks
        self.control, self.replies, self.watchdog = control, replies, watchdog
        self.sent = 0  # tickets given out
        self.read = 0  # replies read, in ticket order
        self.kept: dict[int, list] = {}  # ticket -> the reply read before it was asked for

    def request(self, kind: str, payload) -> int:
        """Send one request (any kind that is answered) -> its ticket."""
        if self.control is not None:
            self.control.broadcast_object((kind, payload))
        self.sent += 1
        return self.sent - 1

    def submit(self, req: WaveRequest, timer=None) -> int:
        return self.request("wave", req)

    def reply(self, ticket: int | None = None, timer=None) -> list:
        """Every rollout rank's reply to request `ticket` (default: the last one sent), on every
        training rank; the wait is timer's `rollout_wait`."""
        ticket = self.sent - 1 if ticket is None else ticket
        if not 0 <= ticket < self.sent or (ticket < self.read and ticket not in self.kept):
            raise RuntimeError(f"no rollout request {ticket} in flight ({self.sent} sent, {self.read} read)")
        with _phase(timer, "rollout_wait"):
            while ticket not in self.kept:
                got = self.replies.gather_objects() if self.replies is not None else None
                self.kept[self.read] = mdist.broadcast_object(got)
                self.read += 1
        return self.kept.pop(ticket)

    def parts(self, timer=None, ticket: int | None = None) -> list[EnginePart]:
        """The rollout ranks' parts of a wave (default: the last request sent)."""
        return self.reply(ticket, timer)

    def drain(self) -> None:
        """Training rank 0 alone (the stop): read and drop every reply still owed, since a rollout
        rank sends each one before it reads the stop."""
        while self.read < self.sent and self.replies is not None:
            self.replies.gather_objects()
            self.read += 1


class StepRollout:
    """`rollout(step, rnd, items, counts, timer)` -> the scored groups of the prompts `items`,
    gathered on every training rank in slot order. `submit_first` starts a round's first wave
    without waiting (dedicated rollout ranks: the next step's prompts roll out while this step
    trains); the call that finishes the round then gets the parts `engines.parts()` returned."""

    def __init__(self, cfg, method, *, engines, renderer, history, curriculum, watchdog):
        self.cfg, self.method, self.engines = cfg, method, engines
        self.renderer, self.history, self.curriculum, self.watchdog = renderer, history, curriculum, watchdog

    def _prompts(self, step, items) -> tuple[list[list[int]], list[int]]:
        prompt_ids = [self.renderer.token_ids(rec) for rec, _, _ in items]
        prefix_lens = [0] * len(items)
        if self.curriculum:  # AdaPrefix: the reference's prefix opens the completion (as prompt tokens)
            assisted = [self.curriculum.assisted(rec, ids, step) for (rec, _, _), ids in zip(items, prompt_ids)]
            prompt_ids, prefix_lens = [ids for ids, _ in assisted], [n for _, n in assisted]
        return prompt_ids, prefix_lens

    def _request(self, step, rnd, items, prompts, by_slot) -> WaveRequest | None:
        """The next wave's request (None: every group is done): each prompt's whole group in one
        call, or the selection's next wave (BPPO's, decided on its own verdicts before reward shaping)."""
        drawn = {slot: by_slot[slot].group_size if slot in by_slot else 0 for _, slot, _ in items}
        group_size = self.cfg.rollout.group_size
        want = {slot: self.method.selection.completions_wanted(by_slot.get(slot), group_size) for slot in drawn}
        if not any(want.values()):
            return None
        return WaveRequest(step, rnd, items, prompts[0], prompts[1], want, drawn)

    def submit_first(self, step: int, rnd: int, items: list[tuple]) -> int | None:
        """Send the first wave of a round (what __call__ would send first) and return at once ->
        its ticket (None: nothing to generate)."""
        req = self._request(step, rnd, items, self._prompts(step, items), {})
        return None if req is None else self.engines.submit(req)

    def __call__(self, step, rnd, items, counts: RolloutCounts, timer, first_parts=None) -> list[Group]:
        """items: (record, slot, w_q) of the prompts to roll out. Each engine generates a contiguous
        slice, its leader scores it, the groups are gathered in slot order and every one is
        recorded in the prompt history. With BPPO's waves (algorithm.bppo.schedule=waves) a prompt
        gets g0 completions at a time until its group is mixed or full (bppo.next_wave); every rank
        sees every group after each wave's gather, so all decide the next wave alike.
        first_parts: the engines' parts of the first wave, already submitted (submit_first)."""
        counts.prompts_rolled += len(items)
        prompts = self._prompts(step, items)
        by_slot: dict[int, Group] = {}
        while True:
            if first_parts is not None:
                parts, first_parts = first_parts, None
            else:
                req = self._request(step, rnd, items, prompts, by_slot)
                if req is None:
                    break
                self.engines.submit(req, timer)
                self.watchdog.phase("gather rollouts", step)
                parts = self.engines.parts(timer)
            for g in self._groups(parts, counts, timer):
                if g.slot in by_slot:
                    by_slot[g.slot].extend(g)
                else:
                    by_slot[g.slot] = g
        groups = sorted(by_slot.values(), key=lambda g: g.slot)
        for run in size_runs(groups):
            self.history.update([g.record.id for g in run], stack_rewards(run))
        return groups

    def _groups(self, parts: list[EnginePart], counts: RolloutCounts, timer) -> list[Group]:
        errors = [p.error for p in parts if p.error]
        if errors:
            raise RuntimeError(errors[0])
        groups = []
        for p in parts:
            counts.generated_tokens += p.generated_tokens
            counts.reward_checks += p.checks
            counts.add_failures(p.failures, p.first_failures)
            groups += p.groups
        if self.engines.remote:  # the engines' own time (colocated, the timer measured it here)
            for phase in ("rollout", "reward", "idle"):
                counts.engine_seconds[phase] = counts.engine_seconds.get(phase, 0.0) + max(
                    (p.seconds.get(phase, 0.0) for p in parts), default=0.0
                )
        return groups


@dataclass
class PendingRound:
    """A step's first round, drawn and sent to the rollout ranks up to trainer.max_staleness steps
    before it: the drawn prompts and pruning decisions, the step's generator (the step continues it),
    its counts, the request's ticket (RemoteEngines) and the engines' parts once received. A
    checkpoint holds it with its parts (to_state), so a resumed run trains the step on the same
    completions."""

    step: int
    round: object  # algorithms.batch.Round
    generator: torch.Generator
    counts: RolloutCounts
    parts: list[EnginePart] | None = None
    ticket: int | None = None  # None: nothing was sent (every prompt pruned), or restored with its parts

    def take_parts(self, engines, timer=None) -> list[EnginePart] | None:
        """The parts, read from the engines first if still in flight."""
        if self.parts is None and self.ticket is not None:
            self.parts = engines.parts(timer, self.ticket)
        return self.parts

    def to_state(self) -> dict:
        """JSON-able: records by id, tensors as lists (no pickle: checkpoints are never unpickled).
        Its parts must have been read (take_parts): a reply still in flight is not in a checkpoint."""
        if self.parts is None and self.ticket is not None:
            raise RuntimeError(f"step {self.step}'s rollout is still in flight: read its parts before saving it")
        return {
            "step": self.step,
            "round": {
                "record_ids": [r.id for r in self.round.records],
                "keep": self.round.keep.tolist(),
                "weight": self.round.weight.tolist(),
            },
            "generator": self.generator.get_state().tolist(),
            "counts": dataclasses.asdict(self.counts),
            "parts": None if self.parts is None else [_part_state(p) for p in self.parts],
        }

    @classmethod
    def from_state(cls, state: dict, records_by_id: dict) -> PendingRound:
        from megatron_dppo.algorithms.batch import Round

        def record(rid):
            if rid not in records_by_id:
                raise ValueError(
                    f"the checkpoint's in-flight rollout names prompt {rid!r}, which data.train no longer has: "
                    "resume with the data the run was started with"
                )
            return records_by_id[rid]

        r = state["round"]
        rnd = Round(
            [record(i) for i in r["record_ids"]],
            torch.tensor(r["keep"], dtype=torch.bool),
            torch.tensor(r["weight"], dtype=torch.float32),
        )
        gen = torch.Generator()
        gen.set_state(torch.tensor(state["generator"], dtype=torch.uint8))
        parts = None
        if state["parts"] is not None:
            parts = [
                EnginePart(
                    groups=[Group.from_state(g, record(g["record_id"])) for g in p["groups"]],
                    **{k: v for k, v in p.items() if k != "groups"},
                )
                for p in state["parts"]
            ]
        return cls(state["step"], rnd, gen, RolloutCounts(**state["counts"]), parts)


def _part_state(part: EnginePart) -> dict:
    out = {f.name: getattr(part, f.name) for f in dataclasses.fields(part) if f.name != "groups"}
    out["groups"] = [g.to_state() for g in part.groups]
    return out
