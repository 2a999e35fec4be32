"""Peak memory of the checkpoint converters on random Qwen3 models (not a test: a report).

    python tools/bench_convert_memory.py [--preset medium] [--layers 4,16] [--workdir /tmp/convert_bench]
    python tools/bench_convert_memory.py --preset qwen3-32b --layers 2 --shard-size 2GB

Presets: "medium" is fp32, hidden 1024, 16 heads / 8 KV groups, head_dim 64, intermediate 3072,
vocab 32000, untied; "qwen3-32b" has Qwen3-32B's tensor shapes and dtype (bf16, hidden 5120,
64 heads / 8 KV groups, head_dim 128, intermediate 25600, vocab 151936, untied) with fewer layers.
For each layer count: writes the random model as safetensors shards of --shard-size (tensor by
tensor), converts it HF -> Megatron (--tp 2) and back (same shard size), checks the round trip
bit for bit (tensor by tensor), and prints each converter's peak RSS (VmHWM, its own report)
next to the model size, the largest tensor and one layer's size. Streaming shows as a peak that
does not grow with the number of layers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

import torch
from safetensors import safe_open

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from megatron_dppo.model.hf_io import INDEX, SafetensorsShardWriter, parse_size  # noqa: E402

PRESETS = {
    "medium": dict(
        vocab_size=32000,
        hidden_size=1024,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=3072,
        dtype="float32",
    ),
    "qwen3-32b": dict(
        vocab_size=151936,
        hidden_size=5120,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=25600,
        dtype="bfloat16",
    ),
}


def write_random_model(path: str, preset: str, layers: int, shard_bytes: int) -> dict:
    """A random Qwen3 written tensor by tensor (never whole in memory)."""
    from transformers import Qwen3Config

    dims = PRESETS[preset]
    cfg = Qwen3Config(
        num_hidden_layers=layers,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        architectures=["Qwen3ForCausalLM"],
        **dims,
    )
    os.makedirs(path, exist_ok=True)
    cfg.save_pretrained(path)
    dtype = getattr(torch, dims["dtype"])
    h, i, d, v = dims["hidden_size"], dims["intermediate_size"], dims["head_dim"], dims["vocab_size"]
    q, kv = dims["num_attention_heads"] * d, dims["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h)}
    for layer in range(layers):
        p = f"model.layers.{layer}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.q_norm.weight": (d,),
                p + "self_attn.k_norm.weight": (d,),
                p + "self_attn.o_proj.weight": (h, q),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
        )
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
    writer = SafetensorsShardWriter(path, [(n, s, dtype) for n, s in shapes.items()], shard_bytes)
    gen = torch.Generator().manual_seed(0)
    for n, s in shapes.items():
        writer.write(n, (torch.randn(s, generator=gen) * 0.02 + (1.0 if "norm" in n else 0.0)).to(dtype))
    writer.close()
    nbytes = {n: torch.Size(s).numel() * dtype.itemsize for n, s in shapes.items()}
    return {
        "total": writer.total,
        "files": len(writer.files),
        "largest": max(nbytes.values()),
        "layer": sum(v for n, v in nbytes.items() if n.startswith("model.layers.0.")),
    }


def run(cmd) -> tuple[str, float, float]:
    t0 = time.time()
    res = subprocess.run(
        [sys.executable, *cmd], cwd=REPO, capture_output=True, text=True, env=dict(os.environ, PYTHONWARNINGS="ignore")
    )
    out = res.stdout + res.stderr
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out[-4000:]}")
    peak = float(re.search(r"peak RSS (\d+) MiB", out).group(1))
    before = float(re.search(r"RSS before streaming (\d+) MiB", out).group(1))
    return out, peak, before, time.time() - t0


def same_weights(a: str, b: str) -> bool:
    wa = json.load(open(os.path.join(a, INDEX)))["weight_map"]
    wb = json.load(open(os.path.join(b, INDEX)))["weight_map"]
    if wa.keys() != wb.keys():
        return False
    for n in wa:
        with safe_open(os.path.join(a, wa[n]), "pt") as fa, safe_open(os.path.join(b, wb[n]), "pt") as fb:
            if not torch.equal(fa.get_tensor(n), fb.get_tensor(n)):
                return False
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=PRESETS, default="medium")
    ap.add_argument("--layers", default="4,16")
    ap.add_argument("--shard-size", default="200MB")
    ap.add_argument("--workdir", default="/tmp/convert_bench")
    args = ap.parse_args()
    mib = 2**20
    rows = []
    for layers in map(int, args.layers.split(",")):
        root = os.path.join(args.workdir, f"L{layers}")
        shutil.rmtree(root, ignore_errors=True)
        hf, mg, back = (os.path.join(root, d) for d in ("hf", "mg", "back"))
        info = write_random_model(hf, args.preset, layers, parse_size(args.shard_size))
        _, p1, b1, t1 = run(["tools/convert_hf_to_megatron.py", "--hf-dir", hf, "--out-dir", mg, "--tp", "2"])
        _, p2, b2, t2 = run(
            [
                "tools/convert_megatron_to_hf.py",
                "--megatron-dir",
                mg,
                "--out-dir",
                back,
                "--max-shard-size",
                args.shard_size,
            ]
        )
        ok = same_weights(hf, back)
        rows.append((layers, info, p1, b1, t1, p2, b2, t2, ok))
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"random Qwen3, preset {args.preset} ({PRESETS[args.preset]}), untied, shards of {args.shard_size}; "
        "peak RSS per converter process"
    )
    print(
        "layers | model MiB (files) | largest tensor | one layer | HF->MG peak (before streaming) time "
        "| MG->HF peak (before streaming) time | round trip"
    )
    for layers, info, p1, b1, t1, p2, b2, t2, ok in rows:
        print(
            f"{layers:6d} | {info['total'] / mib:9.0f} ({info['files']:2d})    | {info['largest'] / mib:10.0f} MiB |"
            f" {info['layer'] / mib:5.0f} MiB | {p1:6.0f} MiB ({b1:4.0f}) {t1:5.1f} s | {p2:6.0f} MiB ({b2:4.0f}) "
            f"{t2:5.1f} s | {'bitwise' if ok else 'DIFFERS'}"
        )
    if not all(r[-1] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
