"""Every enumerated option of the project, declared once as a Literal type.

The config dataclasses use these as field types (config/checks.py checks values against them), the
algorithm modules derive their tuples from them (losses.LOSS_AGGS = get_args(LossAgg)), and the
CLI takes its argparse choices from them. Pruning strategies and the methods' slots are the
exception: their registries are algorithms/pruning.STRATEGIES and algorithms/methods/registry.SLOTS
(name -> class), which config validation reads.
Imports nothing, so config parsing stays fast.
"""

from typing import Literal

LossAgg = Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]
RatioType = Literal["token", "sequence"]  # token: GRPO/DAPO; sequence: GSPO
KlEstimator = Literal["k1", "k3"]
# algorithm.rollout_correction (algorithms/losses.rollout_correction, docs/algorithm.md section 8):
# truncated importance sampling by token or sequence, rejection masks by token or sequence, and
# a truncation combined with a mask
RolloutCorrection = Literal["none", "tis", "seq_tis", "mask", "seq_mask", "tis_mask", "tis_seq_mask"]
AdvantageKind = Literal["grpo", "drgrpo"]
Dtype = Literal["float32", "bfloat16"]
AttentionBackend = Literal["auto", "te", "local"]
PromptMode = Literal["raw", "chat"]
PackingKind = Literal["window", "ffd", "padded"]
ThdAttention = Literal["auto", "varlen", "bucketed", "loop"]  # the local path's packed-attention kernel
WandbMode = Literal["offline", "online", "disabled"]
DecayStyle = Literal["constant", "linear", "cosine"]
Recompute = Literal["none", "selective", "full"]
