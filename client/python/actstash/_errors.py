"""The package's exceptions, one hierarchy under StashError. Imports nothing, so
that the pure modules (the planner) raise them too."""


class StashError(RuntimeError):
    """An actstash operation failed (base class)."""


class StashUnavailable(StashError):
    """The daemon cannot be reached (or went away)."""


class StashFull(StashError):
    """The session's quota or the daemon's pool has no room."""


class StashNotFound(StashError):
    """An unknown or released handle."""


class StashInvalidArgument(StashError, ValueError):
    """A value the caller passed was refused (INVALID_ARGUMENT: an unknown setting, a bad
    size). Also a ValueError, as Python's own checks of arguments raise."""


class BudgetError(StashError, ValueError):
    """No plan keeps the step's peak memory within the budget (or the daemon's quota).
    Also a ValueError: the budget is an argument the caller can change."""
