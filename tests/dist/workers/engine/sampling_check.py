"""Stop strings and top_k through RolloutEngine.generate on the tiny model (run by
tests/engine/test_sampling.py in its own process: one vLLM engine per process). Prints one JSON line."""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO))

from megatron_dppo.data.prompts import PromptRenderer, load_records  # noqa: E402
from megatron_dppo.rollout import RolloutEngine  # noqa: E402


def main():
    from transformers import AutoTokenizer

    model = str(REPO / "examples" / "tiny" / "model")
    tok = AutoTokenizer.from_pretrained(model)
    renderer = PromptRenderer(tok)
    prompts = [
        renderer.token_ids(r) for r in load_records(str(REPO / "examples" / "tiny" / "data" / "test.jsonl"))[:48]
    ]
    engine = RolloutEngine(model, dtype="float32", max_model_len=32, kv_cache_memory_bytes=16 << 20)
    report = {"stop": []}
    try:
        for stop in (["5"], ["12"], ["9", "0"]):
            for temperature, n in ((0.0, 1), (1.0, 4)):
                free = engine.generate(prompts, n=n, max_new_tokens=6, temperature=temperature, seed=3)
                cut = engine.generate(prompts, n=n, max_new_tokens=6, temperature=temperature, seed=3, stop=stop)
                pairs = [(f, c) for fg, cg in zip(free, cut) for f, c in zip(fg, cg)]
                report["stop"].append(
                    {
                        "stop": stop,
                        "n": n,
                        "pairs": [
                            {
                                "free_ids": f.token_ids,
                                "cut_ids": c.token_ids,
                                "free_logprobs": f.logprobs,
                                "cut_logprobs": c.logprobs,
                                "cut_text": tok.decode(c.token_ids, skip_special_tokens=True),
                                "free_text": tok.decode(f.token_ids, skip_special_tokens=True),
                                "finish": c.finish_reason,
                            }
                            for f, c in pairs
                        ],
                    }
                )
        greedy = engine.generate(prompts, n=1, max_new_tokens=6, temperature=0.0)
        top1 = engine.generate(prompts, n=2, max_new_tokens=6, temperature=1.0, top_k=1, seed=5)
        sampled = engine.generate(prompts, n=2, max_new_tokens=6, temperature=1.0, seed=5)
        report["greedy"] = [g[0].token_ids for g in greedy]
        report["top1"] = [[c.token_ids for c in g] for g in top1]
        report["sampled"] = [[c.token_ids for c in g] for g in sampled]
    finally:
        engine.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
