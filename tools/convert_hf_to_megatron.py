"""Convert an HF Qwen3 checkpoint (safetensors) into a Megatron-Core dist checkpoint the trainer loads.

    python tools/convert_hf_to_megatron.py --hf-dir HF --out-dir OUT --tp 2 --pp 1 [--ep 2] [--verify]

OUT holds model_optim/ (torch_dist), trainer_state.json ({"step": 0, "model_only": true, ...}),
hf_config.json and hf_assets/ (tokenizer files): load it with
load_checkpoint(OUT, policy, load_optimizer=False) at any TP/PP. --tp fixes Megatron's vocab
padding (a multiple of 128 * tp; other layouts load it too, Megatron cuts or zero-pads the rows)
and the chunking of the files (what a TP=tp run saves); --tp/--pp are checked against the heads
and layers, --ep (expert parallel, Qwen3 MoE) against the experts (each expert is a chunk of its
own, so the files do not depend on --ep). Streams one tensor at a time: peak memory is about the
largest tensor, not the model.
OUT must not exist (or be empty): everything is written to .OUT.partial-<host>-<pid> beside it
and renamed to OUT at the end, so a failed or killed run leaves no OUT (and its leftover is
removed by the next run to the same OUT).

--verify then loads OUT at tp x pp x ep under torchrun (pp * lcm(tp, ep) processes: dense
and expert layouts both fill that world), runs a prompt through it and
through transformers (fp32 both) and prints the max |logit difference|; the exit status is 1 if
it is above --tolerance. --verify-only skips the conversion and verifies an existing --out-dir
(it launches torchrun itself when that world is more than one process).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from megatron_dppo.run.process import free_port  # noqa: E402
from megatron_dppo.run.quiet import quiet_libraries  # noqa: E402  (before torch is imported)

DTYPES = {"auto": None, "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-dir", required=True, help="HF model dir: config.json + safetensors (+ index)")
    ap.add_argument("--out-dir", required=True, help="checkpoint dir to create")
    ap.add_argument("--tp", type=int, default=1, help="target tensor parallel size (vocab padding, chunking)")
    ap.add_argument("--pp", type=int, default=1, help="target pipeline parallel size (checked; --verify layout)")
    ap.add_argument("--ep", type=int, default=1, help="expert parallel size of an MoE model (checked; --verify layout)")
    ap.add_argument("--dtype", choices=DTYPES, default="auto", help="weights dtype (auto: as in the HF files)")
    ap.add_argument("--verify", action="store_true", help="compare logits with transformers after converting")
    ap.add_argument("--verify-only", action="store_true", help="only verify an existing --out-dir")
    ap.add_argument(
        "--tolerance",
        type=float,
        default=1e-2,
        help="max |logit difference| accepted (both run in fp32; a wrong layout gives ~0.1-1)",
    )
    ap.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog.")
    return ap.parse_args(argv)


def verify_world(args) -> int:
    """Processes that hold the layout: a multiple of tp*pp (dense) and of ep*pp (experts)."""
    return args.pp * math.lcm(args.tp, args.ep)


def launch_verify(args) -> int:
    """Run this script with --verify-only in verify_world() processes (torchrun when more than one)."""
    n = verify_world(args)
    script = [
        os.path.abspath(__file__),
        "--hf-dir",
        args.hf_dir,
        "--out-dir",
        args.out_dir,
        "--tp",
        str(args.tp),
        "--pp",
        str(args.pp),
        "--ep",
        str(args.ep),
        "--tolerance",
        str(args.tolerance),
        "--prompt",
        args.prompt,
        "--verify-only",
    ]
    cmd = (
        [sys.executable] + script
        if n == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={n}",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
        ]
        + script
    )
    # torchrun would set 1 and print a banner saying so; setting it here keeps the screen quiet.
    return subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))


def verify(args) -> int:
    import torch.distributed as dist
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' "Loading weights" bar on every rank
    from megatron_dppo.megatron import destroy_parallel, initialize_parallel
    from megatron_dppo.megatron.convert_ckpt import verify_logits

    initialize_parallel(args.tp, args.pp, ep=args.ep)
    rank0 = dist.get_rank() == 0
    diff = verify_logits(args.out_dir, args.hf_dir, args.prompt)
    destroy_parallel()
    ok = diff <= args.tolerance
    if rank0:
        print(
            f"verify {'OK' if ok else 'FAILED'}: max |logit difference| {diff:.3e} "
            f"{'<=' if ok else '>'} tolerance {args.tolerance:g}",
            flush=True,
        )
    return 0 if ok else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    quiet_libraries()
    import torch

    from megatron_dppo.megatron.convert_ckpt import check_layout_flags, check_model_layout, hf_to_megatron_checkpoint
    from megatron_dppo.model.arch import Arch
    from megatron_dppo.model.qwen3 import read_model_config

    try:
        check_layout_flags(args.tp, args.pp, args.ep)
        if args.verify_only:  # the conversion checks the layout itself; a verify at another layout here
            config_path = os.path.join(args.hf_dir, "config.json")
            check_model_layout(
                config_path, Arch.from_hf_config(read_model_config(config_path)[0]), args.tp, args.pp, args.ep
            )
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.verify_only:  # under torchrun already, or a single process: verify here
        return verify(args) if "RANK" in os.environ or verify_world(args) == 1 else launch_verify(args)
    dtype = getattr(torch, DTYPES[args.dtype]) if DTYPES[args.dtype] else None
    try:
        info = hf_to_megatron_checkpoint(args.hf_dir, args.out_dir, args.tp, args.pp, dtype=dtype, ep=args.ep)
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as e:
        print(f"error: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.out_dir} in {info['seconds']:.1f} s: {info['weights_bytes'] / 2**20:.0f} MiB of HF weights, "
        f"peak RSS {info['peak_rss_mib']:.0f} MiB (RSS before streaming {info['rss_before_mib']:.0f} MiB); "
        f"assets: {', '.join(info['assets']) or 'none'}",
        flush=True,
    )
    return launch_verify(args) if args.verify else 0


if __name__ == "__main__":
    sys.exit(main())
