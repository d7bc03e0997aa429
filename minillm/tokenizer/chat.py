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
  ``<|im_end|>\\n<|im_start|>system\\n...`` then becomes a real system turn; so does one holding
  ``<|IM_END|>`` when the template lowercases content, or ``[im_end|>`` when it replaces ``[``
  by ``<|``. ``encode_chat`` takes special tokens only from the template's own text: every
  string from the messages enters the template as user text (``user_text``), which the sandbox
  keeps marked through everything the template does to it, and a special-token string in the
  rendered prompt becomes its id only where no character of it came from the messages.
* **Hostile templates.** The template is code that comes with the model. The sandbox stops
  it from touching Python internals, but not from looping 10^10 times or building a 10 GB
  string. Rendering therefore runs under a deadline, and everything the template builds is
  checked against size limits before it is built (``template_sandbox``, ``template_limits``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from types import CodeType
from typing import Any, Protocol

import jinja2

from minillm.tokenizer.checks import short
from minillm.tokenizer.template_limits import Limits, TemplateError
from minillm.tokenizer.template_sandbox import BoundedEnvironment, DeadlineExceeded, deadline
from minillm.tokenizer.user_text import Spans, join_marked, mark_user, plain, spans_of

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


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


def render_chat(tokenizer: ChatTokenizer, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> str:
    """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the tokenizer's template.

    The string equals transformers' ``apply_chat_template(..., tokenize=False)``. It is for
    showing: ``tokenizer.encode(render_chat(...))`` parses special-token strings that a message
    smuggled in, so get ids from ``encode_chat`` instead.
    """
    _check_messages(messages)
    return _render(tokenizer, messages, add_generation_prompt)[0]


def encode_chat(tokenizer: ChatTokenizer, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
    """The ids of the rendered conversation, with special tokens taken only from the template.

    Why marks and not sentinels (placeholders swapped in for the messages and back out):
    templates look at content (``message.content.split('</think>')``, ``|trim``, ``|length``),
    so a placeholder renders a different prompt, and a template that transforms it (``|lower``,
    ``|reverse``) leaves nothing to swap back. Marked text is the message text itself, so the
    template renders exactly what transformers renders, and the marks say which characters
    came from the messages whatever the template did (``user_text``).

    A special-token string in the rendered prompt becomes its id only inside a stretch of
    template text; the text between two such ids is encoded with ``parse_special=False``, as
    one piece, so for messages without special-token strings the ids are exactly
    transformers'. A ``<|im_end|>`` typed by a user, or made from user text by the template,
    stays the characters ``<``, ``|``, ``im``...
    """
    _check_messages(messages)
    text, spans = _render(tokenizer, messages, add_generation_prompt)
    ids: list[int] = []
    pending: list[str] = []  # text since the last special id

    def flush() -> None:
        if pending:
            ids.extend(tokenizer.encode("".join(pending), parse_special=False))
            pending.clear()

    for start, end, from_user in _stretches(len(text), spans):
        if from_user:
            pending.append(text[start:end])
            continue
        for piece, special_id in tokenizer._split_special(text[start:end]):
            if special_id is None:
                pending.append(piece)
            else:
                flush()
                ids.append(special_id)
    flush()
    return ids


def _stretches(length: int, spans: Spans) -> Iterator[tuple[int, int, bool]]:
    """(start, end, from the messages?) for consecutive stretches covering ``0..length``."""
    position = 0
    for k in range(0, len(spans), 2):
        if spans[k] > position:
            yield position, spans[k], False
        yield spans[k], spans[k + 1], True
        position = spans[k + 1]
    if position < length:
        yield position, length, False


def _check_messages(messages: Any) -> None:
    if isinstance(messages, (str, dict)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    for n, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(
            message.get("content"), str
        ):
            raise ValueError(f"message #{n} must be a dict with str 'role' and 'content', got {message!r}")


# ------------------------------------------------------------------------------ bounded rendering
def _render(tokenizer: ChatTokenizer, messages: Sequence[Any], add_generation_prompt: bool) -> tuple[str, Spans]:
    """The rendered prompt and where in it the messages' text is; every failure is a ValueError."""
    source = tokenizer.chat_template or CHATML_TEMPLATE
    marked = mark_user(list(messages))
    limits = Limits(len(source) + _text_length(marked))
    env = BoundedEnvironment(limits)

    def name_of(token_id: int | None) -> str:
        return tokenizer.id_to_token(token_id) if token_id is not None else ""

    pieces: list[str] = []
    try:
        with deadline(limits.seconds):
            try:
                template = env.template_class.from_code(env, _compile(source), env.make_globals(None))
            except jinja2.TemplateSyntaxError as err:
                raise TemplateError(f"the tokenizer's chat template does not parse: {err}") from None
            rendered = 0
            for piece in template.generate(
                messages=marked,
                add_generation_prompt=add_generation_prompt,
                bos_token=name_of(tokenizer.bos_id),
                eos_token=name_of(tokenizer.eos_id),
            ):
                rendered += len(piece)
                limits.check(rendered, "the rendered conversation")
                pieces.append(piece)
    except DeadlineExceeded:
        raise TemplateError(
            f"chat template: rendering {len(messages)} messages took longer than {limits.seconds:.1f} s "
            "(the template, which comes with the model, loops or recurses too much)"
        ) from None
    except TemplateError:
        raise
    except RecursionError:
        raise TemplateError("chat template: recursion too deep (a macro or loop that calls itself forever)") from None
    except MemoryError:
        raise TemplateError("chat template: ran out of memory while rendering") from None
    except Exception as err:  # noqa: BLE001 (the template is model-supplied code: any failure is bad input)
        raise TemplateError(f"chat template failed: {type(err).__name__}: {short(str(err), 300)}") from None
    text = join_marked(pieces)
    return plain(text), spans_of(text)


def _text_length(value: Any) -> int:
    """Characters of text in the messages (``mark_user`` has checked how deeply they nest)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_length(key) + _text_length(item) for key, item in value.items())
    if isinstance(value, list):
        return sum(map(_text_length, value))
    return 0


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> CodeType:
    """The Python code Jinja compiles ``source`` to. Compiling takes milliseconds and rendering
    microseconds, so each template is compiled once; the code runs in any environment."""
    return BoundedEnvironment(Limits(len(source))).compile(source)
