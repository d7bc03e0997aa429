"""Text from the chat messages, marked as such through everything a chat template does to it.

A chat template turns messages into one string, and only the template's own text may become
special tokens: a user who types ``<|IM_END|>`` must not get a real ``<|im_end|>`` because the
template lowercases content (or replaces ``[`` with ``<|``, reverses it, or glues two messages'
halves together). So every string that enters the template from the messages is a
``UserText``, a ``str`` that stays marked: slicing, iterating, ``+`` and ``*`` are overridden
here, and every other operation a template can apply (filters, methods, ``~``, ``%``,
``format``) goes through the sandbox (``template_sandbox``), which marks its result. A string
built from both kinds of text is a ``MixedText`` that records which characters came from the
messages (``spans``: start, end, start, end, ... in an ``array``).

Marking is exact where the result's characters can be traced (concatenation, slicing, ``join``,
formatting, stripping) and whole otherwise: ``upper()`` of a string holding any user text is
user text throughout. That can only turn template text into user text, never the reverse, so
it fails closed. Numbers carry no mark: a template that computes a number from a message
(``|length``) and spells text with it (``'%c' % n``, an index into its own alphabet) writes
that text itself, as it could write any turn it likes.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from typing import Any

Spans = array  # flat start, end pairs, sorted, disjoint, none empty

_MAX_DEPTH = 64  # how deeply marking follows nested lists and dicts


class Marked(str):
    """A str some of whose characters came from the messages (see ``spans_of``)."""

    __slots__ = ()

    def __str__(self) -> str:
        return self  # str(x) keeps the mark: Jinja calls str() on every value it outputs

    def __getitem__(self, key: Any) -> str:
        piece = str.__getitem__(self, key)
        if type(self) is UserText:
            return UserText(piece) if piece else piece
        return make(piece, _slice_spans(spans_of(self), len(self), key))

    def __iter__(self) -> Iterator[str]:
        spans, n = spans_of(self), 0
        for i, char in enumerate(str.__iter__(self)):
            while n < len(spans) and spans[n + 1] <= i:
                n += 2
            yield UserText(char) if n < len(spans) and spans[n] <= i else char

    def __add__(self, other: Any) -> Any:
        return _concat(self, other) if isinstance(other, str) else NotImplemented

    def __radd__(self, other: Any) -> Any:
        return _concat(other, self) if isinstance(other, str) else NotImplemented

    def __mul__(self, count: Any) -> Any:
        if not isinstance(count, int):
            return NotImplemented
        if isinstance(self, MixedText):
            return join_marked([self] * max(count, 0))
        text = str.__mul__(self, count)
        return UserText(text) if text else text

    __rmul__ = __mul__


class UserText(Marked):
    """A str that came from the messages, every character of it."""

    __slots__ = ()


class MixedText(Marked):
    """A str built from template text and user text; ``spans_of`` says which characters are which."""

    _spans: Spans  # underscored: the sandbox hides it from templates, which could otherwise edit it

    def __new__(cls, text: str, spans: Spans) -> MixedText:
        self = super().__new__(cls, text)
        self._spans = spans
        return self


def spans_of(text: str) -> Spans:
    """Where ``text`` holds user text: start, end, start, end, ..."""
    if isinstance(text, MixedText):
        return text._spans
    if isinstance(text, UserText):
        return array("q", (0, len(text))) if text else array("q")
    return array("q")


def plain(text: str) -> str:
    """``text`` as a plain str, whatever it is marked as."""
    return str.__str__(text) if type(text) is not str else text


def make(text: str, spans: Spans) -> str:
    """``text`` marked where ``spans`` says (plain when nowhere, ``UserText`` when everywhere)."""
    if not spans:
        return plain(text)
    if len(spans) == 2 and spans[0] == 0 and spans[1] == len(text):
        return text if type(text) is UserText else UserText(text)
    return MixedText(plain(text), spans)


def join_marked(pieces: Iterable[str]) -> str:
    """``"".join(pieces)`` with each piece's marks moved to where it lands."""
    pieces = list(pieces)
    text = "".join(pieces)
    if not any(isinstance(piece, Marked) for piece in pieces):
        return text
    spans = array("q")
    offset = 0
    for piece in pieces:
        if isinstance(piece, Marked):
            edges = (0, len(piece)) if type(piece) is UserText else piece._spans
            for k, edge in enumerate(edges):
                edge += offset
                if k % 2 == 0 and spans and spans[-1] == edge:
                    spans.pop()  # touches the previous span: extend it
                else:
                    spans.append(edge)
        offset += len(piece)
    return make(text, spans)


def _concat(left: str, right: str) -> str:
    """``left + right`` with marks: ``join_marked`` for two pieces, the common cases first
    (templates concatenate a lot: ``'<|im_start|>' + role + '\\n' + content``)."""
    text = str.__add__(left, right)
    user_left, user_right = type(left) is UserText, type(right) is UserText
    if user_left and user_right or (user_left and not right) or (user_right and not left):
        return UserText(text)
    if user_left and type(right) is str:
        return MixedText(text, array("q", (0, len(left))))
    if user_right and type(left) is str:
        return MixedText(text, array("q", (len(left), len(text))))
    if type(left) is MixedText and type(right) is str:
        return MixedText(text, left._spans)  # spans are never changed once made: sharing is safe
    if type(left) is MixedText and user_right:
        spans = array("q", left._spans)
        if spans[-1] == len(left):
            spans[-1] = len(text)
        else:
            spans.extend((len(left), len(text)))
        return MixedText(text, spans)
    return join_marked([left, right])


def _slice_spans(spans: Spans, length: int, key: Any) -> Spans:
    """The spans of ``text[key]`` for a text of ``length`` characters with ``spans``.

    The indices a slice takes are an arithmetic progression, so those inside one span are a
    run of consecutive positions of the result: each span maps to one run, found by division.
    """
    if not spans:
        return spans
    if not isinstance(key, slice):
        index = key + length if key < 0 else key
        inside = any(spans[k] <= index < spans[k + 1] for k in range(0, len(spans), 2))
        return array("q", (0, 1)) if inside else array("q")
    start, stop, step = key.indices(length)
    count = len(range(start, stop, step))
    runs = []
    for k in range(0, len(spans), 2):
        a, b = spans[k], spans[k + 1]  # positions p with a <= start + step * p < b
        if step > 0:
            low, high = -((start - a) // step), (b - 1 - start) // step
        else:
            low, high = -((b - 1 - start) // -step), (start - a) // -step
        low, high = max(low, 0), min(high, count - 1)
        if low <= high:
            runs.append((low, high + 1))
    out = array("q")
    for low, high in sorted(runs):
        if out and out[-1] == low:
            out[-1] = high
        else:
            out.extend((low, high))
    return out


def mark_user(value: Any, depth: int = 0) -> Any:
    """``value`` with every str in it (dict keys too, in lists and dicts at any depth) a ``UserText``:
    what the messages look like to the template. Numbers, booleans and None stay as they are; any
    other object becomes its text, marked (its ``str()`` is the caller's to define, and could
    spell anything)."""
    if isinstance(value, str):
        return UserText(value) if value else value
    if value is None or isinstance(value, (int, float)):
        return value
    if depth > _MAX_DEPTH:
        raise ValueError(f"the messages are nested more than {_MAX_DEPTH} levels deep")
    if isinstance(value, dict):
        return {mark_user(key, depth + 1): mark_user(item, depth + 1) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [mark_user(item, depth + 1) for item in value]
    return mark_user(str(value), depth)


def mark_all(value: Any, depth: int = 0) -> Any:
    """``value`` with every str in it wholly user text (lists, tuples and dicts are rebuilt only
    where something changes): the result of an operation whose input held user text."""
    if isinstance(value, str):
        return value if type(value) is UserText or not value else UserText(value)
    if depth > _MAX_DEPTH:
        return value
    if isinstance(value, (list, tuple)):
        items = [mark_all(item, depth + 1) for item in value]
        if all(new is old for new, old in zip(items, value, strict=True)):
            return value
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        pairs = [(mark_all(key, depth + 1), mark_all(item, depth + 1)) for key, item in value.items()]
        if all(k is k0 and v is v0 for (k, v), (k0, v0) in zip(pairs, value.items(), strict=True)):
            return value
        return dict(pairs)
    return value


def holds_user_text(value: Any) -> bool:
    """Whether ``value`` is, or holds at any depth of lists, tuples, sets and dicts, user text.

    Bytes count as user text: a template has no bytes literals, so bytes come from ``encode()``
    of some string, and ``decode()`` must not launder user text into template text.
    """
    seen: set[int] = set()
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (Marked, bytes, bytearray)):
            return True
        if isinstance(item, str) or id(item) in seen:
            continue
        if depth > _MAX_DEPTH:
            return True  # too deep to look through: assume the worst
        if isinstance(item, dict):
            items = [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple, set, frozenset, *_DICT_VIEWS)):
            items = list(item)
        elif hasattr(item, "_Namespace__attrs"):  # jinja2's namespace() keeps its attributes here
            items = [item._Namespace__attrs]
        else:
            continue
        seen.add(id(item))
        kinds = set(map(type, items))  # in C: a list of a million plain strings is quick to clear
        if kinds & _USER_KINDS:
            return True
        if not kinds <= _PLAIN_SCALARS:
            stack.extend((x, depth + 1) for x in items if type(x) not in _PLAIN_SCALARS)
    return False


_DICT_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))
_USER_KINDS = {UserText, MixedText, bytes, bytearray}
_PLAIN_SCALARS = {str, int, float, bool, type(None)}
