"""SSOPD (docs/methods.md section 4): rules.py, the pure rules; distill.py, the teacher/student
pairs packed for the policy; method.py, the auxiliary loss the step calls."""
