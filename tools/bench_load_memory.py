"""Peak RSS per rank of loading HF weights into the Megatron policy: sharded vs whole-checkpoint.

    python tools/bench_load_memory.py [--layouts 1x1,2x1,1x2,2x2,4x1,1x4] [--workdir /tmp/load_bench]

Writes a random Qwen3 (fp32, untied, hidden 512, 8 heads / 4 KV groups, head_dim 64,
intermediate 1536, vocab 32000, 16 layers: 332 MB) as safetensors shards + index under
--workdir (deleted at the end unless --keep), then for every TP x PP layout runs torchrun with
TP*PP processes once per (mode, path):
  path  new  hf_load.load_hf_into_policy / load_hf_into_models: each rank reads its slices
        old  every file read whole (safetensors.load_file, what trainer._load_hf_weights did),
             converted whole (qwen3.hf_to_megatron) and cut (shard_for_rank / load_hf_state_dict)
  mode  weights  a bare GPTModel (this rank's weights only, nothing else), then the load
        policy   the trainer's MegatronPolicy (model + DDP fp32 grad buffer + optimizer), then the load
Each rank measures its own RSS (/proc/self/status): after imports + parallel init ("base"),
after the build, and the peak (VmHWM, reset with /proc/self/clear_refs before the build and
again before the load) of the build and of the load. The table shows the largest value over
ranks. "model/(TP*PP)" is the checkpoint's bytes divided by TP*PP; "peak - model/(TP*PP)" is
the overhead the goal allows to be fixed (it must not grow with the model).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools"))
from megatron_dppo.run.process import free_port  # noqa: E402

MIB = 2**20
DIMS = dict(
    vocab_size=32000,
    hidden_size=512,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=1536,
    dtype="float32",
)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss_mib() -> float:
    return _status_kib("VmRSS") / 1024


def hwm_mib() -> float:
    return _status_kib("VmHWM") / 1024


def reset_peak() -> None:
    """VmHWM := the current RSS (Linux >= 4.0: writing 5 to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# ---- one rank of one measurement (under torchrun) ---------------------------------------------
def _whole_checkpoint(hf_dir: str) -> dict:
    from safetensors.torch import load_file

    sd = {}
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith(".safetensors"):
            sd.update(load_file(os.path.join(hf_dir, name)))
    return sd


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from megatron_dppo.config import AlgorithmConfig, OptimConfig
    from megatron_dppo.megatron import build_gpt_model, destroy_parallel, initialize_parallel
    from megatron_dppo.megatron.hf_load import load_hf_into_models, load_hf_into_policy, rank_layout
    from megatron_dppo.megatron.policy import MegatronPolicy
    from megatron_dppo.model import qwen3 as mapping
    from megatron_dppo.model.hf_dir import check_hf_model_dir

    torch.set_num_threads(1)
    initialize_parallel(args.tp, args.pp, seed=0)
    model_dir = check_hf_model_dir(args.hf_dir)
    cfg = model_dir.config
    base = rss_mib()
    reset_peak()
    t0 = time.perf_counter()
    if args.mode == "policy":
        policy = MegatronPolicy(cfg, OptimConfig(), AlgorithmConfig())
        module, layout = policy.model.module, policy.layout
    else:
        module = build_gpt_model(cfg, params_dtype=torch.float32, attention="local")
        layout = mapping.layout_from_hf_config(cfg, padded_vocab=module.vocab_size)
    build_s, build_peak, untrimmed = time.perf_counter() - t0, hwm_mib(), rss_mib()
    # Megatron's CPU initialisation (use_cpu_initialization) builds each full master weight and
    # keeps this rank's slice; glibc keeps the freed heap. Hand it back so that the load is
    # measured from what the model really holds (on a GPU that init happens on the device).
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    built = rss_mib()
    weights = sum(p.numel() * p.element_size() for p in module.parameters()) / MIB
    reset_peak()
    t0 = time.perf_counter()
    if args.path == "new":
        if args.mode == "policy":
            load_hf_into_policy(policy, model_dir)
        else:
            load_hf_into_models([module], layout, model_dir)
    elif args.mode == "policy":
        whole = _whole_checkpoint(args.hf_dir)
        policy.load_hf_state_dict(whole)
        del whole
    else:
        whole = _whole_checkpoint(args.hf_dir)
        local = mapping.shard_for_rank(mapping.hf_to_megatron(whole, layout), layout, *rank_layout())
        del whole
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(local[name])
        del local
    load_s, load_peak = time.perf_counter() - t0, hwm_mib()
    row = dict(
        rank=dist.get_rank(),
        base=base,
        built=built,
        untrimmed=untrimmed,
        build_peak=build_peak,
        weights=weights,
        load_peak=load_peak,
        after=rss_mib(),
        build_s=build_s,
        load_s=load_s,
    )
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        print("ROWS " + json.dumps(rows), flush=True)
    destroy_parallel()


# ---- the driver --------------------------------------------------------------------------------


def measure(hf_dir: str, tp: int, pp: int, mode: str, path: str) -> list:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={tp * pp}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        os.path.abspath(__file__),
        "--worker",
        "--hf-dir",
        hf_dir,
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        "--mode",
        mode,
        "--path",
        path,
    ]
    res = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
    )
    out = res.stdout + res.stderr
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("ROWS ")), None)
    if res.returncode or line is None:
        raise SystemExit(f"tp={tp} pp={pp} {mode} {path} failed (exit {res.returncode}):\n{out[-6000:]}")
    return json.loads(line[5:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="1x1,2x1,1x2,2x2,4x1,1x4", help="TPxPP,...")
    ap.add_argument("--modes", default="weights,policy")
    ap.add_argument("--paths", default="new,old")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--shard-size", default="50MB")
    ap.add_argument("--workdir", default="/tmp/load_bench")
    ap.add_argument("--keep", action="store_true", help="keep the generated model")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hf-dir", help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    import bench_convert_memory  # its random-model writer: tensor by tensor, sharded, with an index

    from megatron_dppo.model.hf_io import parse_size

    bench_convert_memory.PRESETS.setdefault("load-bench", DIMS)
    hf_dir = os.path.join(args.workdir, f"hf_L{args.layers}")
    shutil.rmtree(hf_dir, ignore_errors=True)
    info = bench_convert_memory.write_random_model(hf_dir, "load-bench", args.layers, parse_size(args.shard_size))
    model_mib = info["total"] / MIB
    layouts = [tuple(map(int, x.split("x"))) for x in args.layouts.split(",")]
    print(
        f"random Qwen3 {DIMS}, {args.layers} layers, untied: {model_mib:.0f} MiB in {info['files']} shards + index; "
        f"largest tensor {info['largest'] / MIB:.0f} MiB, one layer {info['layer'] / MIB:.1f} MiB",
        flush=True,
    )
    table = []
    try:
        for mode in args.modes.split(","):
            for tp, pp in layouts:
                for path in args.paths.split(","):
                    t0 = time.time()
                    rows = measure(hf_dir, tp, pp, mode, path)
                    table.append((mode, tp, pp, path, rows, time.time() - t0))
                    r = max(rows, key=lambda x: max(x["load_peak"], x["build_peak"]))
                    peak = max(r["load_peak"], r["build_peak"])
                    print(
                        f"  measured {mode} tp={tp} pp={pp} {path}: peak {peak:.0f} MiB ({time.time() - t0:.0f} s)",
                        flush=True,
                    )
    finally:
        if not args.keep:
            shutil.rmtree(hf_dir, ignore_errors=True)

    print(
        "\nper rank, max over ranks (MiB). base: RSS after imports (torch, megatron.core, transformers) and "
        "parallel init; build: RSS the model build added (after malloc_trim; its peak in brackets); weights: the "
        "rank's parameter bytes; load: peak during the load minus RSS before it; load peak: VmHWM during the load"
    )
    print(
        f"{'mode':8} {'TPxPP':5} {'path':4} | {'base':>5} {'build (peak)':>13} {'weights':>7} | {'load':>5} "
        f"{'load s':>6} {'load peak':>9} | {'model/(TP*PP)':>13} {'load peak - model/(TP*PP)':>25}"
    )
    for mode, tp, pp, path, rows, _ in table:
        base = max(r["base"] for r in rows)
        build = max(r["built"] - r["base"] for r in rows)
        build_peak = max(r["build_peak"] for r in rows)
        weights = max(r["weights"] for r in rows)
        load = max(r["load_peak"] - r["built"] for r in rows)
        load_s = max(r["load_s"] for r in rows)
        peak = max(r["load_peak"] for r in rows)
        share = model_mib / (tp * pp)
        print(
            f"{mode:8} {tp}x{pp:<3} {path:4} | {base:5.0f} {build:6.0f} ({build_peak:4.0f}) {weights:7.0f} | "
            f"{load:5.0f} {load_s:6.1f} {peak:9.0f} | {share:13.0f} {peak - share:25.0f}"
        )


if __name__ == "__main__":
    main()
