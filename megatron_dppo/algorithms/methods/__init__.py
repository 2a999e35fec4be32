"""The four GRPO-family methods of docs/methods.md as pure rules: BPPO, ReCo,
AdaPrefix-GRPO and SSOPD. Tensors and lists in, tensors and lists out; nothing here imports the
trainer or Megatron, so the step's planning (algorithms/batch.py) and the policy's loss call them.

Why a package and not four flat modules beside pruning.py: the methods share two pieces that
belong to none of them, the selection of shortest/longest correct/incorrect completions
(`_groups.py`: BPPO and SSOPD) and the vocab-parallel, position-chunked softmax statistics
(`_vocab.py`: ReCo's Gini impurity and SSOPD's divergences); and their config sections live in a
torch-free `configs.py` that megatron_dppo/config/ can import at module level without making
config parsing import torch.

Every detail that docs/methods.md marks "(our choice)" or "[guess]" is marked so in the docstring
that implements it: none of the four papers' full texts could be read.
"""
