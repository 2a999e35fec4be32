"""rollout.partial on a rollout rank (train/step_rollout.EngineWorker._generate_in_chunks): a round
generated rollout.partial_chunk tokens at a time; new weights that arrived load between chunks and
the unfinished completions go on under them, each token keeping the log-prob of the weights that
sampled it; the group records where each completion changed weights, and its lag counts from its
first tokens."""

from types import SimpleNamespace

from megatron_dppo.algorithms.records import Group, policy_lags
from megatron_dppo.config import Config
from megatron_dppo.rollout.vllm_engine import Completion
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


def _worker(chunk=2, max_new=7, switch_at=(1,)):
    cfg = Config()
    cfg.rollout.partial, cfg.rollout.partial_chunk, cfg.rollout.max_new_tokens = True, chunk, max_new
    engine = Engine()
    worker = EngineWorker(cfg, engine=engine, place=EnginePlace(0, 1, True), tokenizer=None, scorer=None)
    calls = []

    def between_chunks(step):
        calls.append(step)
        if len(calls) in switch_at:
            engine.version = worker.weights_version = worker.weights_version + 1
            return True
        return False

    worker.between_chunks = between_chunks
    return worker, engine, calls


def _req(step=3):
    rec = SimpleNamespace(id="p0")
    return SimpleNamespace(step=step, rnd=0, want={0: 2, 1: 1}, drawn={0: 0, 1: 0}), [(rec, 0, 1.0), (rec, 1, 1.0)]


def test_unfinished_completions_go_on_under_the_new_weights_and_say_where():
    worker, engine, calls = _worker()
    req, mine = _req()
    outs, switches = worker._generate(req, mine, [[0, 1], [10, 11]])
    # prompt 1: 7 tokens in chunks 2, 2, 2, 1, the weights changed after the first chunk
    (c,) = outs[1]
    assert c.token_ids == list(range(12, 19)) and c.finish_reason == "length"
    assert c.logprobs == [-0.0] * 2 + [-1.0] * 5 and switches[1] == [[[2, 1]]]
    # prompt 0, completion 1 stopped (eos) in the second chunk, under the new weights
    stopped = outs[0][1]
    assert stopped.token_ids[-1] == EOS and stopped.finish_reason == "stop"
    assert switches[0][1] == [[2, 1]] and len(stopped.logprobs) == len(stopped.token_ids)
    assert calls and set(calls) == {3}  # between_chunks is told the round's step
    assert max(m for _, _, m in engine.calls) <= 2  # no call asks for more than a chunk


def test_a_completion_done_in_its_first_chunk_never_changes_weights():
    worker, _, _ = _worker(chunk=8, max_new=8)
    req, mine = _req()
    outs, switches = worker._generate(req, mine, [[0, 1], [10, 11]])
    assert outs[0][1].token_ids == [102, 103, EOS] and switches[0][1] == []


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
