"""Build the tiny main job's assets from nothing: data, tokenizer, a warmed-up tiny Qwen3.

    python tools/make_tiny_model.py            # writes examples/tiny/data and examples/tiny/model

1. examples/tiny/data/{train,test}.jsonl: 3-digit addition from megatron_dppo.tasks (seeded).
2. A character-level tokenizer of 21 symbols wrapped as a transformers fast tokenizer. It
   prepends <bos> to every encoded text (so vLLM, which tokenizes with special tokens, sees the
   same ids as training), and its chat template just concatenates message contents after <bos>.
3. A random Qwen3ForCausalLM (hidden 128, 3 layers, 4 query / 2 KV heads, head_dim 32 which vLLM's
   CPU attention accepts, intermediate 512, tied embeddings: 0.74M parameters, fp32).
4. A supervised warm-up on "<bos>123+456=" -> "579<eos>" (loss on the answer only; AdamW 1e-3,
   batch 128) that stops once greedy accuracy on a validation split (disjoint from train and
   test) reaches --threshold, because a random model earns no reward and GRPO would have nothing
   to learn from; a --max-seconds cap bounds it. The accuracy curve is steep (DESIGN.md), so a
   threshold, not a time, fixes the starting point.
5. Saves config.json, model.safetensors, generation_config.json, tokenizer files, and
   warmup.json (accuracies, seconds, the curve). Exit code 1 if the threshold was not reached.

Seeded: the same seed and thread count give the same data, weights and stopping point (checked
every --eval-every steps, every step once close), unless the time cap cuts in first.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from megatron_dppo.tasks import exact_match, make_splits, write_jsonl  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
SYMBOLS = list("0123456789") + list("+-*/=()")
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"


def build_tokenizer():
    """21-symbol character tokenizer as a transformers fast tokenizer (AutoTokenizer/vLLM load it)."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIALS + SYMBOLS)}
    # BPE without merges over a character vocabulary is a character model: every character is a
    # token, an unknown one is <unk>. No pre-tokenizer: nothing splits on spaces.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    tok.decoder = decoders.Fuse()  # join characters without spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>", model_max_length=64,
                                   chat_template=CHAT_TEMPLATE)


def build_model(tokenizer, seed: int):
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, dtype="float32")
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    # Token ids only: vLLM takes sampling defaults (temperature, top_p...) from this file.
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    return model


class CharCodec:
    """Fast text <-> ids for training and evaluation, consistent with the tokenizer."""

    def __init__(self, tokenizer):
        self.vocab = tokenizer.get_vocab()
        self.inv = {i: s for s, i in self.vocab.items()}
        self.bos, self.eos, self.pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id

    def ids(self, text: str) -> list[int]:
        return [self.vocab[c] for c in text]

    def text(self, ids) -> str:
        out = []
        for i in ids:
            if i == self.eos:
                break
            out.append(self.inv[int(i)] if int(i) not in (self.bos, self.pad) else "")
        return "".join(out)


def training_batch(records, codec: CharCodec):
    """[bos] prompt answer [eos], right-padded; labels only on answer + eos (-100 elsewhere)."""
    seqs, labels = [], []
    for r in records:
        p, a = [codec.bos] + codec.ids(r["prompt"]), codec.ids(r["answer"]) + [codec.eos]
        seqs.append(p + a)
        labels.append([-100] * len(p) + a)
    n = max(map(len, seqs))
    ids = torch.tensor([s + [codec.pad] * (n - len(s)) for s in seqs])
    lab = torch.tensor([l + [-100] * (n - len(l)) for l in labels])
    return ids, lab


@torch.no_grad()
def greedy_accuracy(model, records, codec: CharCodec, max_new_tokens: int = 8, batch_size: int = 500):
    """Exact-match accuracy of greedy answers. Prompts of one length are batched together, so no
    padding is needed; the whole sequence is recomputed each step (at <= 20 tokens that is cheap)."""
    model.eval()
    by_len: dict[int, list[dict]] = {}
    for r in records:
        by_len.setdefault(len(r["prompt"]), []).append(r)
    correct = 0
    for group in by_len.values():
        for s in range(0, len(group), batch_size):
            chunk = group[s:s + batch_size]
            ids = torch.tensor([[codec.bos] + codec.ids(r["prompt"]) for r in chunk])
            start = ids.shape[1]
            for _ in range(max_new_tokens):
                nxt = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], 1)
                if (ids[:, start:] == codec.eos).any(1).all():
                    break
            correct += sum(exact_match(codec.text(row[start:].tolist()), r["answer"])
                           for row, r in zip(ids, chunk))
    model.train()
    return correct / len(records)


def warm_up(model, train, val, codec, *, threshold, max_seconds, eval_every, batch_size, lr, seed, log=print):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    curve, t0, step, acc, train_s = [], time.monotonic(), 0, 0.0, 0.0
    model.train()
    while True:
        t = time.monotonic()
        idx = torch.randint(len(train), (batch_size,), generator=gen).tolist()
        ids, labels = training_batch([train[i] for i in idx], codec)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        train_s += time.monotonic() - t
        # Near the threshold accuracy rises ~10 points in 5 steps: evaluate every step there.
        every = eval_every if acc < threshold / 4 else 1
        if step % every == 0:
            acc = greedy_accuracy(model, val, codec)
            elapsed = time.monotonic() - t0
            curve.append({"step": step, "seconds": round(elapsed, 2), "loss": round(loss.item(), 4),
                          "val_accuracy": acc})
            log(f"step {step:5d}  {elapsed:6.1f}s  loss {loss.item():.4f}  val greedy acc {acc:.3f}")
            if acc >= threshold or elapsed >= max_seconds:
                return {"steps": step, "seconds": round(elapsed, 2), "train_seconds": round(train_s, 2),
                        "val_accuracy": acc, "reached_threshold": acc >= threshold, "curve": curve}


def _portable_tokenizer_class(model_dir: str) -> None:
    """transformers 5 writes tokenizer_class "TokenizersBackend", which transformers 4 (e.g. on a GPU
    host with an older vLLM) cannot load; "PreTrainedTokenizerFast" loads in both."""
    path = os.path.join(model_dir, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=os.path.join(REPO, "examples/tiny/model"))
    ap.add_argument("--data-dir", default=os.path.join(REPO, "examples/tiny/data"))
    ap.add_argument("--task", default="add3")
    ap.add_argument("--n-train", type=int, default=20000)
    ap.add_argument("--n-test", type=int, default=500)
    ap.add_argument("--n-val", type=int, default=200, help="validation problems the stop rule reads")
    ap.add_argument("--threshold", type=float, default=0.30, help="stop at this greedy val accuracy")
    ap.add_argument("--max-seconds", type=float, default=300.0)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    splits = make_splits(args.task, args.seed, train=args.n_train, test=args.n_test, val=args.n_val)
    for name in ("train", "test"):
        write_jsonl(splits[name], os.path.join(args.data_dir, f"{name}.jsonl"))
    tokenizer = build_tokenizer()
    codec = CharCodec(tokenizer)
    model = build_model(tokenizer, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tiny Qwen3: {n_params / 1e6:.3f}M parameters, vocab {len(tokenizer)}; task {args.task}")

    stats = warm_up(model, splits["train"], splits["val"], codec, threshold=args.threshold,
                    max_seconds=args.max_seconds, eval_every=args.eval_every,
                    batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    stats["test_accuracy"] = greedy_accuracy(model, splits["test"], codec)
    print(f"stopped after {stats['steps']} steps, {stats['seconds']}s: val {stats['val_accuracy']:.3f}, "
          f"test ({args.n_test} problems) {stats['test_accuracy']:.3f}")

    os.makedirs(args.model_dir, exist_ok=True)
    model.save_pretrained(args.model_dir)
    tokenizer.save_pretrained(args.model_dir)
    _portable_tokenizer_class(args.model_dir)
    stats.update(task=args.task, seed=args.seed, threshold=args.threshold, batch_size=args.batch_size,
                 lr=args.lr, threads=args.threads, parameters=n_params, torch=torch.__version__)
    with open(os.path.join(args.model_dir, "warmup.json"), "w") as f:
        json.dump(stats, f, indent=1)
    if not stats["reached_threshold"]:
        print(f"WARNING: threshold {args.threshold} not reached within {args.max_seconds}s", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
