"""RolloutEngine (vLLM, in-process, CPU) against plain transformers on a tiny random Qwen3.

One engine for the module (start-up costs seconds); a torchrun job covers TP=2. The model's
non-norm weights are drawn with std 0.3 (not HF's 0.02) so the next-token distributions are
peaked: greedy argmax has no near-ties for fp32 rounding to flip.
"""

import contextlib
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from megatron_dppo.rollout import RolloutEngine, hf_completion_logprobs, request_seed
from megatron_dppo.rollout.vllm_engine import _executor_backend, _named_kv_cache_errors

REPO = Path(__file__).resolve().parents[2]
# torch's own function, taken before any engine exists (vLLM is imported by RolloutEngine only)
_SET_NUM_THREADS_BEFORE_VLLM = torch.set_num_threads
EOS = 2
SHORT = [[4, 5, 13, 6, 16], [7, 8, 9], [30, 31]]
# Longer than one 32-token KV block: its first block lands in vLLM's prefix cache.
LONG = list(range(3, 43))


def _save_tiny_qwen3(path: Path, seed: int) -> Qwen3ForCausalLM:
    symbols = ["<pad>", "<bos>", "<eos>"] + list("0123456789+-*=abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTU")
    tok = Tokenizer(models.WordLevel({s: i for i, s in enumerate(symbols)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token per character
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    ).save_pretrained(path)
    cfg = Qwen3Config(
        vocab_size=len(symbols),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=128,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    model = Qwen3ForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_qwen3")
    return {
        "old_dir": root / "old",
        "old": _save_tiny_qwen3(root / "old", seed=0),
        "new_dir": root / "new",
        "new": _save_tiny_qwen3(root / "new", seed=1),
    }


@pytest.fixture(scope="module")
def engine(tiny):
    # block_size 32: vLLM's CPU default (128) exceeds max_model_len, so no prefix would ever be
    # cached and the stale-prefix check below would be vacuous.
    eng = RolloutEngine(
        str(tiny["old_dir"]), dtype="float32", max_model_len=128, seed=0, kv_cache_memory_bytes=16 << 20, block_size=32
    )
    yield eng
    eng.close()


def _hf_greedy(model, prompt, max_new_tokens):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids.append(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax().item())
            if ids[-1] == EOS:
                break
    return ids[len(prompt) :]


def _max_err(model, prompts, completions, temperature=1.0):
    ref = hf_completion_logprobs(model, prompts, [c.token_ids for c in completions], temperature)
    return max((r - torch.tensor(c.logprobs)).abs().max().item() for r, c in zip(ref, completions))


def _check_finish(c, max_new_tokens):
    assert len(c.logprobs) == len(c.token_ids) > 0
    assert EOS not in c.token_ids[:-1]
    if c.finish_reason == "stop":
        assert c.token_ids[-1] == EOS
    else:
        assert c.finish_reason == "length" and len(c.token_ids) == max_new_tokens


def test_greedy_matches_transformers(engine, tiny):
    prompts = SHORT + [LONG]
    out = engine.generate(prompts, n=1, max_new_tokens=24, temperature=0.0)
    completions = [r[0] for r in out]
    for p, c in zip(prompts, completions):
        assert c.token_ids == _hf_greedy(tiny["old"], p, 24)
        _check_finish(c, 24)
    assert {c.finish_reason for c in completions} == {"stop", "length"}  # both paths exercised
    assert _max_err(tiny["old"], prompts, completions) < 1e-4


def test_sampling_seeds_n_and_raw_logprobs(engine, tiny):
    prompts = SHORT + [SHORT[0]]  # a duplicate prompt must still get its own samples
    out = engine.generate(prompts, n=4, max_new_tokens=16, temperature=0.8, seed=7)
    assert [len(r) for r in out] == [4] * len(prompts)
    tokens = [[c.token_ids for c in r] for r in out]
    assert tokens == [[c.token_ids for c in r] for r in engine.generate(prompts, 4, 16, 0.8, seed=7)]
    assert tokens != [[c.token_ids for c in r] for r in engine.generate(prompts, 4, 16, 0.8, seed=8)]
    assert all(len({tuple(t) for t in group}) > 1 for group in tokens)
    assert not {tuple(t) for t in tokens[0]} & {tuple(t) for t in tokens[-1]}
    flat = [c for r in out for c in r]
    for c in flat:
        _check_finish(c, 16)
    assert any(c.finish_reason == "stop" for c in flat)
    # raw_logprobs (the default) are log_softmax of the logits at temperature 1, not 0.8.
    flat_prompts = [p for p in prompts for _ in range(4)]
    assert _max_err(tiny["old"], flat_prompts, flat, temperature=1.0) < 1e-4
    assert _max_err(tiny["old"], flat_prompts, flat, temperature=0.8) > 1e-2
    assert len({request_seed(7, i) + k for i in range(100) for k in range(16)}) == 1600


def test_sampling_compiles_nothing_on_cpu(engine):
    """vLLM's sampled-token rank runs eagerly on CPU (vllm_engine._eager_token_ranks): sampling with
    log-probs compiles no graph (compiling it cost each process 5-10 s at its first sampling call)."""
    from torch._dynamo.utils import counters
    from vllm.v1.sample import sampler

    assert not hasattr(sampler.batched_count_greater_than, "_torchdynamo_orig_callable")
    before = dict(counters["stats"])
    engine.generate(SHORT, n=2, max_new_tokens=8, temperature=1.0, seed=3)
    assert dict(counters["stats"]) == before


def test_seeded_prompts_beyond_one_scheduler_step(engine, tiny):
    """More prompt tokens than one vLLM step admits (4096 on CPU): with chunked prefill on, the
    prompt that straddles the budget is split and vLLM's CPU runner fails it ("CPU Generator does
    not use offset", seen first with AdaPrefix's hinted prompts). Queued whole, each prompt still
    samples from its own seed: the same tokens as when it is generated alone. The prompts are
    distinct random tokens: shared 32-token prefixes would hit vLLM's prefix cache within the step
    and shrink its prefill below the budget."""
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 60, (192, 36), generator=gen).tolist()  # 6912 prompt tokens
    seeds = [request_seed(7, i) for i in range(len(prompts))]
    out = engine.generate(prompts, n=1, max_new_tokens=8, temperature=1.0, seeds=seeds)
    assert [len(r) for r in out] == [1] * len(prompts)
    for i in (0, 120, 191):
        alone = engine.generate([prompts[i]], n=1, max_new_tokens=8, temperature=1.0, seeds=[seeds[i]])[0]
        assert alone[0].token_ids == out[i][0].token_ids
    assert _max_err(tiny["old"], prompts[:16], [r[0] for r in out[:16]], temperature=1.0) < 1e-4


def test_load_weights_syncs_new_weights(engine, tiny):
    old, new = tiny["old"], tiny["new"]
    before = engine.generate([LONG], n=1, max_new_tokens=16, temperature=0.0)[0][0]  # caches LONG's prefix
    try:
        # Buckets of one tensor each: q/k/v and gate/up of a layer arrive in different buckets.
        stats = engine.load_weights([item] for item in new.state_dict().items())
        assert stats["num_tensors"] == len(new.state_dict()) and stats["seconds"] > 0
        after = engine.generate([LONG], n=1, max_new_tokens=16, temperature=0.0)[0][0]
        assert after.token_ids == _hf_greedy(new, LONG, 16)
        assert _max_err(new, [LONG], [after]) < 1e-4
        assert _max_err(old, [LONG], [after]) > 0.1

        # The failure load_weights guards against: a reload without resetting the prefix cache
        # reuses KV blocks computed with the previous weights.
        engine.generate([LONG], n=1, max_new_tokens=4, temperature=0.0)  # cache LONG under `new`
        engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(old.state_dict().items())})
        stale = engine.generate([LONG], n=1, max_new_tokens=16, temperature=0.0)[0][0]
        assert _max_err(old, [LONG], [stale]) > 0.1
    finally:
        engine.load_weights(old.state_dict().items())  # plain (name, tensor) pairs
    restored = engine.generate([LONG], n=1, max_new_tokens=16, temperature=0.0)[0][0]
    assert restored.token_ids == before.token_ids
    assert _max_err(old, [LONG], [restored]) < 1e-4


def test_context_wraps_generation_and_weight_loads(engine, tiny):
    class CountingMode(torch.overrides.TorchFunctionMode):  # stands in for the CPU shim
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            CountingMode.calls += 1
            return func(*args, **(kwargs or {}))

    engine.context = CountingMode
    try:
        engine.generate([SHORT[0]], n=1, max_new_tokens=4, temperature=0.0)
        after_generate = CountingMode.calls
        engine.load_weights(tiny["old"].state_dict().items())
    finally:
        engine.context = contextlib.nullcontext
    assert 0 < after_generate < CountingMode.calls  # the model ran inside the context


def test_set_num_threads_still_works(engine):
    """vLLM on CPU replaces torch.set_num_threads by a no-op; the engine must put it back. Setting
    the count the process already has (1 under OMP_NUM_THREADS=1) would pass with the no-op too,
    so the test sets a different one and compares with the function torch had before vLLM."""
    assert torch.set_num_threads is _SET_NUM_THREADS_BEFORE_VLLM
    n = torch.get_num_threads()
    other = 2 if n == 1 else 1
    try:
        torch.set_num_threads(other)
        assert torch.get_num_threads() == other
    finally:
        _SET_NUM_THREADS_BEFORE_VLLM(n)
    assert torch.get_num_threads() == n


def test_refuses_torchrun_without_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="init_process_group"):
        _executor_backend(1)


@pytest.mark.parametrize(
    "tp, per_rank, ranks",
    # examples/tiny/model: K and V x 3 layers x head_dim 32 x 4 bytes (float32) x the rank's KV heads
    # (2 KV heads: 2 at TP 1, 1 at TP 2, 1 replicated at TP 4)
    [
        (1, 2 * 3 * 2 * 32 * 4, ""),
        (2, 2 * 3 * 1 * 32 * 4, " on each of the engine's 2 ranks"),
        (4, 768, " on each of the engine's 4 ranks"),
    ],
)
def test_kv_cache_error_counts_one_ranks_kv_heads(tp, per_rank, ranks):
    """vLLM's KV cache size (kv_cache_memory_bytes) is per rank and each rank holds its share of the
    KV heads: the error's bytes a token are one rank's, as `megatron-dppo plan` counts them."""
    with pytest.raises(ValueError) as e, _named_kv_cache_errors("examples/tiny/model", "float32", 32, 200_000, tp):
        raise ValueError("No available memory for the cache blocks")
    assert f"({per_rank} bytes a token{ranks} for this model;" in str(e.value)


def test_tensor_parallel_two_ranks(tiny, tmp_path, torchrun):
    """TP=2 across two torchrun ranks, processed_logprobs, weight sync, close(): see the worker."""
    out = tmp_path / "tp.json"
    torchrun(
        REPO / "tests/dist/workers/model/vllm_tp_worker.py",
        2,
        "--model-dir",
        tiny["old_dir"],
        "--new-model-dir",
        tiny["new_dir"],
        "--out",
        out,
        timeout=400,
    )
    result = json.loads(out.read_text())
    assert result["err_old"] < 1e-4 and result["err_new"] < 1e-4
    assert result["world_after_close"] == 2
