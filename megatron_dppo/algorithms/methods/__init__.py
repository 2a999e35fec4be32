"""The methods a step composes (docs/methods.md): BPPO, ReCo, AdaPrefix-GRPO and SSOPD, one
package each, as pure rules (`<method>/rules.py`: tensors and lists in and out) and as the
object of its slot whose hooks the step calls (`<method>/method.py`; the slots and the plain
step's options in base.py, the names in registry.py). Nothing here imports the trainer,
Megatron or vLLM.

Shared by several methods: `_groups.py`, the selection of shortest/longest correct/incorrect
completions (BPPO and SSOPD), and `_vocab.py`, the vocab-parallel, position-chunked softmax
statistics (ReCo's Gini impurity and SSOPD's divergences). The methods' config sections live in
the torch-free `configs.py`, which megatron_dppo/config/ imports at module level without making
config parsing import torch (this package's and its packages' __init__ modules import nothing).

Every detail that docs/methods.md marks "(our choice)" or "[guess]" is marked so in the docstring
that implements it: none of the four papers' full texts could be read.
"""
