"""The filters a chat template can use: Jinja's own, each with its result's size checked first.

A filter runs in C or in Jinja's Python, out of the sandbox's sight, so each is wrapped here:
before it runs, the size of its result is computed from its value and arguments
(``_filter_size``: ``center(10**10)``, ``replace('a', 'b' * 10000)``, ``indent``,
``wordwrap``, ``tojson(indent=...)``, ``batch`` and ``slice`` fills, printing a value); after,
the result is marked as user text if its input held any (``user_text``) and charged to the
render's budget. ``format`` and ``join`` are rewritten (``template_format``, ``join_checked``),
and ``map``'s generator counts what it yields. Every wrapper takes the context, so Jinja cannot
run it at compile time, outside the limits; the limits are the context's environment's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

from jinja2.defaults import DEFAULT_FILTERS
from jinja2.filters import make_attrgetter
from jinja2.utils import _PassArg, pass_context

from minillm.tokenizer.template_format import format_filter
from minillm.tokenizer.template_limits import Limits, held_size, json_size, text_size
from minillm.tokenizer.user_text import Marked, holds_user_text, join_marked, mark_all

# Filters that print their value, and how many characters the result can have per character of
# it: upper() of 'ﬃ' is 'FFI', escaping makes '"' '&#34;', urlencode makes a character '%F0%9F%98%80'.
_PRINTING_FILTERS = {
    "string": 1, "safe": 1, "trim": 1, "striptags": 1, "wordcount": 1, "int": 1, "float": 1, "filesizeformat": 1,
    "lower": 3, "upper": 3, "title": 3, "capitalize": 3, "pprint": 2, "escape": 6, "e": 6, "forceescape": 6,
    "xmlattr": 6, "urlencode": 12, "urlize": 30,
}  # fmt: skip
# Filters whose result is their value, elements of it, containers of those, or a number: nothing new to mark.
_ELEMENT_FILTERS = frozenset({
    "attr", "batch", "d", "default", "dictsort", "first", "groupby", "items", "last", "list", "max", "min",
    "random", "reject", "rejectattr", "reverse", "select", "selectattr", "slice", "sort", "sum", "unique",
    "abs", "count", "float", "int", "length", "round", "wordcount",
})  # fmt: skip


@functools.cache
def bounded_filters() -> dict[str, Callable[..., Any]]:
    """Jinja's filters, each wrapped by ``_bounded_filter`` (once: the limits are the context's)."""
    return {name: _bounded_filter(name, func) for name, func in DEFAULT_FILTERS.items()}


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` (a Jinja filter) with its result's size checked before it runs and its result
    marked and charged after. It takes the context, so Jinja never calls it while compiling."""
    what = f"the {name!r} filter"
    pass_arg = getattr(func, "jinja_pass_arg", None)
    if name == "format":
        func, pass_arg = format_filter, _PassArg.environment

    @pass_context
    @functools.wraps(func)
    def bounded(context: Any, value: Any = None, *args: Any, **kwargs: Any) -> Any:
        limits = context.environment.limits
        if isinstance(value, Iterator):  # a generator (map, select...): collected within the limit
            value = bounded_list(value, limits, what)
        if name == "join":
            return _join_filter(context, value, args, kwargs, limits, what)
        limits.check(_filter_size(name, value, args, kwargs, limits), what)
        first = () if pass_arg is None else (context if pass_arg is _PassArg.context else
                 context.eval_ctx if pass_arg is _PassArg.eval_context else context.environment,)  # fmt: skip
        result = func(*first, value, *args, **kwargs)
        if name == "map":
            return _counted(result, limits, what)
        if name not in _ELEMENT_FILTERS and not isinstance(result, Marked) and holds_user_text((value, args, kwargs)):
            result = _mark_filter_result(name, value, args, kwargs, result)
        return limits.charge(limits.check_held(result, what), what)

    return bounded


def _mark_filter_result(name: str, value: Any, args: tuple, kwargs: dict, result: Any) -> Any:
    """A filter's result when its input held user text: ``trim`` keeps the marks of the part of
    its value it returns; any other result is wholly user text."""
    if name == "trim" and isinstance(value, str) and isinstance(result, str):
        start = len(value) - len(value.lstrip(_arg(args, kwargs, 0, "chars")))
        return value[start : start + len(result)]
    return mark_all(result)


def _arg(args: tuple, kwargs: dict, index: int, key: str, default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(key, default)


def _filter_size(name: str, value: Any, args: tuple, kwargs: dict, limits: Limits) -> int:
    """How large the result of filter ``name`` can be: its length, or items plus characters."""
    cap = limits.max_chars
    if name in ("list", "sort", "unique", "batch", "slice", "groupby") and isinstance(value, str):
        return 2 * len(value)  # a list of its characters: an item and a character each
    if name in _PRINTING_FILTERS or name in ("center", "indent", "wordwrap", "replace", "truncate"):
        size = text_size(value, cap)
        limits.check(size, f"the {name!r} filter printing its value")
    if name in _PRINTING_FILTERS:
        return size * _PRINTING_FILTERS[name]
    if name in ("center", "indent", "wordwrap", "batch", "slice", "tojson"):
        numbers = [arg for arg in (*args, *kwargs.values()) if not isinstance(arg, bool)]  # not first=True
        limits.check_numbers(numbers, {}, f"the {name!r} filter")
    if name == "center":
        width = _arg(args, kwargs, 0, "width", 80)
        return max(size, width if isinstance(width, int) else 0)
    if name == "indent":
        width = _arg(args, kwargs, 0, "width", 4)
        lines = value.count("\n") + 1 if isinstance(value, str) else size + 1
        return size + lines * (width if isinstance(width, int) else text_size(width, cap))
    if name == "wordwrap":
        wrapstring = _arg(args, kwargs, 2, "wrapstring") or "\n"
        return size + (size + 1) * text_size(wrapstring, cap)
    if name == "replace":
        old, new = str(_arg(args, kwargs, 0, "old", "")), _arg(args, kwargs, 1, "new", "")
        new_size = text_size(new, cap)
        limits.check(new_size, "the 'replace' filter")
        if isinstance(value, str) and isinstance(new, str):
            return replace_size(value, old, new, _arg(args, kwargs, 2, "count"))
        return size + (size + 1) * new_size
    if name == "truncate":
        return size + text_size(_arg(args, kwargs, 2, "end", "..."), cap)
    if name == "tojson":
        indent = _arg(args, kwargs, 0, "indent")
        return json_size(value, indent if isinstance(indent, int) else text_size(indent or "", cap), cap)
    if name in ("batch", "slice"):
        count = _arg(args, kwargs, 0, "linecount" if name == "batch" else "slices", 1)
        fill = _arg(args, kwargs, 1, "fill_with")
        return held_size(value, cap) + (count * (1 + held_size(fill, cap)) if fill is not None else 0)
    if name == "sum":
        return held_size(value, cap) + held_size(_arg(args, kwargs, 1, "start", 0), cap)
    return 0  # the rest return their value's items or parts of them, checked after


def _join_filter(context: Any, value: Any, args: tuple, kwargs: dict, limits: Limits, what: str) -> str:
    """Jinja's ``join`` filter (``d`` between the items, each printed, or their ``attribute``),
    the length checked item by item before each is printed."""
    separator, attribute = _arg(args, kwargs, 0, "d", ""), _arg(args, kwargs, 1, "attribute")
    env, cap = context.environment, limits.max_chars
    separator = env._printed(separator, what)
    getter = make_attrgetter(env, attribute) if attribute is not None else None
    printed, total = [], -len(separator)
    for item in bounded_list(value, limits, what):
        item = getter(item) if getter else item
        total += len(separator) + text_size(item, cap)
        limits.check(total, what)
        printed.append(env._printed(item, what))
    return join_checked(separator, printed, limits, what)


def _counted(items: Iterator[Any], limits: Limits, what: str) -> Iterator[Any]:
    """``map``'s generator, refusing once what it has yielded holds more than the limit: each
    item is a filter's fresh result (``map('center', 1000000)``), and a list can collect them."""
    total = 0
    for item in items:
        total += 1 + held_size(item, limits.max_chars)
        limits.check(total, what)
        yield item


def replace_size(s: Any, old: Any, new: Any, count: Any) -> int:
    """Length of ``s.replace(old, new, count)``, computed without building it."""
    occurrences = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        occurrences = min(occurrences, count)
    return len(s) + occurrences * (len(new) - len(old))


def join_checked(separator: str, items: Any, limits: Limits, what: str) -> str:
    """``separator.join(items)``, its length checked item by item as the items are collected
    (a generator of a hundred thousand items is refused at the tenth if the separator is long)."""
    collected, total = [], -len(separator)
    for item in items:  # a generator is consumed as it goes: the check stops it early
        if not isinstance(item, str):
            raise TypeError(f"sequence item {len(collected)}: expected str instance, {type(item).__name__} found")
        total += len(separator) + len(item)
        limits.check(total, what)
        collected.append(item)
    pieces = [piece for item in collected for piece in (separator, item)][1:]
    return limits.charge(join_marked(pieces), what)


def bounded_list(value: Any, limits: Limits, what: str) -> Any:
    """``list(value)`` for a generator, refused once it holds more than the limit (each item
    counts one plus what it holds); a sized value (a list, a range) is checked by its length."""
    if isinstance(value, (list, tuple)):
        return value
    if hasattr(value, "__len__"):
        limits.check(len(value), what)
        return list(value)
    items, total = [], 0
    for item in value:
        total += 1 + held_size(item, limits.max_chars)
        limits.check(total, what)
        items.append(item)
    return items
