"""rollout.partial on a rollout rank (train/step_rollout.EngineWorker._generate_in_chunks): a round
generated rollout.partial_chunk tokens at a time; new weights that arrived load between chunks and
the unfinished completions go on under them, each token keeping the log-prob of the weights that
sampled it; the group records where each completion changed weights, and its lag counts from its
first tokens."""

from types import SimpleNamespace

from megatron_dppo.algorithms.records import Group, policy_lags
from megatron_dppo.config import Config
from megatron_dppo.rollout.vllm_engine import Completion
from megatron_dppo.train.partial_rollout import ChunkedRounds
from megatron_dppo.train.step_rollout import EnginePlace, EngineWorker

EOS = 99


class Engine:
    """A stand-in for RolloutEngine.generate: completion k of a call counts up from its prompt's last
    token + 100 k, and stops (eos) where it would reach 104; its log-probs are -(weights version)
    each, so a token's log-prob says which weights sampled it."""

    def __init__(self):
        self.version, self.calls = 0, []

    def generate(self, prompt_token_ids, n, max_new_tokens, seeds, **kw):
        self.calls.append((len(prompt_token_ids), n, max_new_tokens))
        counts = [n] * len(prompt_token_ids) if isinstance(n, int) else n
        out = []
        for ids, count in zip(prompt_token_ids, counts):
            group = []
            for k in range(count):
                toks, finish = [], "length"
                for j in range(max_new_tokens):
                    t = ids[-1] + 100 * k + j + 1
                    if t == 104:
                        toks, finish = toks + [EOS], "stop"
                        break
                    toks.append(t)
                group.append(Completion(toks, [-float(self.version)] * len(toks), finish))
            out.append(group)
        return out


class Scorer:
    def score(self, texts, answers, recs):
        return [1.0 if "103" in t else 0.0 for t in texts], {}


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _rounds(chunk=2, max_new=7, switch_at=(2,)):
    cfg = Config()
    cfg.rollout.partial, cfg.rollout.partial_chunk, cfg.rollout.max_new_tokens = True, chunk, max_new
    engine = Engine()
    worker = EngineWorker(cfg, engine=engine, place=EnginePlace(0, 1, True), tokenizer=Tokenizer(), scorer=Scorer())
    calls = []

    def between_chunks(step, started):
        calls.append(step)
        if len(calls) in switch_at:
            engine.version = worker.weights_version = worker.weights_version + 1
            return True
        return False

    return ChunkedRounds(worker, between_chunks), engine, calls


def _req(step=3, prompts=([0, 1], [10, 11]), want=(2, 1)):
    rec = SimpleNamespace(id="p0", answer="")
    items = [(rec, slot, 1.0) for slot in range(len(prompts))]
    return SimpleNamespace(
        step=step,
        rnd=0,
        items=items,
        prompt_ids=[list(p) for p in prompts],
        prefix_lens=[0] * len(prompts),
        want=dict(enumerate(want)),
        drawn={slot: 0 for slot in range(len(prompts))},
    )


def _run(rounds, steps=20):
    parts = []
    for _ in range(steps):
        if rounds.empty:
            break
        rounds.step()
        parts += rounds.finished()
    return parts


def test_unfinished_completions_go_on_under_the_new_weights_and_say_where():
    rounds, engine, calls = _rounds(switch_at=(2,))  # weights arrive during the first chunk
    rounds.admit(_req())
    (part,) = _run(rounds)
    g0, g1 = part.groups
    # prompt 1: 7 tokens in chunks 2, 2, 2, 1; the weights changed after the first chunk
    assert g1.completions == [list(range(12, 19))] and g1.truncated == [True]
    assert g1.sampling_logprobs == [[-0.0] * 2 + [-1.0] * 5] and g1.version_switches == [[[2, 1]]]
    # prompt 0, completion 1 stopped (eos) in the second chunk, under the new weights
    assert g0.completions[1] == [102, 103, EOS] and g0.truncated[1] is False
    assert g0.version_switches[1] == [[2, 1]] and g0.policy_version == 0  # its lag counts from its first tokens
    assert set(calls) == {3}  # between_chunks is told the round's step
    assert max(m for _, _, m in engine.calls) <= 2  # no call asks for more than a chunk


def test_a_completion_done_in_its_first_chunk_never_changes_weights():
    rounds, _, _ = _rounds(chunk=8, max_new=8)
    rounds.admit(_req())
    (part,) = _run(rounds)
    assert part.groups[0].completions[1] == [102, 103, EOS] and part.groups[0].switches()[1] == []


def test_a_later_round_fills_the_engine_while_the_first_finishes_and_replies_wait_their_turn():
    """Round B (short completions) joins after round A's first chunk: its first chunk is generated in
    the same chunk as A's continuation, it finishes first, and its reply still comes after A's."""
    rounds, engine, _ = _rounds(switch_at=())
    rounds.admit(_req(step=3, prompts=([10, 11],), want=(1,)))  # A: 7 tokens, 4 chunks
    rounds.step()
    assert rounds.finished() == []
    rounds.admit(_req(step=4, prompts=([0, 102],), want=(1,)))  # B: [103, EOS] in its first chunk
    engine.calls.clear()
    rounds.step()
    assert len(engine.calls) == 1 and engine.calls[0][0] == 2  # A's continuation and B's first chunk together
    assert rounds.finished() == [] and rounds.rounds[1].done(rounds.worker.cfg.rollout)  # B done, waits for A
    parts = _run(rounds)
    assert [p.groups[0].completions[0][:1] for p in parts] == [[12], [103]]  # A's reply, then B's


def test_the_group_records_the_switches_and_its_lag_counts_from_its_first_tokens():
    g = Group(
        SimpleNamespace(id="p0"),
        0,
        0,
        [1],
        [[5, 6, 7], [5, EOS]],
        [1.0, 0.0],
        sampling_logprobs=[[-0.1, -0.2, -0.3], [-0.1, -0.2]],
        policy_version=3,
        version_switches=[[[1, 4]], []],
    )
    assert policy_lags([g], 4) == [1, 1]  # by the oldest token's weights
    rows = g.rollout_rows(lambda ids: " ".join(map(str, ids)))
    assert rows[0]["version_switches"] == [[1, 4]] and rows[0]["rollout_logprobs"] == [-0.1, -0.2, -0.3]
    assert "version_switches" not in rows[1]
    other = Group(SimpleNamespace(id="p0"), 0, 0, [1], [[8]], [1.0], sampling_logprobs=[[-0.5]], policy_version=3)
    g.extend(other)
    assert g.switches() == [[[1, 4]], [], []]
    assert Group.from_state(g.to_state(), g.record).version_switches == g.version_switches
