"""Partial rollouts on a rollout rank (rollout.partial): the rounds queued for this engine are
generated together, rollout.partial_chunk tokens at a time.

Between chunks:
  * the weights that arrived meanwhile load (`between_chunks`, out of the requests' turn), and every
    completion still going finishes under them: each token keeps the log-prob of the weights that
    sampled it, and the group records [token index, version] where a completion changed weights;
  * the rounds that arrived meanwhile join, so the next round's completions fill the engine while
    the last round's longest ones finish (the long tail no longer idles it);
  * each round whose completions are all done is scored and its reply sent, in the order the rounds
    were sent (a later round that finishes first waits for the earlier ones).

A round's first chunk is one call per prompt with the round's seeds (what a whole call would
sample first); each later chunk of a completion is a request of its own (its prompt and tokens so
far, a seed of its own per chunk), so chunks draw other random numbers than one call would, and
where the weights change depends on timing: a partial run is not reproducible token for token.

Why by hand: vLLM 0.32's offline engine generates a batch to its end; aborting and resubmitting
with the tokens so far is how verl's and slime's partial rollouts continue a completion, and the
chunk loop here is that, with the points where weights may change made explicit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from megatron_dppo.rollout.vllm_engine import Completion, request_seed


@dataclass
class _Round:
    """One round's slice on this engine, as it is generated."""

    req: object  # train/step_rollout.WaveRequest
    sub: list  # (record, slot, w_q) of this engine's prompts
    prompt_ids: list[list[int]]
    prefix_lens: list[int]
    n: list[int]  # completions per prompt
    seeds: list[int]  # per prompt: the round's seed for it (completion k: + k)
    admitted: float
    outs: list[list[Completion]] | None = None  # None until its first chunk
    switches: list = field(default_factory=list)  # [prompt][completion] -> [[token index, version], ...]
    version: int = 0  # the weights of its first chunk
    chunks: int = 0

    def going(self, rc) -> list[tuple[int, int]]:
        """(prompt, completion) still to be continued: cut by the chunk, not by eos, a stop or a limit."""
        if self.outs is None:
            return []
        return [
            (i, k)
            for i, group in enumerate(self.outs)
            for k, c in enumerate(group)
            if c.finish_reason == "length"
            and len(c.token_ids) < rc.max_new_tokens
            and len(self.prompt_ids[i]) + len(c.token_ids) < rc.max_model_len - 1
        ]

    def done(self, rc) -> bool:
        return self.outs is not None and not self.going(rc)


class ChunkedRounds:
    """The rounds in flight on this engine (module docstring). worker: the rank's EngineWorker
    (its engine, config, weights_version, scoring); between_chunks(step, started) loads the weights
    that arrived, bumping worker.weights_version -> whether it did (step: the earliest round's, which
    the trainer needs first; started: whether any round has tokens yet)."""

    def __init__(self, worker, between_chunks):
        self.worker, self.between_chunks = worker, between_chunks
        self.rounds: list[_Round] = []

    @property
    def empty(self) -> bool:
        return not self.rounds

    def admit(self, req) -> None:
        sub, prompt_ids, prefix_lens = self.worker.slice_of(req)
        self.rounds.append(
            _Round(
                req,
                sub,
                prompt_ids,
                prefix_lens,
                n=[req.want[slot] for _, slot, _ in sub],
                seeds=self.worker.round_seeds(req, sub),
                admitted=time.perf_counter(),
                outs=None if sub else [],
            )
        )

    def step(self) -> None:
        """One chunk of every round in flight (after loading any weights that arrived)."""
        rc = self.worker.cfg.rollout
        started = any(r.outs for r in self.rounds)
        if self.between_chunks(min(r.req.step for r in self.rounds), started):
            version = self.worker.weights_version
            for r in self.rounds:
                for i, k in r.going(rc):
                    r.switches[i][k].append([len(r.outs[i][k].token_ids), version])
        calls: dict[int, list] = {}  # max new tokens -> [(prompt ids, n, seed, where the output goes)]
        for r in self.rounds:
            if r.outs is None:
                for i, ids in enumerate(r.prompt_ids):
                    calls.setdefault(min(rc.partial_chunk, rc.max_new_tokens), []).append(
                        (ids, r.n[i], r.seeds[i], (r, i, None))
                    )
            else:
                for i, k in r.going(rc):
                    c = r.outs[i][k]
                    calls.setdefault(min(rc.partial_chunk, rc.max_new_tokens - len(c.token_ids)), []).append(
                        (
                            list(r.prompt_ids[i]) + c.token_ids,
                            1,
                            request_seed("partial", r.seeds[i] + k, r.chunks),
                            (r, i, k),
                        )
                    )
        for budget, entries in calls.items():
            outs = self.worker.call_engine(
                [e[0] for e in entries], [e[1] for e in entries], budget, [e[2] for e in entries]
            )
            for (_, _, _, (r, i, k)), group in zip(entries, outs):
                if k is None:  # a round's first chunk
                    if r.outs is None:
                        r.outs = [[] for _ in r.prompt_ids]
                        r.switches = [[] for _ in r.prompt_ids]
                        r.version = self.worker.weights_version
                    r.outs[i] = [Completion(list(c.token_ids), list(c.logprobs), c.finish_reason) for c in group]
                    r.switches[i] = [[] for _ in group]
                else:
                    (c,) = group
                    done = r.outs[i][k]
                    done.token_ids += c.token_ids
                    done.logprobs += c.logprobs
                    done.finish_reason = c.finish_reason
        for r in self.rounds:
            r.chunks += 1

    def finished(self) -> list:
        """The EngineParts of the rounds done at the front of the queue (the order they were sent),
        scored, their seconds the engine's time since each was admitted."""
        rc, parts = self.worker.cfg.rollout, []
        while self.rounds and self.rounds[0].done(rc):
            r = self.rounds.pop(0)
            parts.append(
                self.worker.scored_part(
                    r.req, r.sub, r.prompt_ids, r.prefix_lens, r.outs, r.version, r.switches, r.admitted
                )
            )
        return parts
