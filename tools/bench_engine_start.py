"""The vLLM engine's start-up per rank: reading the HF checkpoint itself vs dummy weights + the sync.

    python tools/bench_engine_start.py [--config examples/qwen3_configs/0.6B/config.json] [--workdir DIR]

Issue 22 item 7: the trainer used to start every engine with load_format="auto", so each rank read
the whole HF checkpoint although its policy already held the weights and synced them right after
(about 32 x 65 GB of reads for the 32B example). It now starts vLLM with dummy weights and syncs.
This tool writes a random-weight model of the given architecture (bf16, index-sharded safetensors,
the tiny tokenizer beside it) once under --workdir, then in a fresh process per mode measures:
  auto   LLM(load_format="auto"): vLLM reads the checkpoint (the old start-up)
  dummy  LLM(load_format="dummy") + load_weights(the same tensors in 1 GB buckets): the new one,
         the buckets read here from the files as the policy's sync would stream them
the seconds to a ready engine (and of the sync), the process's peak RSS above the weights it already
holds (the trainer's policy holds them before its engine starts), and the checkpoint bytes vLLM itself
read (auto: all of them; dummy: none: the policy's sharded loader has read them once anyway).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def make_model(config_path: Path, out: Path) -> int:
    """A random-weight HF model dir of that architecture (bf16 shards); returns its weight bytes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (out / "model.safetensors.index.json").exists():
        return json.loads((out / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    cfg = AutoConfig.from_pretrained(config_path.parent)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="300MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "examples" / "tiny" / "model" / name, out / name)
    return json.loads((out / "model.safetensors.index.json").read_text())["metadata"]["total_size"]


def worker(model_dir: str, mode: str) -> None:
    """Both modes first hold the weights in memory, as the trainer's policy does before its engine
    starts; the peak is then measured from there, so it is the engine's own cost."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path.insert(0, str(REPO))
    import torch.distributed as dist
    from bench_load_memory import hwm_mib, reset_peak, rss_mib  # tools/: this script's own folder

    from megatron_dppo.model.hf_io import HFCheckpoint
    from megatron_dppo.rollout import RolloutEngine

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ckpt = HFCheckpoint(model_dir)
    policy = {name: ckpt.get(name) for name in sorted(ckpt.weight_map)}  # the policy's weights, resident
    base = rss_mib()
    reset_peak()
    t0 = time.perf_counter()
    engine = RolloutEngine(
        model_dir, dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=64 << 20, load_format=mode
    )
    init_s = time.perf_counter() - t0
    sync_s = 0.0
    if mode == "dummy":  # the sync: the resident tensors, in buckets of about 1 GiB as hf_weight_buckets
        t1 = time.perf_counter()
        bucket, size = [], 0
        for name, t in policy.items():
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size >= 1 << 30:
                engine.load_weights([bucket])
                bucket, size = [], 0
        if bucket:
            engine.load_weights([bucket])
        sync_s = time.perf_counter() - t1
    engine.generate([[1, 4, 5]], n=1, max_new_tokens=2, temperature=0.0)  # the engine works
    row = {"mode": mode, "init_s": init_s, "sync_s": sync_s, "peak_over_policy_mib": hwm_mib() - base}
    print(json.dumps(row), flush=True)
    engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "examples" / "qwen3_configs" / "0.6B" / "config.json"))
    ap.add_argument("--workdir", default="/tmp/bench_engine_start")
    ap.add_argument("--worker", nargs=2, metavar=("MODEL_DIR", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker)
    model_dir = Path(args.workdir) / Path(args.config).parent.name
    weights = make_model(Path(args.config), model_dir)
    print(f"{model_dir}: {weights / 2**30:.2f} GiB of bf16 weights")
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="2")
    for mode in ("auto", "dummy"):
        res = subprocess.run(
            [sys.executable, __file__, "--worker", str(model_dir), mode], env=env, capture_output=True, text=True
        )
        rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
        if res.returncode or not rows:
            print(f"{mode}: failed ({res.returncode}): {res.stderr[-800:]}")
            continue
        r = rows[-1]
        read = weights if mode == "auto" else 0
        print(
            f"{mode:5s}  engine {r['init_s']:5.1f} s + sync {r['sync_s']:5.1f} s = {r['init_s'] + r['sync_s']:5.1f} s"
            f"  peak RSS above the resident policy {r['peak_over_policy_mib'] / 1024:5.2f} GiB"
            f"  checkpoint bytes read by vLLM {read / 2**30:.2f} GiB"
        )


if __name__ == "__main__":
    main()
