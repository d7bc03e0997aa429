"""The sandbox a chat template runs in: transformers' environment, with every way to build a
large value bounded (``template_limits``) and text from the messages kept marked (``user_text``).

transformers renders templates in Jinja's ``ImmutableSandboxedEnvironment`` with ``trim_blocks``
and ``lstrip_blocks``; so does this, and the same template gives the same string. The sandbox
keeps a template away from Python's internals, and Jinja lets it intercept everything a
template can do to a value. Each hook below checks the size of what it is about to build,
counts it against the render's budget, and marks it as user text when its input held any:

* binary operators ``+ * ** %`` (``call_binop``; ``%`` on a string is ``template_format``'s);
* ``~``, which Jinja compiles to a join the sandbox never sees: the code generator here
  compiles it to ``environment.concat_values`` instead;
* joining the output of a macro, a ``{% set %}`` block or a ``{% filter %}`` block
  (``environment.concat``), and printing a value (``finalize``);
* calls (methods of strings such as ``center`` or ``replace``, macros, globals), with
  ``str.format`` and ``format_map`` handed to ``template_format``;
* every filter (``template_filters``);
* subscripts and slices (``getitem``), ``namespace()`` attributes and ``lipsum()``.

Time is bounded by a deadline checked by a trace function on every line of Python that runs.
"""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from jinja2.compiler import CodeGenerator, Frame
from jinja2.nodes import Concat
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from minillm.tokenizer.template_filters import bounded_filters, bounded_list, join_checked, replace_size
from minillm.tokenizer.template_format import format_method, printf
from minillm.tokenizer.template_limits import Limits, TemplateError, held_size, text_size
from minillm.tokenizer.user_text import Marked, MixedText, UserText, holds_user_text, join_marked, mark_all, plain

# How many characters a string method can make of one of its receiver's ("ﬃ".upper() is "FFI").
_STR_GROWTH = {"upper": 3, "lower": 3, "title": 3, "capitalize": 3, "swapcase": 3, "casefold": 3, "encode": 10}
_SUBSTRING_METHODS = frozenset({"strip", "lstrip", "rstrip", "removeprefix", "removesuffix"})


class _CodeGenerator(CodeGenerator):
    """Jinja's code generator, but ``a ~ b`` calls ``environment.concat_values((a, b))``."""

    def visit_Concat(self, node: Concat, frame: Frame) -> None:
        self.write("environment.concat_values((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


def raise_exception(message: Any) -> NoReturn:
    raise TemplateError(f"chat template: {str(message)[:500]}")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox with every operation that can build a large value checked first."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self, limits: Limits) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, finalize=self._finalize)
        self.limits = limits
        self.concat = self._concat  # type: ignore[method-assign]
        self.globals["raise_exception"] = raise_exception
        self.globals["namespace"] = _bounded_namespace(limits)
        self.globals["lipsum"] = _bounded_lipsum(limits, self.globals["lipsum"])
        self.filters = dict(bounded_filters())

    # ------------------------------------------------------------------ operators and output
    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        limits, what = self.limits, f"the {operator!r} operator"
        if operator == "%" and isinstance(left, str):
            return limits.charge(printf(left, right, limits, what), what)
        cap = limits.max_chars
        if operator == "*":
            if isinstance(left, int) and isinstance(right, int):
                limits.check(held_size(left, cap) + held_size(right, cap), what)
            elif isinstance(right, int):
                limits.check(held_size(left, cap) * right, what)
            elif isinstance(left, int):
                limits.check(left * held_size(right, cap), what)
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            limits.check(right * max(held_size(left, cap), 1), what)
        elif operator == "+":
            limits.check(held_size(left, cap) + held_size(right, cap), what)
        result = super().call_binop(context, operator, left, right)
        if isinstance(result, str) and not isinstance(result, Marked) and holds_user_text((left, right)):
            result = mark_all(plain(result))  # Markup + user text: Markup's own + returns a plain Markup
        return limits.charge(limits.check_held(result, what), what)

    def concat_values(self, values: tuple[Any, ...]) -> str:
        """``a ~ b ~ c``: how long each value prints is checked, all together, before printing any."""
        what = "the '~' operator"
        self.limits.check(sum(text_size(value, self.limits.max_chars) for value in values), what)
        return self._join([self._printed(value, what) for value in values], what)

    def _concat(self, pieces: Any) -> str:
        """What Jinja joins the output of a macro, a block or a ``{% set %}`` block with."""
        return self._join(pieces, "joining a block's output")

    def _join(self, pieces: Any, what: str) -> str:
        collected, total = [], 0
        for piece in pieces:
            total += len(piece)
            self.limits.check(total, what)
            collected.append(piece)
        return self.limits.charge(join_marked(collected), what)

    def _finalize(self, value: Any) -> Any:
        """Every ``{{ value }}`` before Jinja calls ``str()`` on it."""
        return value if isinstance(value, str) else self._printed(value, "printing a value")

    def _printed(self, value: Any, what: str) -> str:
        """``str(value)``, its length checked first, marked if ``value`` held user text."""
        if isinstance(value, str):
            return value
        self.limits.check_text(value, what)
        text = str(value)
        return self.limits.charge(mark_all(plain(text)) if holds_user_text(value) else text, what)

    # ------------------------------------------------------------------ attribute access and calls
    def getitem(self, obj: Any, argument: Any) -> Any:
        result = super().getitem(obj, argument)
        if isinstance(argument, slice) and isinstance(result, (str, list, tuple)):
            self.limits.charge(result, "a slice")
        return result

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """``str.format`` / ``format_map``, bounded and marking (``template_format``)."""
        if (
            isinstance(value, (types.MethodType, types.BuiltinMethodType))
            and value.__name__ in ("format", "format_map")
            and isinstance(value.__self__, str)
        ):
            return format_method(self, value, self.limits)
        return None

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        limits = self.limits
        name = getattr(obj, "__name__", None) or getattr(obj, "name", None) or type(obj).__name__
        what = f"calling {name}()"
        for arg in [*args, *kwargs.values()]:  # a macro calling itself with s ~ s doubles s each time
            limits.check_held(arg, f"an argument of {what}")
        receiver = None if hasattr(obj, "__wrapped__") else getattr(obj, "__self__", None)
        is_text = isinstance(receiver, (str, bytes, bytearray))
        if isinstance(receiver, (str, bytes, bytearray, int, float, list, tuple, dict)):
            limits.check_numbers(args, kwargs, what)  # widths and counts: center(10**10), to_bytes(10**10)
        if is_text:
            if name == "join" and type(receiver) in (str, UserText, MixedText) and len(args) == 1 and not kwargs:
                return join_checked(receiver, args[0], limits, what)
            if name == "join" and args:
                args = (bounded_list(args[0], limits, what), *args[1:])
                limits.check(6 * (held_size(args[0], limits.max_chars) + len(receiver) * len(args[0])), what)
            limits.check(_method_size(receiver, name, args, kwargs, limits), what)
        result = super().call(context, obj, *args, **kwargs)
        if is_text and (holds_user_text(receiver) or holds_user_text((args, kwargs))):
            result = _mark_method_result(receiver, name, args, result)
        limits.check_held(result, what)
        return result if isinstance(obj, Macro) else limits.charge(result, what)  # a macro's output is charged


# ------------------------------------------------------------------------------ methods
def _method_size(receiver: str | bytes, name: str, args: tuple, kwargs: dict, limits: Limits) -> int:
    """How long the result of ``receiver.name(*args)`` can be (its length if it cannot grow)."""
    size = len(receiver)
    first = args[0] if args else next(iter(kwargs.values()), None)
    if name in ("center", "ljust", "rjust", "zfill") and isinstance(first, int):
        return max(size, first)
    if name == "expandtabs":
        tabsize = first if isinstance(first, int) else 8
        return size + receiver.count("\t" if isinstance(receiver, str) else b"\t") * max(tabsize, 0)
    if name == "replace" and len(args) >= 2:
        old, new = args[0], args[1]
        if isinstance(old, type(receiver[:0])) and isinstance(new, type(receiver[:0])):  # else a TypeError
            return replace_size(receiver, old, new, args[2] if len(args) > 2 else -1)
    if name == "translate" and isinstance(first, dict):
        widths = [len(v) if isinstance(v, (str, bytes)) else 1 for v in first.values()]
        return size * max([1, *widths])
    if name == "hex":
        return 3 * size
    return size * _STR_GROWTH.get(name, 1)


def _mark_method_result(receiver: str | bytes, name: str, args: tuple, result: Any) -> Any:
    """The result of a string method whose receiver or arguments held user text: exactly marked
    for the methods that return a piece of the receiver, wholly user text otherwise."""
    if isinstance(receiver, str) and name in _SUBSTRING_METHODS and isinstance(result, str):
        if name in ("strip", "lstrip"):
            start = len(receiver) - len(receiver.lstrip(*args))
        elif name == "removeprefix":
            start = len(receiver) - len(result)
        else:
            start = 0
        return receiver[start : start + len(result)]
    return mark_all(result)


def _bounded_namespace(limits: Limits) -> type[Namespace]:
    """``namespace()`` whose attributes may not outgrow the limits (``ns.s = ns.s ~ ns.s`` doubles)."""

    class BoundedNamespace(Namespace):
        def __setitem__(self, name: str, value: Any) -> None:
            limits.check_held(value, f"namespace attribute {name!r}")
            super().__setitem__(name, value)

    return BoundedNamespace


def _bounded_lipsum(limits: Limits, lipsum: Callable[..., Any]) -> Callable[..., Any]:
    """``lipsum(n, html, min, max)`` writes up to ``n * max`` words of up to 12 characters."""

    def bounded(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> Any:
        limits.check(abs(int(n)) * abs(int(max)) * 13, "lipsum()")
        return limits.charge(lipsum(n, html, min, max), "lipsum()")

    return bounded


# ------------------------------------------------------------------------------ time
class DeadlineExceeded(BaseException):
    """Raised inside the template's code when time is up. A BaseException, so that no
    ``except Exception`` in Jinja's runtime can swallow it and let the loop go on."""


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Abort Python code run inside the block once ``seconds`` have passed.

    Jinja compiles a template to Python functions, so a trace function (called by the
    interpreter at every line) can check the clock and raise. Each line does a bounded amount
    of work (the size limits see to that), so the deadline holds to within a few lines.
    Tracing applies to this thread only, and whatever tracer ran before (a debugger, coverage)
    is restored afterwards.
    """
    end = time.monotonic() + seconds

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > end:
            raise DeadlineExceeded
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)
