"""ReCo (docs/methods.md section 2): rules.py, the pure rules; method.py, the reweighting the step calls."""
