"""Chat templates: how a conversation becomes the one string an instruct model was trained on.

Instruct models are fine-tuned on conversations laid out in one exact format; SmolLM2 uses
ChatML::

    <|im_start|>user
    What is the capital of France?<|im_end|>
    <|im_start|>assistant

The format ships with the model as a Jinja template (in GGUF metadata or
``tokenizer_config.json``). We render it the way transformers does: a sandboxed Jinja
environment with ``trim_blocks`` and ``lstrip_blocks``, so the same messages give the same ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from minillm.tokenizer.bpe import Tokenizer

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _raise_exception(message: str) -> NoReturn:
    raise ValueError(f"chat template: {message}")


def render_chat(tokenizer: Tokenizer, messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
    """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the tokenizer's template."""
    if isinstance(messages, (str, dict)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    for n, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(
            message.get("content"), str
        ):
            raise ValueError(f"message #{n} must be a dict with str 'role' and 'content', got {message!r}")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    try:
        template = env.from_string(tokenizer.chat_template or CHATML_TEMPLATE)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"the tokenizer's chat template does not parse: {err}") from None

    def name_of(token_id: int | None) -> str:
        return tokenizer.id_to_token(token_id) if token_id is not None else ""

    return template.render(
        messages=list(messages),
        add_generation_prompt=add_generation_prompt,
        bos_token=name_of(tokenizer.bos_id),
        eos_token=name_of(tokenizer.eos_id),
    )
