from __future__ import annotations

import threading

PROMPT_CONTEXT_TOKENS = 6


class SerialTokenizer:
    """A tokenizer entered by one thread at a time: transformers' fast tokenizers reset shared truncation and padding
    state on every encode call, and a caller's threads may share an engine; a lock held for one call at a time costs
    a microsecond."""

    def __init__(self, tokenizer):
        self._tokenizer, self._lock = tokenizer, threading.RLock()
        backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's own (tokenizers')
        self._backend = None if getattr(tokenizer, "clean_up_tokenization_spaces", False) else backend

    def decode_text(self, ids: list[int]) -> str:
        """decode(ids, skip_special_tokens=True): the tokenizers backend's own where transformers would return its text
        as it is (no clean-up of spaces), a third of the time a call (a token streamed costs two)."""
        with self._lock:
            if self._backend is not None:
                return self._backend.decode(ids, skip_special_tokens=True)
            return self._tokenizer.decode(ids, skip_special_tokens=True)

    def __getattr__(self, name: str):
        value = getattr(self._tokenizer, name)
        if not callable(value):
            return value

        def serial(*args, **kwargs):
            with self._lock:
                return value(*args, **kwargs)
        return serial


def serial(tokenizer) -> SerialTokenizer | None:
    """A checkpoint's tokenizer behind its lock; None where it has none."""
    return SerialTokenizer(tokenizer) if tokenizer is not None else None


class IncrementalDetokenizer:
    """Text for tokens as they arrive, without re-decoding the whole output each step.

    Decoding starts a few prompt tokens back, so tokenizers that drop a leading space on the first token
    of a string (SentencePiece) still produce it; a delta ending in U+FFFD waits for the rest of its
    UTF-8 character.
    """

    def __init__(self, tokenizer: SerialTokenizer, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.tokens = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset, self.read_offset = 0, len(self.tokens)

    def push(self, token_id: int) -> str:
        self.tokens.append(token_id)
        decode = self.tokenizer.decode_text
        prefix = decode(self.tokens[self.prefix_offset:self.read_offset])
        full = decode(self.tokens[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return full[len(prefix):]


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE writes byte b as one printable character; this maps it back."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_LEVEL = _byte_level_alphabet()


def token_bytes(tokenizer, token_id: int) -> bytes:
    """A token's own bytes, which may be part of a UTF-8 character: byte-level BPE pieces mapped back,
    SentencePiece's ▁ as a space and its <0xNN> byte tokens as that byte."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if piece is None:
        return b""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    if _byte_level(tokenizer) and all(c in BYTE_LEVEL for c in piece):
        return bytes(BYTE_LEVEL[c] for c in piece)
    return piece.replace("\u2581", " ").encode()


def _byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and "ByteLevel" in repr(backend.decoder)


def token_text(tokenizer, token_id: int) -> str:
    """A token as text for logprobs: its characters, or "bytes:\\xNN..." where it is not whole UTF-8 (OpenAI's way)."""
    raw = token_bytes(tokenizer, token_id)
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
