"""Chat templates: how a conversation becomes the one string an instruct model was trained on.

Instruct models are fine-tuned on conversations laid out in one exact format; SmolLM2 uses
ChatML::

    <|im_start|>user
    What is the capital of France?<|im_end|>
    <|im_start|>assistant

The format ships with the model as a Jinja template (in GGUF metadata or
``tokenizer_config.json``). We render it the way transformers does: a sandboxed Jinja
environment with ``trim_blocks`` and ``lstrip_blocks``, so the same messages give the same string.

Two dangers come with it, and this module handles both:

* **Turn forgery.** transformers renders the template to a string and then tokenizes that
  string with special tokens parsed. A message whose text contains
  ``<|im_end|>\\n<|im_start|>system\\n...`` then becomes a real system turn. ``encode_chat``
  keeps track of which text came from the messages and encodes only the template's own markers
  as special tokens.
* **Hostile templates.** The template is code that comes with the model file. The sandbox stops
  it from touching Python internals, but not from looping 10^10 times or building a 10 GB
  string. Rendering therefore runs under a deadline, and every string, list or number the
  template builds is capped in size (``_Limits``).
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import CodeType
from typing import Any, NoReturn, Protocol

import jinja2
import regex
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# What one render may use. Real templates render in a millisecond and produce a little more than
# the text of the messages; the limits grow with the input so that long conversations still fit.
_BASE_SECONDS = 1.0
_SECONDS_PER_INPUT_CHAR = 1e-6
_BASE_MAX_CHARS = 1 << 20
_MAX_CHARS_PER_INPUT_CHAR = 8

# A special-token string inside message text is replaced, before rendering, by
# _ESCAPE + <its index in Tokenizer.special_tokens> + _ESCAPE, and a literal _ESCAPE character by
# _ESCAPE + _ESCAPE, so the replacement is reversible whatever the text holds. _ESCAPE is a
# private-use character: no template operation (trim, upper, split on spaces) changes it.
_ESCAPE = "\U000f0000"
_ESCAPED = regex.compile(f"{_ESCAPE}([0-9]*){_ESCAPE}")

# The width and precision part of a printf-style conversion (``%-10.3f``) and of a str.format
# field (``{0:>10}``).
_PERCENT_SPEC = regex.compile(r"%[#0 +\-]*([0-9]*(?:\.[0-9]*)?)")
_BRACE_SPEC = regex.compile(r"\{[^{}:]*:([^{}]*)\}")


class ChatTokenizer(Protocol):
    """What rendering a chat needs from a tokenizer (``Tokenizer`` has all of it)."""

    special_tokens: dict[str, int]
    chat_template: str | None
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]: ...

    def id_to_token(self, token_id: int) -> str: ...

    def _split_special(self, text: str) -> Iterator[tuple[str, int | None]]: ...

    def _special_spans(self, text: str) -> Iterator[tuple[int, int]]: ...


class _TemplateError(ValueError):
    """A chat template that does not parse, refuses the messages, or goes past a limit."""


def _raise_exception(message: str) -> NoReturn:
    raise _TemplateError(f"chat template: {message}")


def render_chat(tokenizer: ChatTokenizer, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> str:
    """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the tokenizer's template.

    The string equals transformers' ``apply_chat_template(..., tokenize=False)``. It is for
    showing: ``tokenizer.encode(render_chat(...))`` parses special-token strings that a message
    smuggled in, so get ids from ``encode_chat`` instead.
    """
    _check_messages(messages)
    return _render(tokenizer, list(messages), add_generation_prompt)


def encode_chat(tokenizer: ChatTokenizer, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
    """The ids of the rendered conversation, with special tokens taken only from the template.

    Every string in the messages is escaped (special-token strings replaced by a reversible
    private-use marker) before rendering. In the rendered text, each special-token string is
    then the template's own and becomes its id; the text between them is un-escaped and encoded
    with ``parse_special=False``, so a ``<|im_end|>`` typed by a user stays the characters
    ``<``, ``|``, ``im``... For messages without special-token strings the ids are exactly
    transformers'.
    """
    _check_messages(messages)
    specials = list(tokenizer.special_tokens)
    index = {content: n for n, content in enumerate(specials)}
    escaped = [_escape(message, tokenizer, index) for message in messages]
    rendered = _render(tokenizer, escaped, add_generation_prompt)
    ids: list[int] = []
    for piece, special_id in tokenizer._split_special(rendered):
        if special_id is None:
            ids.extend(tokenizer.encode(_unescape(piece, specials), parse_special=False))
        else:
            ids.append(special_id)
    return ids


def _check_messages(messages: Any) -> None:
    if isinstance(messages, (str, dict)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    for n, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(
            message.get("content"), str
        ):
            raise ValueError(f"message #{n} must be a dict with str 'role' and 'content', got {message!r}")


def _escape(value: Any, tokenizer: ChatTokenizer, index: dict[str, int]) -> Any:
    """``value`` with every str inside it (dict values, list items) escaped, recursively.

    ``index`` numbers the special tokens; the marker of one is its number between two _ESCAPEs.
    """
    if isinstance(value, str):
        value = value.replace(_ESCAPE, _ESCAPE * 2)
        pieces = []
        start = 0
        for begin, end in tokenizer._special_spans(value):
            pieces += [value[start:begin], _ESCAPE, str(index[value[begin:end]]), _ESCAPE]
            start = end
        return "".join(pieces) + value[start:]
    if isinstance(value, dict):
        return {key: _escape(item, tokenizer, index) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_escape(item, tokenizer, index) for item in value]
    return value


def _unescape(text: str, specials: list[str]) -> str:
    if _ESCAPE not in text:
        return text
    return _ESCAPED.sub(lambda m: specials[int(m.group(1))] if m.group(1) else _ESCAPE, text)


# ------------------------------------------------------------------------------ bounded rendering
def _render(tokenizer: ChatTokenizer, messages: list[Any], add_generation_prompt: bool) -> str:
    """Compile and render the template within ``_Limits``; every failure is a ValueError."""
    source = tokenizer.chat_template or CHATML_TEMPLATE
    limits = _Limits(len(source) + sum(_text_size(message) for message in messages))
    env = _BoundedEnvironment(limits)

    def name_of(token_id: int | None) -> str:
        return tokenizer.id_to_token(token_id) if token_id is not None else ""

    pieces: list[str] = []
    try:
        with _deadline(limits.seconds):
            try:
                template = env.template_class.from_code(env, _compile(source), env.make_globals(None))
            except jinja2.TemplateSyntaxError as err:
                raise _TemplateError(f"the tokenizer's chat template does not parse: {err}") from None
            rendered = 0
            for piece in template.generate(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=name_of(tokenizer.bos_id),
                eos_token=name_of(tokenizer.eos_id),
            ):
                rendered += len(piece)
                limits.check(rendered, "the rendered conversation")
                pieces.append(piece)
    except _DeadlineExceeded:
        raise _TemplateError(
            f"chat template: rendering {len(messages)} messages took longer than {limits.seconds:.1f} s "
            "(the template, which comes with the model, loops or recurses too much)"
        ) from None
    except _TemplateError:
        raise
    except RecursionError:
        raise _TemplateError("chat template: recursion too deep (a macro or loop that calls itself forever)") from None
    except Exception as err:  # noqa: BLE001 (the template is model-supplied code: any failure is bad input)
        raise _TemplateError(f"chat template failed: {type(err).__name__}: {err}") from None
    return "".join(pieces)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> CodeType:
    """The Python code Jinja compiles ``source`` to. Compiling takes milliseconds and rendering
    microseconds, so each template is compiled once; the code runs in any environment."""
    return _BoundedEnvironment(_Limits(len(source))).compile(source)


def _text_size(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_size(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_text_size(item) for item in value)
    return 0


class _Limits:
    """The time and the size of values one render may use, scaled to the size of its input."""

    def __init__(self, input_chars: int) -> None:
        self.seconds = _BASE_SECONDS + _SECONDS_PER_INPUT_CHAR * input_chars
        self.max_chars = _BASE_MAX_CHARS + _MAX_CHARS_PER_INPUT_CHAR * input_chars

    def check(self, size: int, what: str) -> None:
        """Refuse ``what`` if it would hold more than ``max_chars`` characters (items, bytes)."""
        if size > self.max_chars:
            raise _TemplateError(
                f"chat template: {what} would hold {size} characters or items, more than the limit of "
                f"{self.max_chars} for this conversation"
            )

    def check_value(self, value: Any, what: str) -> Any:
        self.check(_size(value), what)
        return value

    def check_numbers(self, args: Sequence[Any], kwargs: dict[str, Any], what: str) -> None:
        """An int argument is a width, count or length: refuse one beyond the size limit."""
        for arg in [*args, *kwargs.values()]:
            if isinstance(arg, int) and not isinstance(arg, bool):
                self.check(abs(arg), f"{what} with argument {arg}")

    def check_format(self, fmt: Any, what: str) -> None:
        """A format string's widths and precisions (``%9999999d``, ``{:>9999999}``) are sizes too."""
        if not isinstance(fmt, str):
            return
        specs = [*_PERCENT_SPEC.findall(fmt), *_BRACE_SPEC.findall(fmt)]
        for digits in regex.findall(r"[0-9]+", " ".join(specs)):
            width = int(digits) if len(digits) <= 12 else 10**12  # Python refuses int() of 4300+ digits
            self.check(width, f"{what} with width {digits[:20]}")


def _size(value: Any) -> int:
    """What the size limit compares: length of a str or container, bytes of an int."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length() // 8
    try:
        return len(value)
    except TypeError:
        return 0


def _replace_size(s: str, old: str, new: str, count: Any) -> int:
    """Length of ``s.replace(old, new, count)``, computed without building it."""
    occurrences = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        occurrences = min(occurrences, count)
    return len(s) + occurrences * (len(new) - len(old))


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox (immutable, ``trim_blocks``, ``lstrip_blocks``, ``raise_exception``)
    with every operation that can build a large value checked against ``_Limits``.

    The checks sit where the sandbox lets us intercept: binary operators (``+``, ``*``, ``**``,
    ``%``), calls (macros and their arguments, methods such as ``str.replace``), filters, and
    namespace attributes. Those are the only ways a value can outgrow the template: ``~`` and
    slicing only copy what exists, and a value can grow step by step only across loop
    iterations (through a namespace) or recursive macro calls (through their arguments).
    """

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self, limits: _Limits) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True)
        self.limits = limits
        self.globals["raise_exception"] = _raise_exception
        self.globals["namespace"] = _bounded_namespace(limits)
        self.filters = {name: _bounded_filter(name, func, limits) for name, func in self.filters.items()}

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        limits = self.limits
        what = f"the {operator!r} operator"
        if operator == "*":
            if isinstance(left, int) and isinstance(right, int):
                limits.check(_size(left) + _size(right), what)
            elif isinstance(right, int):
                limits.check(_size(left) * right, what)
            elif isinstance(left, int):
                limits.check(left * _size(right), what)
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            limits.check(right * max(_size(left), 1), what)
        elif operator == "+":
            limits.check(_size(left) + _size(right), what)
        elif operator == "%" and isinstance(left, str):
            limits.check_format(left, what)
            if "*" in left:  # '%*d' takes its width from the arguments
                limits.check_numbers(right if isinstance(right, tuple) else (right,), {}, what)
        return limits.check_value(super().call_binop(context, operator, left, right), what)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        limits = self.limits
        name = getattr(obj, "__name__", None) or getattr(obj, "name", None) or type(obj).__name__
        what = f"calling {name}()"
        for arg in [*args, *kwargs.values()]:  # a macro calling itself with s ~ s doubles s each time
            limits.check_value(arg, f"an argument of {what}")
        # The sandbox hands str.format out wrapped (``__wrapped__``) in its own safe formatter.
        receiver = getattr(getattr(obj, "__wrapped__", obj), "__self__", None)
        if isinstance(receiver, str):  # str methods take widths and counts: center(10**10)
            limits.check_numbers(args, kwargs, what)
            if name in ("format", "format_map"):
                limits.check_format(receiver, what)
            elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
                limits.check(_replace_size(receiver, args[0], args[1], args[2] if len(args) > 2 else -1), what)
            elif name == "join" and args:
                limits.check(len(receiver) * _size(args[0]), what)
            elif name == "expandtabs":
                limits.check(len(receiver) * (args[0] if args else kwargs.get("tabsize", 8)), what)
        return limits.check_value(super().call(context, obj, *args, **kwargs), what)


# Filters whose int arguments are widths or counts (``center(10**10)``, ``batch(10**10, 'x')``).
_FILTERS_WITH_SIZE_ARGUMENTS = frozenset({"batch", "center", "indent", "slice", "tojson", "truncate", "wordwrap"})


def _bounded_filter(name: str, func: Callable[..., Any], limits: _Limits) -> Callable[..., Any]:
    """``func`` with its size arguments checked before it runs and its result after."""
    # Filters marked @pass_context / @pass_eval_context / @pass_environment get that first.
    value_at = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0
    what = f"the {name!r} filter"

    @functools.wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        value, rest = args[value_at] if len(args) > value_at else None, args[value_at + 1 :]
        if name in _FILTERS_WITH_SIZE_ARGUMENTS:
            limits.check_numbers(rest, kwargs, what)
        if name == "replace" and len(rest) >= 2 and isinstance(value, str):
            limits.check(_replace_size(value, str(rest[0]), str(rest[1]), rest[2] if len(rest) > 2 else -1), what)
        elif name == "indent" and isinstance(value, str):
            width = rest[0] if rest else kwargs.get("width", 4)  # a number of spaces, or a str
            width_chars = width if isinstance(width, int) else _size(width)
            limits.check(len(value) + (value.count("\n") + 1) * width_chars, what)
        elif name == "join":
            separator = rest[0] if rest else kwargs.get("d", "")
            limits.check(_size(separator) * _size(value), what)
        elif name == "format":
            limits.check_format(value, what)
        return limits.check_value(func(*args, **kwargs), what)

    return bounded


def _bounded_namespace(limits: _Limits) -> type[Namespace]:
    """``namespace()`` whose attributes may not outgrow the limits (``ns.s = ns.s ~ ns.s`` doubles)."""

    class BoundedNamespace(Namespace):
        def __setitem__(self, name: str, value: Any) -> None:
            limits.check_value(value, f"namespace attribute {name!r}")
            super().__setitem__(name, value)

    return BoundedNamespace


class _DeadlineExceeded(BaseException):
    """Raised inside the template's code when time is up. A BaseException, so that no
    ``except Exception`` in Jinja's runtime can swallow it and let the loop go on."""


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
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
            raise _DeadlineExceeded
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)
