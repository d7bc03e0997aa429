"""What one chat-template render may use, and the sizes checked against it before anything is built.

A chat template is code that comes with the model. Three limits bound what it can do, all of
them growing with the size of the conversation so that long chats still render:

* **time**: ``seconds``, enforced by the sandbox's deadline;
* **the size of one value**: ``max_chars`` characters (or items). Every operation that can make
  a value larger than its inputs (``*``, ``+``, ``~``, ``%``, ``format``, ``join``, ``center``,
  ``replace``, ``indent``...) computes the size of its result from the sizes of its arguments
  and its widths *before* building it, and refuses above the limit: "output larger than N";
* **all the values built in one render**: ``max_built`` bytes. One value is bounded by the limit
  above, but a template can build many (a thousand ``{% set %}`` of a megabyte each, or a macro
  that outputs a fresh megabyte in each of 100 000 iterations): every value an intercepted
  operation builds is charged here by what it occupies.

The size functions never build what they measure and stop once past the limit, so measuring a
list of a million references to one string costs nothing like printing it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from operator import methodcaller
from typing import Any

from markupsafe import Markup

from minillm.tokenizer.user_text import MixedText, UserText

_BASE_SECONDS = 1.0
_SECONDS_PER_INPUT_CHAR = 1e-6
_BASE_MAX_CHARS = 1 << 20
_MAX_CHARS_PER_INPUT_CHAR = 8
_BASE_MAX_BUILT = 64 << 20
_MAX_BUILT_PER_INPUT_CHAR = 128

# Upper bounds of how long str() of a scalar is: a float printed with %f can have 309 digits.
_FLOAT_CHARS = 330
_OTHER_CHARS = 200  # repr of an object of another kind: <LoopContext 1/3>, <generator ...>
_DICT_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))  # their repr lists what they see
_TEXT_KINDS = {str, UserText, MixedText, Markup}
_INT_KINDS = {int, bool}
_OTHER_SCALARS = {float, type(None)}
_SCALARS = _TEXT_KINDS | _INT_KINDS | _OTHER_SCALARS | {bytes, bytearray}


class TemplateError(ValueError):
    """A chat template that does not parse, refuses the messages, or goes past a limit."""


class Limits:
    """The time and sizes one render may use, scaled to the size of its input (in characters)."""

    def __init__(self, input_chars: int) -> None:
        self.seconds = _BASE_SECONDS + _SECONDS_PER_INPUT_CHAR * input_chars
        self.max_chars = _BASE_MAX_CHARS + _MAX_CHARS_PER_INPUT_CHAR * input_chars
        self.max_built = _BASE_MAX_BUILT + _MAX_BUILT_PER_INPUT_CHAR * input_chars
        self.built = 0

    def check(self, size: int, what: str) -> None:
        """Refuse ``what`` if its result would hold more than ``max_chars`` characters or items."""
        if size > self.max_chars:
            shown = f"about {size}" if size <= 10 * self.max_chars else f"over {10 * self.max_chars}"
            raise TemplateError(
                f"chat template: {what} would make output larger than {self.max_chars} characters "
                f"({shown}; the limit grows with the conversation)"
            )

    def check_held(self, value: Any, what: str) -> Any:
        """``value``, if what it holds (counted by ``held_size``) is within ``max_chars``."""
        self.check(held_size(value, self.max_chars), what)
        return value

    def check_text(self, value: Any, what: str) -> int:
        """The length ``str(value)`` can have (``text_size``), refused above ``max_chars``."""
        size = text_size(value, self.max_chars)
        self.check(size, what)
        return size

    def check_numbers(self, args: Sequence[Any], kwargs: dict[str, Any], what: str) -> None:
        """An int argument of a builtin method or filter is a width, count or length."""
        for arg in [*args, *kwargs.values()]:
            if isinstance(arg, int) and not isinstance(arg, bool):
                self.check(abs(arg), f"{what} with argument {arg if abs(arg) < 10**30 else 'of over 30 digits'}")

    def charge(self, value: Any, what: str) -> Any:
        """Count ``value`` (just built) against ``max_built``; returns it."""
        self.built += cost(value)
        if self.built > self.max_built:
            raise TemplateError(
                f"chat template: the values built while rendering would take more than {self.max_built >> 20} MB "
                f"(the limit for this conversation), the last of them by {what}"
            )
        return value


def held_size(value: Any, limit: int) -> int:
    """Characters and items ``value`` holds, every reference counted (a list of a thousand
    references to one string holds a thousand strings: that is what printing it would build).
    Stops counting past ``limit``."""
    if isinstance(value, str):
        return len(value)

    def leaf(item: Any) -> int | None:
        if isinstance(item, (str, bytes, bytearray)):
            return len(item)
        if isinstance(item, int):
            return item.bit_length() // 8
        return None if _children(item) is not None else 0

    def flat(items: list[Any], kinds: set[type]) -> int | None:
        if kinds <= _TEXT_KINDS:
            return sum(map(len, items))
        if kinds <= _INT_KINDS:
            return sum(map(int.bit_length, items)) // 8
        return 0 if kinds <= _OTHER_SCALARS else None

    return _dag_size(value, leaf, flat, lambda item, n: n, limit)


def text_size(value: Any, limit: int) -> int:
    """An upper bound of ``len(str(value))`` (and of ``pprint``'s and ``repr``'s), stopping past
    ``limit``. A string inside a container is printed by repr, which can turn one character
    into ten (``'\\U000f0000'``)."""
    if isinstance(value, str):
        return len(value)

    def leaf(item: Any) -> int | None:
        if isinstance(item, (str, bytes, bytearray)):
            return _repr_sizes([item], {type(item)})
        if isinstance(item, (int, float)) or item is None:
            return _repr_sizes([item], {type(item)})
        return None if _children(item) is not None else _OTHER_CHARS

    return _dag_size(value, leaf, _repr_sizes, lambda item, n: 4 * n + 16, limit)


def json_size(value: Any, indent: int, limit: int) -> int:
    """An upper bound of the length of ``tojson`` of ``value`` (``indent`` characters a level):
    ``\\uXXXX`` escapes make a character up to 12, and ``<>&'`` are escaped for HTML; with
    ``indent``, each element's line is indented at most as deep as the value nests."""
    per_item = 4 + (1 + indent * _depth(value) if indent else 0)

    def flat(items: list[Any], kinds: set[type]) -> int | None:
        if not kinds <= _TEXT_KINDS:
            return _repr_sizes(items, kinds)
        size = sum(map(len, items))
        if all(map(str.isascii, items)) and all(map(str.isprintable, items)):
            specials = sum(sum(map(methodcaller("count", char), items)) for char in "<>&'")
            return size + sum(map(methodcaller("count", '"'), items)) + sum(map(methodcaller("count", "\\"), items)) \
                + 5 * specials + 2 * len(items)
        return 12 * size + 2 * len(items)

    def leaf(item: Any) -> int | None:
        if isinstance(item, (dict, list, tuple)):
            return None
        return flat([item], {type(item)}) if isinstance(item, str) else text_size(item, limit)

    return _dag_size(value, leaf, flat, lambda item, n: per_item * (n + 1), limit)


def _repr_sizes(items: list[Any], kinds: set[type]) -> int | None:
    """An upper bound of the total length of the reprs of ``items`` (scalars of ``kinds``), in C
    loops: one character of a string can print as ten (``'\\U000f0000'``)."""
    if kinds <= _TEXT_KINDS:
        size = sum(map(len, items))
        if all(map(str.isprintable, items)):
            return size + sum(map(methodcaller("count", "\\"), items)) + sum(map(methodcaller("count", "'"), items)) \
                + 2 * len(items)
        return 10 * size + 2 * len(items)
    if kinds <= {bytes, bytearray}:
        return 4 * sum(map(len, items)) + 3 * len(items)
    if kinds <= _INT_KINDS:
        return int(sum(map(int.bit_length, items)) * 0.302) + 2 * len(items)
    if kinds <= {float}:
        return _FLOAT_CHARS * len(items)
    if kinds <= {type(None)}:
        return 4 * len(items)
    return None


def _children(item: Any) -> list[Any] | None:
    """What a container holds (a dict: its keys and values); None for anything else."""
    if isinstance(item, dict):
        return [*item.keys(), *item.values()]
    if isinstance(item, (list, tuple, set, frozenset)):
        return list(item)
    if isinstance(item, _DICT_VIEWS):
        return [*item.mapping.keys(), *item.mapping.values()]  # its repr shows keys, values or both
    if hasattr(item, "_Namespace__attrs"):  # jinja2's namespace() keeps its attributes here
        return [item._Namespace__attrs]
    return None


def _depth(value: Any) -> int:
    """How deeply containers nest in ``value`` (each object looked at once)."""
    depths: dict[int, int] = {}
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        item, children_done = stack.pop()
        children = _children(item)
        if children is None or (id(item) in depths and not children_done):
            continue
        if not children_done:
            depths[id(item)] = 1  # also what a cycle (only in data from outside) counts as
            stack.append((item, True))
            stack.extend((child, False) for child in children if id(child) not in depths)
        else:
            depths[id(item)] = 1 + max((depths.get(id(child), 0) for child in children), default=0)
    return depths.get(id(value), 0)


def _dag_size(value: Any, leaf: Any, flat: Any, own: Any, limit: int) -> int:
    """The size of ``value``: ``leaf(item)`` for a scalar, ``own(item, n)`` plus its ``n``
    children's for a container, every reference counted but each object measured once, so a
    list that holds itself doubled sixty times (``{% set a = [a, a] %}``) costs sixty steps, not
    2**60. A container of scalars of one kind is measured by ``flat`` in C loops (a list of a
    million strings, while a trace function watches every Python line). Past ``limit``, a size
    is only known to be too large."""
    sizes: dict[int, int] = {}
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        item, children_done = stack.pop()
        if id(item) in sizes:
            continue
        size = leaf(item)
        if size is not None:
            sizes[id(item)] = size
            continue
        children = _children(item) or []
        if not children_done:
            kinds = set(map(type, children))
            size = flat(children, kinds) if kinds <= _SCALARS else None
            if size is not None:
                sizes[id(item)] = min(own(item, len(children)) + size, limit + 1)
                continue
            stack.append((item, True))
            stack.extend((child, False) for child in children if id(child) not in sizes)
            continue
        total = own(item, len(children))
        for child in children:
            total += sizes.get(id(child), limit + 1)  # missing: a cycle, only in data from outside
            if total > limit:
                break
        sizes[id(item)] = min(total, limit + 1)
    return sizes[id(value)]


def cost(value: Any) -> int:
    """Bytes a value just built occupies: itself, and for a container the distinct objects
    it holds one level down (``split()`` makes new strings; the container alone is pointers).
    All in C loops, which the deadline's trace function does not slow down."""
    total = sys.getsizeof(value)
    if isinstance(value, MixedText):
        total += sys.getsizeof(value._spans)
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        total += sum(map(sys.getsizeof, dict(zip(map(id, items), items, strict=True)).values()))
    return total
