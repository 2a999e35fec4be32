"""Convert a Megatron-Core dist checkpoint (converted, or the trainer's own) into an HF model dir.

    python tools/convert_megatron_to_hf.py --megatron-dir CKPT --out-dir HF [--max-shard-size 2GB]
    python tools/convert_megatron_to_hf.py --megatron-dir LORA_CKPT --out-dir ADAPTER [--base-dir BASE]
    python tools/convert_megatron_to_hf.py --megatron-dir LORA_CKPT --out-dir HF --merge-lora [--base-dir BASE]

CKPT is a dir with model_optim/ and hf_config.json: a converted checkpoint, a trainer step_* dir
(model + optimizer; only the model keys are read), or a trainer root with a `latest` file. The
layout (layers, padded vocab, dtype) is read from the checkpoint's metadata, the architecture
from hf_config.json; vocab padding is cut. The checkpoint is checked first as the trainer checks
one it resumes (every file present and whole: a one-line error naming the file otherwise). A
Qwen3 MoE checkpoint saved at any expert-parallel size gives per-expert HF tensors.
OUT gets model-0000i-of-0000n.safetensors, a model.safetensors.index.json, config.json
(hf_config.json verbatim, dtype updated if --dtype changes it) and the tokenizer files from
CKPT/hf_assets/ (or --tokenizer-dir): transformers and vLLM load it. Streams one decoder layer
at a time; shards are written in place, never buffered.
A LoRA run's checkpoint (model.lora.rank > 0: the adapters only) becomes a PEFT adapter dir:
OUT gets adapter_config.json (base_model_name_or_path = the base model the run recorded, or
--base-dir) and adapter_model.safetensors, plus the tokenizer files only from CKPT/hf_assets/ or
--tokenizer-dir (the base has its own); PeftModel.from_pretrained(base, OUT) and vLLM's LoRA load it.
With --merge-lora, OUT is the base's HF dir (shards, index, config.json, the base's tokenizer files)
with W + (alpha / rank) * B @ A in every adapted weight. The base is checked against the weights
fingerprint the run recorded: another model's weights (a re-downloaded or fine-tuned base) are
refused, naming both paths. --base-dir names the base when the recorded path moved.
OUT must not exist (or be empty): everything is written to .OUT.partial-<host>-<pid> beside it
and renamed to OUT at the end, so a failed or killed run leaves no OUT (and its leftover is
removed by the next run to the same OUT).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from megatron_dppo.run.quiet import quiet_libraries  # noqa: E402  (before torch is imported)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatron-dir", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="weights dtype (auto: as stored in the checkpoint)",
    )
    ap.add_argument("--max-shard-size", default="2GB", help="safetensors shard size (e.g. 500MB, 5GB)")
    ap.add_argument("--tokenizer-dir", help="copy tokenizer files from here when CKPT has no hf_assets/")
    ap.add_argument(
        "--merge-lora",
        action="store_true",
        help="a LoRA checkpoint: write the base model with the adapters merged (default: a PEFT adapter dir)",
    )
    ap.add_argument(
        "--base-dir", help="a LoRA checkpoint's base HF model dir, when it moved from where the run recorded it"
    )
    args = ap.parse_args(argv)
    quiet_libraries()
    import torch

    from megatron_dppo.megatron.convert_ckpt import megatron_to_hf_checkpoint
    from megatron_dppo.model.hf_io import parse_size

    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    try:
        info = megatron_to_hf_checkpoint(
            args.megatron_dir,
            args.out_dir,
            dtype=dtype,
            max_shard_bytes=parse_size(args.max_shard_size),
            tokenizer_dir=args.tokenizer_dir,
            merge_lora=args.merge_lora,
            base_dir=args.base_dir,
        )
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as e:
        print(f"error: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2
    if info.get("kind") == "peft":
        return _report_peft(args.out_dir, info)
    merged = f" merged with {info['lora_modules']} LoRA modules onto {info['base']}" if info.get("kind") else ""
    print(
        f"wrote {args.out_dir} from {info['checkpoint']}{merged} in {info['seconds']:.1f} s: "
        f"{len(info['files'])} shard(s), "
        f"{info['weights_bytes'] / 2**20:.0f} MiB of weights, peak RSS {info['peak_rss_mib']:.0f} MiB "
        f"(RSS before streaming {info['rss_before_mib']:.0f} MiB); assets: {', '.join(info['assets']) or 'none'}",
        flush=True,
    )
    if not info["assets"]:
        print(
            "warning: no tokenizer files copied (no hf_assets/ in the checkpoint and no --tokenizer-dir): "
            "vLLM needs a tokenizer next to the weights",
            file=sys.stderr,
        )
    return 0


def _report_peft(out_dir: str, info: dict) -> int:
    print(
        f"wrote PEFT adapter dir {out_dir} from {info['checkpoint']} in {info['seconds']:.1f} s: "
        f"{info['lora_modules']} LoRA modules, {info['weights_bytes'] / 2**20:.1f} MiB, base {info['base']}; "
        f"assets: {', '.join(info['assets']) or 'none (the base has the tokenizer)'}",
        flush=True,
    )
    if info["warning"]:
        print(f"warning: {info['warning']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
