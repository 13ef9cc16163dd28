"""The exceptions kvchat raises at its boundaries. The CLI turns each into one clear line."""


class KvchatError(Exception):
    """Base class of every error kvchat reports to a user."""


class ConfigError(KvchatError):
    """A configuration file or option is invalid (unknown key, bad value)."""


class ModelLoadError(KvchatError):
    """A model or tokenizer could not be found or loaded."""


class CacheFullError(KvchatError):
    """The KV cache has no room left for a request, even after evicting unpinned blocks."""


class ChunkError(KvchatError):
    """A chunk operation refers to something that does not exist or is not allowed."""


class StateFileError(KvchatError):
    """A saved state file is unreadable, truncated or made for another model or layout."""


class CommandError(KvchatError):
    """A REPL command was malformed (unknown command, missing or bad argument)."""


class DraftModelError(KvchatError):
    """A draft model cannot draft for the main model (another vocabulary) or is missing."""


class PathError(KvchatError):
    """A path cannot name a file (a NUL byte in it, a ~user who does not exist)."""
