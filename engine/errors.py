"""Engine errors. "No room" is never an error here: the scheduler handles it."""


class EngineError(Exception):
    """Something in the engine is broken (not the caller's fault)."""


class RequestError(ValueError):
    """A request the engine refuses before doing any work; names the field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):  # crosses process boundaries (Ray) as itself
        return type(self), (self.field, self.message)


class ModelLoadError(EngineError):
    """A model folder is missing, corrupt, or cannot serve the asked task. ``field``: the
    setting of the folder's config at fault, when one is (an adapter's ``lora_alpha``)."""

    def __init__(self, path: str, message: str, field: str | None = None):
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message
        self.field = field

    def __reduce__(self):
        return type(self), (self.path, self.message, self.field)


class RequestAborted(Exception):
    """The request was aborted (client gone, timeout, cancel) before it finished."""


class DeadlineExceeded(Exception):
    """The request's deadline passed (``on_deadline: drop``): its work was dropped."""


class EngineStopped(EngineError):
    """The engine loop is not running (never started, or shut down)."""


class ModelUnavailable(EngineError):
    """An on-demand model could not be made resident in time (still loading, or no
    room in the weight budget while the others are busy): retry after a while."""

    def __init__(self, model: str, message: str, retry_after: int = 1):
        super().__init__(f"model {model!r}: {message}")
        self.model = model
        self.message = message
        self.retry_after = retry_after

    def __reduce__(self):
        return type(self), (self.model, self.message, self.retry_after)
