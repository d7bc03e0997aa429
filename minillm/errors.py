"""The exceptions minillm raises on purpose.

Every error a user can trigger with bad input is one of these (or a plain ``TypeError`` /
``ValueError``), and its message names the file, tensor, parameter or sizes involved, so a
learner sees *what* is wrong instead of a stack trace from deep inside a library.
"""

from __future__ import annotations


class MinillmError(Exception):
    """Base class of minillm's own exceptions."""


class FileFormatError(MinillmError, ValueError):
    """A file exists but its contents are not what minillm expected (malformed or unsupported)."""


class GenerationError(MinillmError, RuntimeError):
    """One request could not go on (say its logits held NaN); the requests batched with it were unaffected."""
