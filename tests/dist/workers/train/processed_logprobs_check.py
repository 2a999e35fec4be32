"""Worker: the log-probs the trainer's engine returns (logprobs_mode="processed_logprobs") are those
of the distribution actually sampled, temperature and top-p applied, which ReCo's response weight
needs (reco.check_processed_logprobs against the transformers model's logits); the engine's
default raw log-probs are told apart (so the check can fail)."""

import json
import os

import torch
from transformers import AutoModelForCausalLM

from megatron_dppo.algorithms.methods.reco import rules as reco
from megatron_dppo.rollout import RolloutEngine

HF_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "examples", "tiny", "model")
PROMPTS = [[1, 4, 5, 6, 13, 7, 8, 9, 15], [1, 12, 3, 4, 13, 5, 5, 5, 15]]
T, TOP_P = 0.7, 0.9


def verdict(mode: str, model) -> str:
    engine = RolloutEngine(
        HF_DIR, dtype="float32", max_model_len=32, kv_cache_memory_bytes=32 << 20, logprobs_mode=mode
    )
    outs = engine.generate(PROMPTS, n=4, max_new_tokens=6, temperature=T, top_p=TOP_P, seed=3)
    engine.close()
    returned, rows, tokens = [], [], []
    with torch.no_grad():
        for prompt, group in zip(PROMPTS, outs):
            for c in group:
                ids = torch.tensor([prompt + c.token_ids])
                rows.append(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float())
                tokens += c.token_ids
                returned += c.logprobs
    try:
        reco.check_processed_logprobs(
            torch.tensor(returned), torch.cat(rows), torch.tensor(tokens), temperature=T, top_p=TOP_P
        )
        return "processed"
    except ValueError as e:
        return str(e)


def main():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = AutoModelForCausalLM.from_pretrained(HF_DIR, dtype=torch.float32)
    print("RESULT " + json.dumps({m: verdict(m, model) for m in ("processed_logprobs", "raw_logprobs")}))


if __name__ == "__main__":
    main()
