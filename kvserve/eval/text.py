"""The text perplexity is measured on: a user's file, or Python's own documentation, which ships with Python."""
from __future__ import annotations

from pathlib import Path

from kvserve.errors import KVServeError


def load_text(path: str | None) -> str:
    if path is None:
        import pydoc_data.topics

        return "\n\n".join(pydoc_data.topics.topics.values())
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KVServeError(f"cannot read text file {path}: {e}") from e
