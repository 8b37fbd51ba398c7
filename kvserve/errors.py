class KVServeError(ValueError):
    """A problem with the user's input or set-up, reported as one clear line (CLI) or HTTP 400 (server)."""


class ModelNotFoundError(KVServeError):
    pass
