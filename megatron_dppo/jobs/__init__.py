"""The commands besides training: `plan` (per-GPU memory and layout), `evaluate` (a checkpoint on
the validation sets), `verify-unbiased` (the estimators against their full-batch gradients).
"""
