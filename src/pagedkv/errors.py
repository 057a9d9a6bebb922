"""The one error hierarchy: every error pagedkv raises on purpose derives from `PagedKVError`.

Each error names the bad value and the limit it broke, and is raised before any state
changes, so a caller that catches it can carry on with the object it had.
"""

from __future__ import annotations


class PagedKVError(Exception):
    """Base class of every error pagedkv raises for bad input or an impossible request."""


class InvalidArgumentError(PagedKVError, ValueError):
    """A value is out of its allowed range (a count <= 0, a block size that is not an int, ...)."""


class OutOfBlocksError(PagedKVError):
    """The pool has fewer free blocks than an all-or-nothing request asked for."""

    def __init__(self, num_requested: int, num_free: int):
        self.num_requested = num_requested
        self.num_free = num_free
        super().__init__(f"Cannot allocate {num_requested} blocks from the pool ({num_free} free)")


class InvalidBlockError(PagedKVError, ValueError):
    """A block id is outside the pool, or is not allocated where an allocated block is required."""


class DoubleFreeError(PagedKVError):
    """A block was freed that is already free, or the same block was listed twice in one free."""


class SequenceTooLongError(PagedKVError):
    """A sequence would grow past the most tokens its block table (or the model) allows."""


class KernelInputError(PagedKVError, ValueError):
    """A tensor handed to a kernel has the wrong shape, dtype or device, or indexes outside the pool."""


class ModelMismatchError(PagedKVError):
    """A cache or pool built for one model was used with a model of another shape."""


class RequestRejectedError(PagedKVError):
    """A request can never be served (too long for the pool or the model) and was refused at admission."""


class SchedulerStallError(PagedKVError):
    """The scheduler could schedule nothing while work remained: an internal invariant broke."""


class StepFailedError(PagedKVError):
    """One engine step failed as a whole (its forward pass, or reading its tokens back). The requests
    in it (`request_ids`) were failed and their blocks freed; every other request goes on."""

    def __init__(self, request_ids: list[str], cause: str):
        self.request_ids = list(request_ids)
        super().__init__(f"the engine step serving {len(self.request_ids)} requests failed: {cause}")


class EngineDeadError(PagedKVError):
    """The engine cannot go on (a tensor-parallel worker died, or a collective timed out): in-flight
    requests are failed and every later call raises this too."""


class SamplingParamsError(InvalidArgumentError):
    """A sampling parameter is out of range. `field` names it."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"SamplingParams.{field}: {message}")


class ConfigError(InvalidArgumentError):
    """A model or engine configuration is missing a field, is unreadable, or cannot fit in memory."""


def require_positive_int(name: str, value: object, *, allow_zero: bool = False) -> int:
    """Return `value` if it is an int > 0 (>= 0 with `allow_zero`), else raise `InvalidArgumentError` naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    low = 0 if allow_zero else 1
    if value < low:
        raise InvalidArgumentError(f"{name} must be >= {low}, got {value}")
    return value
