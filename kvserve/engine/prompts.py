"""Prompts to token ids: text through the tokenizer, token ids as given, a chat through the model's template.

The engine holds one; so does the HTTP process, which tokenizes without the model (see kvserve.server.engine_core)."""
from __future__ import annotations

from kvserve.engine.detokenizer import SerialTokenizer
from kvserve.errors import KVServeError


def check_text(text: str, what: str) -> None:
    """Text the tokenizer can encode: a lone surrogate (from a JSON \\ud800-\\udfff escape, or the bytes of a command
    line that are not UTF-8) makes it fail with a TypeError that names neither the value nor where it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise KVServeError(f"{what} is not valid Unicode: character {e.start} is a lone surrogate, "
                           f"{text[e.start]!r} (a broken \\u escape, or bytes that are not UTF-8)") from None


class PromptEncoder:
    def __init__(self, tokenizer: SerialTokenizer | None, model: str):
        self.tokenizer, self.model = tokenizer, model

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt; chat-templated text passes add_special_tokens=False (the template has them)."""
        if not isinstance(prompt, str):
            if not isinstance(prompt, (list, tuple)):
                raise KVServeError(f"a prompt is text or a list of token ids, got {type(prompt).__name__}")
            return list(prompt)
        if self.tokenizer is None:
            raise KVServeError(f"{self.model} has no tokenizer; pass prompts as lists of token ids")
        if not isinstance(add_special_tokens, bool):  # the tokenizer's TypeError named neither
            raise KVServeError(f"add_special_tokens must be True or False, got {add_special_tokens!r}")
        check_text(prompt, "the prompt")
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """The conversation as prompt text, ending where the assistant's answer starts."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise KVServeError(f"{self.model} has no chat template")
        if not isinstance(messages, list) or not messages:
            raise KVServeError(f"messages must be a non-empty list of messages, got {messages!r:.80}")
        messages = [_message(i, message) for i, message in enumerate(messages)]
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # templates raise jinja errors for conversations they do not accept
            raise KVServeError(f"the chat template rejected these messages: {e}") from e


def _message(i: int, message) -> dict:
    """A message as templates take it, its content a string."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise KVServeError(f"message {i} must be a dict with a string role, got {message!r:.80}")
    text = _text(message.get("content"))
    if text is None:
        raise KVServeError(f"message {i}'s content must be a string or a list of text parts, got {message.get('content')!r:.80}")
    check_text(text, f"message {i}'s content")
    return {**message, "content": text}


def _text(content) -> str | None:
    """A string; None (an assistant's turn that only called tools) as empty; OpenAI's list of text parts joined.
    None where it is none of these."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                                         for part in content):
        return "".join(part["text"] for part in content)
    return None
