"""Opening the files a checkpoint names: regular files only, and names that stay inside it.

A model folder is input like any other, and two things in it can hurt before a byte is parsed:

* **What kind of file a name points at.** ``open()`` on a FIFO blocks until a writer appears —
  forever, and Ctrl-C is not delivered while Python waits inside ``open`` — and a device such
  as ``/dev/zero`` never ends (opening some devices even has side effects). So a file is
  ``stat``-ed first and opened only if it is a *regular* file. Symlinks are followed: Hugging
  Face hub snapshots are symlinks into ``../../blobs/``, and it is the target that must be regular.
* **Where a name points.** A shard name in ``model.safetensors.index.json`` is text from the
  file: ``../../home/me/.ssh/id_rsa`` or ``/etc/passwd`` must not be opened, and the error must
  not tell an existing outside file from a missing one (that would leak what exists). The rule
  checks the *name* — one plain file name, no separator, no ``..`` — never where a symlink
  resolves, so hub snapshots keep working.

Every function here raises ``FileNotFoundError`` for a missing file and ``FileFormatError``
(naming the path and what the file is for) for everything else.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from minillm.errors import FileFormatError

# A JSON file becomes Python objects of ~10x its size, so a JSON file minillm reads whole
# (config.json, the shard index) is refused above this. Real ones are a few kB to ~1 MB.
JSON_LIMIT = 16 * 2**20

# Characters that make a name more than one plain file name: POSIX and Windows separators,
# the Windows drive colon ("C:x" is "x" in drive C's current folder), and NUL.
_NOT_IN_A_NAME = frozenset("/\\:\0")
_NAME_MAX = 255  # bytes in one file name on common file systems


def _kind(mode: int) -> str:
    """'a directory', 'a FIFO (named pipe)', ... for an ``st_mode`` that is not a regular file."""
    kinds = [(stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def existing_path(value: object, what: str, noun: str, expected: str) -> Path:
    """A path argument (``str`` or ``os.PathLike``) as a ``Path`` to something that exists.

    ``what`` names the argument in the ``TypeError`` ("source (or None)", "a tokenizer path"); the
    ``FileNotFoundError`` says "no {noun} at {path}" and what was ``expected`` there.
    """
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{what} must be a path (str or Path), got {type(value).__name__}")
    path = Path(value)
    if not path.exists():
        raise FileNotFoundError(f"no {noun} at {path}: expected {expected}")
    return path


def regular_file(path: Path, what: str) -> Path:
    """``path`` if it names an existing regular file (following symlinks); nothing is opened.

    Raises ``FileNotFoundError`` if nothing is there, ``FileFormatError`` for a directory,
    FIFO, device or socket, or when the name cannot be looked up (a symlink loop, ...).
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file (the {what})") from None
    except OSError as err:
        raise FileFormatError(f"{path}: cannot look up the {what} ({err.strerror})") from None
    if not stat.S_ISREG(mode):
        raise FileFormatError(f"{path}: the {what} is {_kind(mode)}, not a regular file")
    return path


def open_regular(path: Path, what: str) -> BinaryIO:
    """Open a regular file for binary reading; a FIFO or device is refused, never opened.

    ``stat`` comes first, so a device is not even opened. The file is then opened with
    ``O_NONBLOCK`` and checked again with ``fstat``: if the name was swapped for a FIFO in
    between, the open returns at once instead of waiting for a writer, and is refused.
    """
    regular_file(path, what)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise FileFormatError(f"{path}: the {what} is {_kind(mode)}, not a regular file")
        return os.fdopen(fd, "rb")  # O_NONBLOCK changes nothing for a regular file
    except BaseException:
        os.close(fd)
        raise


def read_json(path: Path, what: str, max_bytes: int = JSON_LIMIT) -> Any:
    """Parse a regular file of at most ``max_bytes`` as JSON, or raise a FileFormatError naming it."""
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise FileFormatError(f"{path}: the {what} is {size:,} bytes, more than the {max_bytes:,} a {what} may be")
        data = f.read(max_bytes + 1)
    try:
        return json.loads(data)
    # ValueError: bad JSON, bad UTF-8, an integer of thousands of digits; RecursionError: [[[[... nested deeply
    except (ValueError, RecursionError) as err:
        raise FileFormatError(f"{path}: the {what} is not valid JSON ({type(err).__name__}: {err})") from None


def _plain_name(name: str) -> bool:
    """One file name: not '', '.' or '..'; no separator, drive colon or NUL; UTF-8 of at most 255 bytes."""
    if name in ("", ".", "..") or not _NOT_IN_A_NAME.isdisjoint(name):
        return False
    try:
        return len(name.encode("utf-8")) <= _NAME_MAX
    except UnicodeEncodeError:  # a lone surrogate, which JSON's "\ud800" can produce
        return False


def member_file(folder: Path, name: Any, what: str) -> Path:
    """``folder / name`` for a file name that a file inside ``folder`` gave.

    The name must be one plain file name: not absolute, no directory part, not ``.`` or ``..``.
    It is checked as text before the file system is asked anything, so a refused name reveals
    nothing about what exists outside the folder. (The result may still be a symlink; callers
    check that its target is a regular file.)
    """
    if not isinstance(name, str):
        raise FileFormatError(f"the {what} must be a file name (a string), got {type(name).__name__} {name!r:.80}")
    if not _plain_name(name):
        raise FileFormatError(
            f"the {what} {name!r:.120} is not a plain file name inside {folder} "
            "(no '/', '\\', ':', '..' or absolute paths: checkpoint files live in the checkpoint folder)"
        )
    return folder / name
