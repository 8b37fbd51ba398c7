import tempfile
from pathlib import Path


class KVServeError(ValueError):
    """A problem with the user's input or set-up, reported as one clear line (CLI) or HTTP 400 (server)."""


class ModelNotFoundError(KVServeError):
    pass


def check_output_dir(path: str | Path, option: str) -> None:
    """Make the folder an option names and check that a file can be written there, before the work whose results
    go there (a distillation, an evaluation): an OSError at the end lost it all."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise KVServeError(f"cannot write to {option} {path}: {e}") from None
