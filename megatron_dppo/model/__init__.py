"""Model facts without Megatron: the architecture's numbers, vocabulary padding, the HF <->
Megatron tensor names, the HF model directory and its safetensors files.
"""
