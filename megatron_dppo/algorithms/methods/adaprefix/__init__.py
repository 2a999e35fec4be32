"""AdaPrefix-GRPO (docs/methods.md section 3): rules.py, the pure rules on token ids;
curriculum.py, the run's per-problem state with the tokenizer; method.py, the curriculum the step calls."""
