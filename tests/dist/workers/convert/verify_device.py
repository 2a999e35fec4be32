"""Worker: verify_logits moves its inputs to the model's device and the logits back (no GPU needed).

    python verify_device.py --ckpt CONVERTED --hf-dir HF

The policy's model is wrapped as if it lived on a GPU: the device query (model.module_device)
answers cuda:0, tests/dist/workers/convert/fake_cuda.py tags tensors placed there, and the wrapper
asserts that input_ids and position_ids arrive on the GPU and returns its logits there. Under
FakeCuda, using GPU logits against the CPU reference raises as CUDA would, so verify_logits
passes only if megatron_logits brings them back to the CPU.
"""

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", ".."))
from fake_cuda import FakeCuda, on_fake_cuda  # noqa: E402

from megatron_dppo.megatron import convert_ckpt, destroy_parallel, initialize_parallel  # noqa: E402
from megatron_dppo.megatron import policy as policy_module  # noqa: E402

CUDA0 = torch.device("cuda", 0)  # made before the CPU shim's device-rewriting mode is on


class GpuModel:
    """Stands for the policy's model on cuda:0: asserts where its inputs are, returns its logits there."""

    def __init__(self, inner, fake: FakeCuda):
        self.inner, self.fake, self.calls = inner, fake, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, input_ids, position_ids, **kwargs):
        for name, t in (("input_ids", input_ids), ("position_ids", position_ids)):
            assert on_fake_cuda(t), f"{name} reached the GPU model from the CPU"
        self.calls += 1
        with self.fake.outside():
            out = self.inner(input_ids=input_ids.clone(), position_ids=position_ids.clone(), **kwargs)
        return out.to("cuda")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--hf-dir", required=True)
    args = ap.parse_args()
    initialize_parallel(1, 1, seed=0)
    fake = FakeCuda()
    models = []

    class PolicyOnGpu(policy_module.MegatronPolicy):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.model = GpuModel(self.model, fake)
            models.append(self.model)

    policy_module.MegatronPolicy = PolicyOnGpu
    convert_ckpt.module_device = lambda module: CUDA0
    with fake:
        diff = convert_ckpt.verify_logits(args.ckpt, args.hf_dir)
    assert len(models) == 1 and models[0].calls == 1, [m.calls for m in models]
    assert diff < 1e-5, diff
    print(f"VERIFY DEVICE OK: max |logit difference| {diff:.2e} with the model on (fake) cuda:0", flush=True)
    destroy_parallel()


if __name__ == "__main__":
    main()
