"""Build the tiny main job's assets from nothing: data, tokenizer, a warmed-up tiny Qwen3.

    python tools/make_tiny_model.py                  # examples/tiny/data and examples/tiny/model
    python tools/make_tiny_model.py --task mulsteps  # examples/tiny/longtail/{*.jsonl,model}

1. {data-dir}/{train,test}.jsonl from megatron_dppo.data.tasks (seeded): 3-digit addition (add3,
   the main job), or worked multiplication with long-tailed completion lengths (mulsteps,
   examples/tiny/longtail.yaml; records also carry the worked `solution`).
2. A character-level tokenizer wrapped as a transformers fast tokenizer: 21 symbols, plus the
   task's extra characters (mulsteps: ':' and ','). It prepends <bos> to every encoded text (so
   vLLM, which tokenizes with special tokens, sees the same ids as training), and its chat
   template just concatenates message contents after <bos> (with enable_thinking=false it
   appends an empty thinking block "()": CHAT_TEMPLATE).
3. A random Qwen3ForCausalLM (hidden 128, 3 layers, 4 query / 2 KV heads, head_dim 32 which vLLM's
   CPU attention accepts, intermediate 512, tied embeddings: 0.74M parameters, fp32).
4. A supervised warm-up on "<bos>123+456=" -> "579<eos>" (the solution, for worked tasks; loss
   on it only; AdamW 1e-3, batch 128) that stops once greedy accuracy on a validation split
   (disjoint from train and test) reaches --threshold, because a random model earns no reward
   and GRPO would have nothing to learn from; a --max-seconds cap bounds it. The accuracy curve
   is steep (docs/platform.md section 2), so a threshold, not a time, fixes the starting point.
5. Saves config.json, model.safetensors, generation_config.json, tokenizer files, and
   warmup.json (accuracies, seconds, the curve; for worked tasks also the completion lengths of
   greedy and sampled test completions). Exit code 1 if the threshold was not reached.

Seeded: the same seed and thread count give the same data, weights and stopping point (checked
every --eval-every steps, every step once close), unless the time cap cuts in first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from megatron_dppo.data.tasks import get_task, make_splits, write_jsonl  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
SYMBOLS = list("0123456789") + list("+-*/=()")
# <bos> + the message contents (so chat mode gives the raw ids the model was trained on). With
# enable_thinking=false (data.chat_template_kwargs) the generation prompt ends with an empty
# thinking block, as Qwen3's template appends "<think>\n\n</think>\n\n": here "()", the only
# bracket pair the 21-symbol vocabulary has (its embedding has exactly 21 rows, so no token can
# be added without new weights). The model never saw "()" after a prompt: the point is that the
# switch reaches the template, and tests can show both renderings.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}(){% endif %}"
)

# Where each task's assets go and how long its sequences get (prompt + solution + <bos>/<eos>).
TASK_LAYOUT = {
    "add3": dict(model_dir="examples/tiny/model", data_dir="examples/tiny/data", n_train=20000, positions=64),
    "mulsteps": dict(
        model_dir="examples/tiny/longtail/model", data_dir="examples/tiny/longtail", n_train=8000, positions=160
    ),
}


def symbols_for(task) -> list[str]:
    """The 21 base symbols, then the task's characters they lack (so add3's ids never change)."""
    return SYMBOLS + sorted(set(task.alphabet) - set(SYMBOLS))


def build_tokenizer(symbols=SYMBOLS, max_length: int = 64):
    """Character tokenizer as a transformers fast tokenizer (AutoTokenizer/vLLM load it)."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIALS + list(symbols))}
    # BPE without merges over a character vocabulary is a character model: every character is a
    # token, an unknown one is <unk>. No pre-tokenizer: nothing splits on spaces.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    tok.decoder = decoders.Fuse()  # join characters without spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        model_max_length=max_length,
        chat_template=CHAT_TEMPLATE,
    )


def build_model(tokenizer, seed: int, positions: int = 64):
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    # Token ids only: vLLM takes sampling defaults (temperature, top_p...) from this file.
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
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
    """[bos] prompt target [eos], right-padded; labels only on target + eos (-100 elsewhere).
    The target is the worked solution when the record has one, else the answer."""
    seqs, labels = [], []
    for r in records:
        p, a = [codec.bos] + codec.ids(r["prompt"]), codec.ids(r.get("solution", r["answer"])) + [codec.eos]
        seqs.append(p + a)
        labels.append([-100] * len(p) + a)
    n = max(map(len, seqs))
    ids = torch.tensor([s + [codec.pad] * (n - len(s)) for s in seqs])
    lab = torch.tensor([lb + [-100] * (n - len(lb)) for lb in labels])
    return ids, lab


@torch.no_grad()
def greedy_completions(
    model,
    records,
    codec: CharCodec,
    max_new_tokens: int = 8,
    batch_size: int = 500,
    kv_cache: bool = False,
    sample_seed: int | None = None,
) -> list[list[int]]:
    """Completion ids (up to and without <eos>) of each record, greedy, or sampled at temperature
    1 when sample_seed is given. Prompts of one length are batched together, so no padding is
    needed. Without kv_cache the whole sequence is recomputed each step (at <= 20 tokens that is
    cheap, and it is how the committed add3 model was selected); long completions use the cache."""
    model.eval()
    by_len: dict[int, list[int]] = {}
    for k, r in enumerate(records):
        by_len.setdefault(len(r["prompt"]), []).append(k)
    gen = torch.Generator().manual_seed(sample_seed) if sample_seed is not None else None
    out: list[list[int]] = [[] for _ in records]
    for group in by_len.values():
        for s in range(0, len(group), batch_size):
            chunk = group[s : s + batch_size]
            ids = torch.tensor([[codec.bos] + codec.ids(records[k]["prompt"]) for k in chunk])
            start, past, step_in = ids.shape[1], None, ids
            for _ in range(max_new_tokens):
                if kv_cache:
                    res = model(input_ids=step_in, past_key_values=past, use_cache=True)
                    past = res.past_key_values
                else:
                    res = model(input_ids=ids)
                logits = res.logits[:, -1]
                if gen is None:
                    nxt = logits.argmax(-1, keepdim=True)
                else:
                    nxt = torch.multinomial(logits.softmax(-1), 1, generator=gen)
                ids = torch.cat([ids, nxt], 1)
                step_in = nxt
                if (ids[:, start:] == codec.eos).any(1).all():
                    break
            for k, row in zip(chunk, ids[:, start:].tolist()):
                out[k] = row[: row.index(codec.eos)] if codec.eos in row else row
    model.train()
    return out


def greedy_accuracy(
    model, records, codec: CharCodec, task, max_new_tokens: int = 8, batch_size: int = 500, kv_cache: bool = False
) -> float:
    """Accuracy of greedy answers under the task's verifier (exact match, or the final number)."""
    completions = greedy_completions(model, records, codec, max_new_tokens, batch_size, kv_cache)
    return sum(task.score(codec.text(c), r["answer"]) for c, r in zip(completions, records)) / len(records)


def length_stats(lengths) -> dict:
    """Completion tokens (with <eos>): mean, median, max, coefficient of variation, max/median."""
    t = torch.tensor(lengths, dtype=torch.float64)
    med = float(t.median())
    return {
        "mean": round(float(t.mean()), 2),
        "median": med,
        "max": int(t.max()),
        "cv": round(float(t.std(unbiased=False) / t.mean()), 3),
        "max_over_median": round(float(t.max()) / med, 2),
    }


def batch_loss(model, records, codec: CharCodec, chunks: int = 1):
    """Mean loss over the batch's target tokens. chunks > 1 sorts the batch by length and runs it
    in that many pieces, each padded only to its own longest (long-tailed solutions otherwise pad
    every row to the longest); the token-weighted sum of the pieces is the same mean."""
    if chunks == 1:
        ids, labels = training_batch(records, codec)
        return model(input_ids=ids, labels=labels).loss
    records = sorted(records, key=lambda r: len(r.get("solution", r["answer"])))
    size = -(-len(records) // chunks)
    pieces = [training_batch(records[i : i + size], codec) for i in range(0, len(records), size)]
    counts = [int((labels[:, 1:] != -100).sum()) for _, labels in pieces]  # HF shifts labels by one
    return sum(model(input_ids=ids, labels=labels).loss * n for (ids, labels), n in zip(pieces, counts)) / sum(counts)


def warm_up(
    model,
    train,
    val,
    codec,
    *,
    threshold,
    max_seconds,
    eval_every,
    batch_size,
    lr,
    seed,
    evaluate,
    chunks=1,
    close_every=1,
    log=print,
):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    curve, t0, step, acc, train_s = [], time.monotonic(), 0, 0.0, 0.0
    model.train()
    while True:
        t = time.monotonic()
        idx = torch.randint(len(train), (batch_size,), generator=gen).tolist()
        loss = batch_loss(model, [train[i] for i in idx], codec, chunks)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        train_s += time.monotonic() - t
        # Near the threshold accuracy rises ~10 points in 5 steps: evaluate every `close_every`
        # steps there (add3: every step).
        every = eval_every if acc < threshold / 4 else close_every
        if step % every == 0:
            acc = evaluate(model, val)
            elapsed = time.monotonic() - t0
            curve.append(
                {"step": step, "seconds": round(elapsed, 2), "loss": round(loss.item(), 4), "val_accuracy": acc}
            )
            log(f"step {step:5d}  {elapsed:6.1f}s  loss {loss.item():.4f}  val greedy acc {acc:.3f}")
            if acc >= threshold or elapsed >= max_seconds:
                return {
                    "steps": step,
                    "seconds": round(elapsed, 2),
                    "train_seconds": round(train_s, 2),
                    "val_accuracy": acc,
                    "reached_threshold": acc >= threshold,
                    "curve": curve,
                }


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
    ap.add_argument("--task", default="add3", choices=sorted(TASK_LAYOUT))
    ap.add_argument("--model-dir", help="default: the task's (TASK_LAYOUT)")
    ap.add_argument("--data-dir", help="default: the task's (TASK_LAYOUT)")
    ap.add_argument("--n-train", type=int, help="default: the task's (TASK_LAYOUT)")
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
    layout = TASK_LAYOUT[args.task]
    model_dir = args.model_dir or os.path.join(REPO, layout["model_dir"])
    data_dir = args.data_dir or os.path.join(REPO, layout["data_dir"])
    n_train = args.n_train or layout["n_train"]
    task = get_task(args.task)
    worked = hasattr(task, "solution")
    # add3 keeps the exact evaluation that selected the committed model; worked tasks need room
    # for their longest solution and the KV cache to decode it in reasonable time.
    max_new = task.max_solution_chars + 1 if worked else 8
    evaluate = partial(greedy_accuracy, task=task, max_new_tokens=max_new, kv_cache=worked)

    splits = make_splits(args.task, args.seed, train=n_train, test=args.n_test, val=args.n_val)
    for name in ("train", "test"):
        write_jsonl(splits[name], os.path.join(data_dir, f"{name}.jsonl"))
    tokenizer = build_tokenizer(symbols_for(task), layout["positions"])
    codec = CharCodec(tokenizer)
    model = build_model(tokenizer, args.seed, layout["positions"])
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tiny Qwen3: {n_params / 1e6:.3f}M parameters, vocab {len(tokenizer)}; task {args.task}")

    stats = warm_up(
        model,
        splits["train"],
        splits["val"],
        codec,
        threshold=args.threshold,
        max_seconds=args.max_seconds,
        eval_every=args.eval_every,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        evaluate=lambda m, recs: evaluate(m, recs, codec),
        chunks=4 if worked else 1,
        close_every=5 if worked else 1,
    )
    stats["test_accuracy"] = evaluate(model, splits["test"], codec)
    print(
        f"stopped after {stats['steps']} steps, {stats['seconds']}s: val {stats['val_accuracy']:.3f}, "
        f"test ({args.n_test} problems) {stats['test_accuracy']:.3f}"
    )
    if worked:  # what the long tail looks like at the starting point of RL (+1: the <eos>)
        for mode, seed in (("greedy", None), ("sampled_t1", args.seed)):
            comps = greedy_completions(model, splits["test"], codec, max_new, kv_cache=True, sample_seed=seed)
            stats[f"test_completion_tokens_{mode}"] = length_stats([len(c) + 1 for c in comps])
            print(f"test completion tokens ({mode}): {stats[f'test_completion_tokens_{mode}']}")

    os.makedirs(model_dir, exist_ok=True)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    _portable_tokenizer_class(model_dir)
    stats.update(
        task=args.task,
        seed=args.seed,
        threshold=args.threshold,
        batch_size=args.batch_size,
        lr=args.lr,
        threads=args.threads,
        parameters=n_params,
        torch=torch.__version__,
    )
    with open(os.path.join(model_dir, "warmup.json"), "w") as f:
        json.dump(stats, f, indent=1)
    if not stats["reached_threshold"]:
        print(f"WARNING: threshold {args.threshold} not reached within {args.max_seconds}s", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
