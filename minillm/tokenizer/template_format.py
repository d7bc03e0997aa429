"""String formatting inside a chat template: ``fmt % args``, ``fmt.format(...)``, ``|format``.

Python builds a formatted string in one C call, so a width of ``5000000000`` in
``'%(a)5000000000s'`` or in a nested field ``'{:{}}'.format('x', '>2000000000')`` allocates
gigabytes before anything could look at the result. Here a format string is parsed into its
fields first (by CPython's rules: mapping keys in balanced parentheses, ``*`` widths taken from
the arguments, replacement fields nested in a format spec filled in before the spec is read),
each field's size is bounded from its width, precision and value, and only then is the field
formatted, on its own. Every field of a value that holds user text is marked as user text
(``user_text``), and the template's literal text around it keeps its marks.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from jinja2.sandbox import SandboxedFormatter
from markupsafe import Markup

from minillm.tokenizer.template_limits import Limits, text_size
from minillm.tokenizer.user_text import Marked, UserText, holds_user_text, join_marked, mark_all, plain

_FLAGS = "-+ #0"
_FLOAT_CHARS = 330
_ESCAPE_GROWTH = 6  # html escaping: '"' becomes '&#34;'

# The standard format spec: [[fill]align][sign][z][#][0][width][grouping][.precision][type]
_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(?P<width>[0-9]*)[,_]?(?:\.(?P<precision>[0-9]*))?[a-zA-Z%]?", re.DOTALL)


def _number(digits: str) -> int:
    """A width or precision written in the format string (refused later if too large)."""
    return int(digits) if len(digits) < 19 else 10**19


def _body_size(value: Any, conversion: str, precision: int | None, limit: int) -> int:
    """How long one converted value can be, before padding to its width."""
    if conversion in "sra":
        size = text_size(value, limit) if conversion == "s" else 10 * text_size(value, limit) + 2
        return min(size, precision) if precision is not None else size
    if conversion == "c":
        return 1
    if isinstance(value, int):  # binary, octal, hex or decimal digits, with grouping separators
        size = value.bit_length() * 4 // 3 + 3
    elif isinstance(value, float):
        size = _FLOAT_CHARS
    else:
        size = text_size(value, limit)
    return size + (precision or 0)


# ------------------------------------------------------------------------------ fmt % args
def printf(fmt: str, args: Any, limits: Limits, what: str) -> str:
    """``fmt % args`` for a str ``fmt``, built field by field after checking each one's size."""
    if isinstance(fmt, Markup):  # escapes its arguments; checked as a whole, then Markup's own %
        _, bound = _printf_fields(fmt, args, limits, what, _ESCAPE_GROWTH)
        limits.check(bound, what)
        result = fmt % args
        return mark_all(plain(result)) if holds_user_text(args) else result
    fields, _ = _printf_fields(fmt, args, limits, what, 1)
    pieces: list[str] = []
    for literal, spec, value in fields:
        pieces.append(literal)
        if spec is not None:
            piece = spec % (value,) if spec != "%%" else "%"
            pieces.append(UserText(piece) if piece and (holds_user_text(value) or isinstance(spec, Marked)) else piece)
    return join_marked(pieces)


def _printf_fields(fmt: str, args: Any, limits: Limits, what: str, growth: int) -> tuple[list, int]:
    """(literal text, one-field spec or None, value) for each field of ``fmt % args``, and an
    upper bound of the result's length; every width and precision is checked on the way.

    Mirrors CPython's ``PyUnicode_Format``: a tuple supplies fields in order; anything else is
    one value, and anything with ``__getitem__`` but a tuple or str serves ``%(key)s`` too.
    """
    positional = list(args) if isinstance(args, tuple) else [args]
    mapping = args if hasattr(args, "__getitem__") and not isinstance(args, (tuple, str)) else None
    taken = 0

    def take() -> Any:
        nonlocal taken
        if taken >= len(positional):
            raise TypeError("not enough arguments for format string")
        taken += 1
        return positional[taken - 1]

    fields: list[tuple[str, Any, Any]] = []
    total = pos = 0
    while (start := fmt.find("%", pos)) >= 0:
        literal, j, value, keyed = fmt[pos:start], start + 1, None, False
        if fmt[j : j + 1] == "(":  # %(key)s: the key ends at the matching parenthesis
            depth, k = 1, j + 1
            while k < len(fmt) and depth:
                depth += {"(": 1, ")": -1}.get(fmt[k], 0)
                k += 1
            if depth:
                raise ValueError("incomplete format key")
            if mapping is None:
                raise TypeError("format requires a mapping")
            value, j, keyed = mapping[plain(fmt[j + 1 : k - 1])], k, True
            taken = len(positional)  # as in CPython: after a %(key) field, no value is left for a %s
        flags_start = flags_end = j
        while fmt[flags_end : flags_end + 1] and fmt[flags_end] in _FLAGS:
            flags_end += 1
        width, j = _printf_number(fmt, flags_end, take)
        precision = None
        if fmt[j : j + 1] == ".":
            precision, j = _printf_number(fmt, j + 1, take)
            precision = precision or 0
        if fmt[j : j + 1] and fmt[j] in "hlL":
            j += 1
        if j >= len(fmt):
            raise ValueError("incomplete format")
        conversion = fmt[j]
        for number, name in ((width, "width"), (precision, "precision")):
            if number is not None:
                limits.check(abs(number), f"{what} with a field {name} of {number}")
        if conversion == "%":
            spec: Any = "%%"
        else:
            if not keyed:
                value = take()
            spec = "%" + plain(fmt[flags_start:flags_end])
            spec += ("" if width is None else str(width)) + ("" if precision is None else f".{precision}") + conversion
            if isinstance(fmt[start : j + 1], Marked):
                spec = UserText(spec)
            total += max(abs(width or 0), growth * _body_size(value, conversion, precision, limits.max_chars)) + 2
        total += len(literal)
        limits.check(total, what)
        fields.append((literal, spec, value))
        pos = j + 1
    fields.append((fmt[pos:], None, None))
    total += len(fmt) - pos
    if taken < len(positional) and (isinstance(args, tuple) or mapping is None):
        raise TypeError("not all arguments converted during string formatting")
    return fields, total


def _printf_number(fmt: str, j: int, take: Callable[[], Any]) -> tuple[int | None, int]:
    """A width or precision at ``fmt[j]``: ``*`` (the next argument), digits, or none."""
    if fmt[j : j + 1] == "*":
        number = take()
        if not isinstance(number, int):
            raise TypeError("* wants int")
        return number, j + 1
    end = j
    while fmt[end : end + 1].isdigit() and fmt[end].isascii():
        end += 1
    return (_number(fmt[j:end]) if end > j else None), end


# ------------------------------------------------------------------------------ str.format
class BoundedFormatter(SandboxedFormatter):
    """The sandbox's formatter (attribute lookups sandboxed) building the result field by field:
    each field's spec is filled in first (``'{:{}}'``), then its width, precision and value
    bound its size before ``format()`` builds it. ``escape`` is Markup's, for ``Markup.format``."""

    def __init__(self, env: Any, limits: Limits, what: str, escape: Callable[[Any], str] | None = None) -> None:
        super().__init__(env)
        self.limits, self.what, self.escape = limits, what, escape
        self.total = 0

    def vformat(self, format_string: str, args: Any, kwargs: Any) -> str:
        used: set[Any] = set()
        pieces: list[str] = []
        self._pieces(plain(format_string), args, kwargs, used, 2, [0], pieces)
        self.check_unused_args(used, args, kwargs)
        result = join_marked(pieces)
        return UserText(result) if isinstance(format_string, Marked) and result else result

    def _pieces(self, fmt: str, args: Any, kwargs: Any, used: set, depth: int, auto: list, out: list) -> None:
        """string.Formatter._vformat, appending marked pieces to ``out``."""
        if depth < 0:
            raise ValueError("Max string recursion exceeded")
        for literal, field_name, spec, conversion in self.parse(fmt):
            if literal:
                out.append(literal)
                self._add(len(literal))
            if field_name is None:
                continue
            if field_name == "":
                if auto[0] is False:
                    raise ValueError("cannot switch from manual field specification to automatic field numbering")
                field_name, auto[0] = str(auto[0]), auto[0] + 1
            elif field_name.isdigit():
                if auto[0]:
                    raise ValueError("cannot switch from automatic field numbering to manual field specification")
                auto[0] = False
            value, key = self.get_field(field_name, args, kwargs)
            used.add(key)
            if conversion:  # !r, !s, !a: repr can make a character ten
                limits = self.limits
                what = f"{self.what} converting a field with !{conversion}"
                limits.check(10 * text_size(value, limits.max_chars) + 2, what)
                converted = self.convert_field(value, conversion)
                value = mark_all(converted) if holds_user_text(value) else converted
            spec_pieces: list[str] = []
            self._pieces(spec, args, kwargs, used, depth - 1, auto, spec_pieces)
            spec_text = join_marked(spec_pieces)
            piece = self.format_field(value, plain(spec_text))
            from_user = holds_user_text(value) or isinstance(spec_text, Marked)
            out.append(UserText(piece) if piece and from_user else piece)

    def format_field(self, value: Any, format_spec: str) -> str:
        limits, what = self.limits, self.what
        match = _SPEC.fullmatch(format_spec)
        if match:
            width, precision = _number(match["width"] or "0"), match["precision"]
            precision = _number(precision) if precision else None
        else:  # another type's own spec language: every number in it may be a width
            width, precision = sum(map(_number, re.findall(r"[0-9]+", format_spec))), None
        limits.check(width, f"{what} with a field width of {width}")
        limits.check(precision or 0, f"{what} with a field precision of {precision}")
        kind = "s" if isinstance(value, str) or not isinstance(value, (int, float)) else "d"
        bound = max(width, _body_size(value, kind, precision, limits.max_chars)) + 2
        self._add(bound * (_ESCAPE_GROWTH if self.escape else 1))
        piece = format(plain(value) if isinstance(value, str) else value, format_spec)
        return str(self.escape(piece)) if self.escape else piece

    def _add(self, size: int) -> None:
        self.total += size
        self.limits.check(self.total, self.what)


def format_method(env: Any, method: Any, limits: Limits) -> Callable[..., str]:
    """What ``fmt.format`` / ``fmt.format_map`` is inside the template: bounded and marking."""
    fmt = method.__self__
    is_map = method.__name__ == "format_map"
    what = f"{method.__name__}()"

    @functools.wraps(method)
    def bounded(*args: Any, **kwargs: Any) -> str:
        if is_map:
            if kwargs or len(args) != 1:
                raise TypeError("format_map() takes exactly one argument and no keyword arguments")
            args, kwargs = (), args[0]
        formatter = BoundedFormatter(env, limits, what, fmt.escape if isinstance(fmt, Markup) else None)
        result = formatter.vformat(fmt, args, kwargs)
        return Markup(result) if isinstance(fmt, Markup) and not isinstance(result, Marked) else result

    return bounded


def format_filter(env: Any, value: Any, *args: Any, **kwargs: Any) -> str:
    """Jinja's ``format`` filter (``value % args``, or ``% kwargs``), bounded by ``env.limits``."""
    if args and kwargs:
        raise TypeError("can't handle positional and keyword arguments at the same time")
    text = value if isinstance(value, str) else str(value)
    return printf(text, kwargs or args, env.limits, "the 'format' filter")
