"""BPPO (docs/methods.md section 1): rules.py, the pure rules; method.py, the selection the step calls."""
