"""The step's rules as pure functions (tensors and lists in and out, no Megatron, no vLLM):
advantages, pruning strategies, completion selection and weights, losses and their full-batch
denominators, packing, the step's records; methods/ holds one module per method.
"""
