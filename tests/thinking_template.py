"""A Qwen3-style thinking chat template on the tiny tokenizer (examples/tiny/model), for tests.

Like Qwen3's: the generation prompt opens the assistant turn and, with enable_thinking=false,
writes an empty thinking block; an assistant turn in the history is written with its thinking
block first, which in thinking mode the model opens itself. "<think>", "</think>", "<eot>" (end
of a turn) and "<asst>" (the assistant turn's opener) are added tokens (ids 21-24), inside the
tiny model's 50-token vocabulary. The tiny tokenizer has no newline token, so the opener here is
"<think>" alone (Qwen3's is "<think>\\n")."""

from transformers import AutoTokenizer

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}<asst><think></think>"
    "{{ m['content'] }}<eot>{% else %}{{ m['content'] }}<eot>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<asst>{% if enable_thinking is defined and enable_thinking is false %}"
    "<think></think>{% endif %}{% endif %}"
)


def thinking_tokenizer():
    tok = AutoTokenizer.from_pretrained("examples/tiny/model")
    tok.add_tokens(["<think>", "</think>", "<eot>", "<asst>"])
    tok.chat_template = TEMPLATE
    return tok
