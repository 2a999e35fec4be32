"""Every enumerated option of the project, declared once as a Literal type.

The config dataclasses use these as field types (config/checks.py checks values against them), the
algorithm modules derive their tuples from them (losses.LOSS_AGGS = get_args(LossAgg)), and the
CLI takes its argparse choices from them. Pruning strategies are the exception: their registry
is algorithms/pruning.STRATEGIES (name -> class), which config validation reads.
Imports nothing, so config parsing stays fast.
"""

from typing import Literal

LossAgg = Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]
RatioType = Literal["token", "sequence"]  # token: GRPO/DAPO; sequence: GSPO
KlEstimator = Literal["k1", "k3"]
AdvantageKind = Literal["grpo", "drgrpo"]
Dtype = Literal["float32", "bfloat16"]
AttentionBackend = Literal["auto", "te", "local"]
PromptMode = Literal["raw", "chat"]
PackingKind = Literal["window", "ffd", "padded"]
ThdAttention = Literal["auto", "varlen", "bucketed", "loop"]  # the local path's packed-attention kernel
WandbMode = Literal["offline", "online", "disabled"]
DecayStyle = Literal["constant", "linear", "cosine"]
Recompute = Literal["none", "selective", "full"]
# The four other methods (docs/methods.md), each an option of the step:
Selection = Literal["all", "bppo"]  # which completions train: all (GRPO), BPPO's prefix pair
Reweighting = Literal["none", "reco"]  # ReCo: response weight by expected occurrence + token scale
Curriculum = Literal["none", "adaprefix"]  # AdaPrefix-GRPO: a reference-solution prefix held at 50% success
AuxLoss = Literal["none", "ssopd"]  # SSOPD: self-distillation from the shortest correct into the longest wrong
