"""python tests/dist/workers/model/final_norm_worker.py

The local spec's final norm does not depend on what Megatron picked at import for a block's
final norm (transformer_block.LayerNormImpl): TENorm when TE imports, else Apex's
FusedLayerNorm when Apex imports, which asserts on RMSNorm (a container whose TE is broken but
whose Apex loads). Here that default is replaced by a norm that refuses RMSNorm as
FusedLayerNorm does; the model must still build, with the layers' own norm type at the end,
and give the same logits as the model built with Megatron's default left alone (same seed)."""

import common
import torch
from megatron.core.transformer import transformer_block

from megatron_dppo.megatron import build_gpt_model, destroy_parallel, initialize_parallel


class RefusesRMSNorm(torch.nn.Module):
    """Stands in for apex's FusedLayerNorm under Megatron: `assert normalization == 'LayerNorm'`."""

    def __init__(self, config, hidden_size, eps=1e-5, **kwargs):
        super().__init__()
        assert config.normalization == "LayerNorm", f"{config.normalization} is not supported by this norm"


def build(cfg):
    torch.manual_seed(7)
    initialize_parallel(tp=1, pp=1, seed=7)
    model = build_gpt_model(cfg)
    destroy_parallel(world=False)
    return model


def main():
    cfg = common.tiny_config(num_hidden_layers=2)
    ids = torch.randint(0, common.VOCAB, (2, 11), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(11).expand(2, 11)
    reference = build(cfg)
    transformer_block.LayerNormImpl = RefusesRMSNorm
    model = build(cfg)
    final, first = model.decoder.final_layernorm, model.decoder.layers[0].input_layernorm
    assert type(final) is type(first), (type(final), type(first))
    with torch.no_grad():
        err = (model(ids, pos, None) - reference(ids, pos, None)).abs().max().item()
    assert err == 0.0, err
    common.log(f"final norm {type(final).__name__} with Megatron's block default refusing RMSNorm: OK")


if __name__ == "__main__":
    main()
