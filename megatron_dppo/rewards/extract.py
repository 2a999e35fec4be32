"""Reading a final answer out of model text: the last \\boxed{...}, GSM8K's "#### N".

Hand-written because math-verify reads every \\boxed{} of a text as a set of answers, and the
final one is what counts (a list of guesses must not be rewarded); the data loader uses the same
functions to read gold answers out of GSM8K and MATH solutions.
"""

from __future__ import annotations


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) in text, braces matched; None if none.

    Brace matching rather than a regex because answers nest braces: \\boxed{\\frac{1}{2}}.
    Also accepts the brace-less form "\\boxed 5" (up to the next space or $).
    """
    best = None
    for cmd in ("\\boxed", "\\fbox"):
        i = text.rfind(cmd)
        if i >= 0 and (best is None or i > best[0]):
            best = (i, cmd)
    if best is None:
        return None
    j = best[0] + len(best[1])
    if text.startswith(" ", j) and not text.startswith(" {", j):  # "\boxed 5"
        rest = text[j + 1 :]
        end = min([k for k in (rest.find("$"), rest.find(" "), rest.find("\n")) if k >= 0] or [len(rest)])
        return rest[:end].strip() or None
    while j < len(text) and text[j] == " ":
        j += 1
    if j >= len(text) or text[j] != "{":
        return None
    depth = 0
    for k in range(j, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                return text[j + 1 : k]
    return None  # unbalanced: the model stopped mid-answer


def gsm8k_final(text: str) -> str | None:
    """The text after the last "####" (first line of it), GSM8K's answer convention; None if none."""
    i = text.rfind("####")
    if i < 0:
        return None
    ans = text[i + 4 :].strip().split("\n", 1)[0].strip()
    return ans or None


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def answer_after_thinking(text: str) -> str | None:
    """The part of a completion that answers: the text after the last "</think>" (Qwen3-style
    thinking templates; also when the template put "<think>" into the prompt), the whole text
    when it has no thinking block, and None when a "<think>" was opened and never closed (the
    model ran out of tokens while thinking: there is no answer to read)."""
    close = text.rfind(THINK_CLOSE)
    if close >= 0:
        return text[close + len(THINK_CLOSE) :]
    return None if THINK_OPEN in text else text
