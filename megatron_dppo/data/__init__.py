"""Prompts: the bundled synthetic tasks, the dataset files (JSONL, Parquet, datasets dirs; native,
GSM8K, MATH and verl layouts) and their rendering into token ids.
"""
