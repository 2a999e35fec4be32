"""The packed batch the loss tests share (tests/unit/test_logprobs.py, test_rollout_correction.py):
three sequences of a 50-token vocabulary with old, reference and rollout log-probs, the last token
of each without loss, packed to a multiple of 4."""

import torch

from megatron_dppo.algorithms import packing

VOCAB = 50


def three_sequence_batch() -> packing.ThdBatch:
    g = torch.Generator().manual_seed(5)
    samples = []
    for i, (n, p) in enumerate([(9, 4), (7, 3), (11, 6)]):
        c = n - p
        samples.append(
            packing.Sample(
                tokens=torch.randint(0, VOCAB, (n,), generator=g).tolist(),
                prompt_len=p,
                advantage=float(i) - 1.0,
                seq_id=i,
                old_logp=-torch.rand(c, generator=g),
                ref_logp=-torch.rand(c, generator=g),
                rollout_logp=-torch.rand(c, generator=g),
                loss_mask=[1.0] * (c - 1) + [0.0],
            )
        )
    return packing.build_thd_batch(samples, pad_multiple=4)
