"""Pass@k curves (k = 1..64) of trained runs against the model they started from: ReCo's claim.

    python tools/passk_curve.py --config examples/tiny/addition.yaml --runs runs/compare/grpo-s0 \
        runs/compare/reco-s0 [--n 64] [--eval-size 200] [--out docs/passk.json]

For the start model (the config's model.hf_dir) and each run's last checkpoint it runs
`megatron-dppo evaluate` on the config's validation set with n samples per prompt at temperature 1
(the rollouts' distribution) and pass@k for k = 1, 2, 4, ..., n: the unbiased estimator of Chen et
al. (2021), computed by megatron_dppo/rollout/validation.py from the same answers that land in the dump.
Prints one row per model and writes the numbers as JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def ks(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def evaluate(config: str, checkpoint: str | None, n: int, eval_size: int, work: Path, name: str) -> dict:
    """megatron-dppo evaluate's metrics for one model ({val/<set>/all/pass@k: ...})."""
    out = work / name
    cmd = [sys.executable, "-m", "megatron_dppo.cli", "evaluate", "--config", config, "--out-dir", str(out)]
    cmd += ["--checkpoint", checkpoint] if checkpoint else []
    cmd += [
        f"eval.n={n}",
        "eval.temperature=1.0",
        f"eval.pass_k=[{','.join(map(str, ks(n)))}]",
        f"trainer.eval_size={eval_size}",
        "logging.wandb=disabled",
    ]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"{name}: evaluate failed: {res.stderr.strip().splitlines()[-1:]}")
    (metrics_file,) = out.glob("step_*.metrics.json")
    return json.loads(metrics_file.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--runs", nargs="+", required=True, help="run dirs (their checkpoints/ is evaluated)")
    ap.add_argument("--n", type=int, default=64, help="samples per prompt (the largest k)")
    ap.add_argument("--eval-size", type=int, default=200)
    ap.add_argument("--out", help="write the curves as JSON here")
    args = ap.parse_args()
    models = {"start model": None} | {Path(r).name: str(Path(r) / "checkpoints") for r in args.runs}
    curves = {}
    with tempfile.TemporaryDirectory(prefix="passk-") as tmp:
        for name, ckpt in models.items():
            m = evaluate(args.config, ckpt, args.n, args.eval_size, Path(tmp), name.replace(" ", "-"))
            curves[name] = {k: m[key] for k in ks(args.n) for key in m if key.endswith(f"/all/pass@{k}")}
    print(f"pass@k (validation set, n = {args.n} samples per prompt, temperature 1)")
    print("| model | " + " | ".join(f"k={k}" for k in ks(args.n)) + " |")
    print("|---|" + "---:|" * len(ks(args.n)))
    for name, c in curves.items():
        print(f"| {name} | " + " | ".join(f"{c[k]:.3f}" for k in ks(args.n)) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps({"n": args.n, "eval_size": args.eval_size, "curves": curves}, indent=1))


if __name__ == "__main__":
    main()
