from __future__ import annotations

PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Text for tokens as they arrive, without re-decoding the whole output each step.

    Decoding starts a few prompt tokens back, so tokenizers that drop a leading space on the first token
    of a string (SentencePiece) still produce it; a delta ending in U+FFFD waits for the rest of its
    UTF-8 character.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.tokens = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset, self.read_offset = 0, len(self.tokens)

    def push(self, token_id: int) -> str:
        self.tokens.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.tokens[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(self.tokens[self.prefix_offset:], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return full[len(prefix):]
