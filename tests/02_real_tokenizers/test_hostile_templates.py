"""Chat templates that try to build gigabytes (issue 32, class 2).

A chat template is code from the model file (``tokenizer_config.json``, or a GGUF's
``tokenizer.chat_template``, which ``Engine.chat`` renders). Python builds a formatted or
repeated string in one C call, so a limit that looks at results, or a deadline, comes too late:
``'%(a)5000000000s' % {'a': 'x'}`` took 4.7 GB before any check ran. Every operation that can
grow a value computes its result's size from its arguments first. Each case below must fail
within 2 s, with under 200 MB allocated, and with an error that names the limit it hit: "output
larger than N characters" for one value, "more than N MB" for all the values built in a render,
never a misleading timeout.
"""

from __future__ import annotations

import re

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from minillm import Tokenizer
from minillm.tokenizer import bpe, template_limits

from helpers.tokenizer_files import cheaply, fails_cheaply

BIG = "{% set big = 'x' * 900000 %}"  # just under the smallest limit (1 MB and a bit)
HOSTILE = {
    # printf-style formatting: a mapping key, *, precision, many fields, the format filter
    "percent with a mapping key": "{{ '%(a)5000000000s' % {'a': 'x'} }}",
    "percent width": "{{ '%-2000000000s' % 'x' }}",
    "percent precision": "{{ '%.2000000000f' % 1.0 }}",
    "percent star width": "{{ '%*s' % (2000000000, 'x') }}",
    "percent zero padding": "{{ '%0999999999d' % 1 }}",
    "percent of many fields": BIG + "{{ '%s%s%s%s' % (big, big, big, big) }}",
    "percent of a repeated key": BIG + "{{ ('%(a)s' * 100) % {'a': big} }}",
    "format filter with a key": "{{ '%(a)2000000000s'|format(a='x') }}",
    "format filter positional": "{{ '%2000000000s'|format('x') }}",
    "format filter of many fields": BIG + "{{ ('%s' * 10)|format(big, big, big, big, big, big, big, big, big, big) }}",
    "markup percent": "{{ ('%2000000000s'|safe) % 'x' }}",
    # str.format: nested fields, keywords, precision, repeated fields, format_map, Markup
    "format with a nested width": "{{ '{:{}}'.format('x', '>2000000000') }}",
    "format with a keyword width": "{{ '{:>{w}}'.format('x', w=2000000000) }}",
    "format with split nested fields": "{{ '{0:{1}{2}}'.format('x', '>', 2000000000) }}",
    "format precision": "{{ '{:.2000000000f}'.format(1.0) }}",
    "format of a repeated field": BIG + "{{ ('{0}' * 100).format(big) }}",
    "format_map width": "{{ '{a:>2000000000}'.format_map({'a': 'x'}) }}",
    "format repr of a shared list": BIG + "{{ '{}'.format([big, big]) }}",
    "format repr of control characters": "{{ '{!r}'.format('\\x00' * 500000) }}",
    "markup format": "{{ ('{:>2000000000}'|safe).format('x') }}",
    # concatenation and repetition
    "tilde doubling": "{% set a = 'xy' %}" + "{% set a = a ~ a %}" * 31 + "{{ a|length }}",
    "plus doubling": "{% set a = 'xy' %}" + "{% set a = a + a %}" * 31 + "{{ a|length }}",
    "namespace doubling": (
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"
    ),
    "macro argument doubling": (
        "{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% else %}{{ s }}{% endif %}{% endmacro %}{{ d('ab', 60) }}"
    ),
    "one long tilde chain": BIG + "{{ big ~ big ~ big ~ big ~ big }}",
    "string times huge": "{{ 'a' * 10**10 }}",
    "list of a big string repeated": BIG + "{{ ([big] * 1000)|length }}",
    "list literal printed": BIG + "{% set l = [big, big, big, big, big] %}{{ l }}",
    "list literal joined": BIG + "{% set l = [big, big, big, big, big] %}{{ l|join }}",
    "list literal in tilde": BIG + "{% set l = [big, big, big, big, big] %}{{ l ~ '' }}",
    "list literal as string": BIG + "{% set l = [big, big, big, big, big] %}{{ l|string }}",
    "list literal to json": BIG + "{% set l = [big, big, big, big, big] %}{{ l|tojson }}",
    "list doubled sixty times": "{% set a = 'x' %}" + "{% set a = [a, a] %}" * 60 + "{{ a }}",
    # width, count and growth filters and methods
    "center filter": "{{ 'x'|center(10**10) }}",
    "center method": "{{ 'x'.center(10**10) }}",
    "ljust method": "{{ 'x'.ljust(10**9, 'y') }}",
    "zfill method": "{{ 'x'.zfill(10**10) }}",
    "expandtabs": "{{ ('\t' * 1000).expandtabs(100000) }}",
    "replace method": "{{ ('a' * 5000).replace('', 'b' * 5000) }}",
    "replace filter": "{{ ('a' * 1000)|replace('a', 'b' * 10000) }}",
    "replace method by a message": "{{ ('a' * 1000).replace('a', messages[0].content) }}",
    "a list of a string's characters": "{{ ('\u4e00' * 900000)|list|length }}",
    "indent filter": "{{ ('a\n' * 100000)|indent(1000) }}",
    "indent by a string": "{{ ('a\n' * 100000)|indent('x' * 1000) }}",
    "wordwrap with a long wrapstring": "{{ ('a ' * 100000)|wordwrap(1, wrapstring='x' * 1000) }}",
    "upper of ligatures": "{{ ('\ufb03' * 500000)|upper }}",
    "translate": "{{ ('a' * 1000).translate({97: 'x' * 10000}) }}",
    "join filter": "{{ range(99999)|join('x' * 100000) }}",
    "join method": "{{ ('x' * 100000).join(range(99999)|map('string')) }}",
    "tojson indent": "{{ messages|tojson(indent=10**9) }}",
    "tojson of nested lists": "{{ ([[[['x']]]] * 10000)|tojson(indent=100) }}",
    "batch fill": "{{ range(3)|batch(10**10, 'x')|list|length }}",
    "batch with a long fill": "{{ range(3)|batch(500000, 'x' * 1000)|list|length }}",
    "slice with a long fill": "{{ range(3)|slice(500000, 'x' * 1000)|list|length }}",
    "map center collected": "{{ range(100000)|map('center', 1000)|list|length }}",
    "map center joined": "{{ range(100000)|map('center', 1000)|join }}",
    "lipsum": "{{ lipsum(10**6) }}",
    "int to bytes": "{{ (1).to_bytes(10**10, 'big') }}",
    "encode times huge": "{{ 'x'.encode() * 10**10 }}",
    # many values, each within the limit
    "many sets of a megabyte": "".join(f"{{% set a{k} = 'x' * 900000 ~ {k} %}}" for k in range(300)),
    "a macro buffering fresh megabytes": (
        "{% macro f() %}{% for i in range(100000) %}{{ 'x' * 900000 ~ i }}{% endfor %}{% endmacro %}{{ f()|length }}"
    ),
    "a filter block of a repeated megabyte": BIG + "{% filter upper %}{% for i in range(100000) %}{{ big }}{% endfor %}{% endfilter %}",
    "a set block of a repeated megabyte": BIG + "{% set x %}{% for i in range(100000) %}{{ big }}{% endfor %}{% endset %}",
    "huge output": "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
}
LIMIT_NAMED = re.compile(r"output larger than \d+ characters|more than \d+ MB")


def tokenizer_with(trained, template: str) -> Tokenizer:
    return bpe.Tokenizer(trained.vocab, trained.merges, trained.special_tokens, chat_template=template)


@pytest.fixture()
def no_deadline(monkeypatch):
    """The sandbox's time limit far away, so a busy machine cannot make it fire first: these
    tests are about the size limits (or about ordinary output), not about the clock."""
    monkeypatch.setattr(template_limits, "_BASE_SECONDS", 120.0)


@pytest.mark.parametrize("template", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_template_building_gigabytes_fails_fast_naming_the_limit(trained, template, no_deadline):
    tok = tokenizer_with(trained, template)
    messages = [{"role": "user", "content": "x" * 3000}]
    message = fails_cheaply(lambda: tok.apply_chat_template(messages), ValueError, "chat template")
    assert LIMIT_NAMED.search(message), message


@pytest.mark.parametrize("name", ["percent with a mapping key", "format with a nested width", "tilde doubling"])
def test_the_rendered_string_is_refused_the_same_way(trained, name):
    tok = tokenizer_with(trained, HOSTILE[name])
    message = fails_cheaply(lambda: tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False))
    assert LIMIT_NAMED.search(message), message


def test_a_gguf_files_own_template_is_bounded_too(tmp_path):
    """``Engine.chat`` renders the template a GGUF file carries; it reaches the same sandbox."""
    import gguf

    from minillm.tokenizer.bytes_unicode import bytes_to_unicode

    path = tmp_path / "hostile.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([bytes_to_unicode()[b] for b in range(256)] + ["ab", "<|im_end|>"])
    writer.add_token_types([1] * 257 + [3])
    writer.add_token_merges(["a b"])
    writer.add_chat_template(HOSTILE["percent with a mapping key"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tok = Tokenizer.from_file(path)
    message = fails_cheaply(lambda: tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    assert LIMIT_NAMED.search(message), message


# --------------------------------------------------------------------------- what must still render
# Ordinary operations, some right under the limits: the bounded sandbox renders each exactly as
# Jinja's own sandbox does (transformers' environment).
ORDINARY = {
    "percent fields": "{{ '%s at %d, %5.2f%% %r|%-4s|%c' % ('x', 1700000000, 3.14159, 'q', 'ab', 65) }}",
    "percent with keys": "{{ '%(a)s and %(b)08.3f' % {'a': messages[0]['role'], 'b': 2.5} }}",
    "format fields": "{{ 'year {0}: {1:>5} {2:,} {3:.3e} {4!r:^12} {x:_<6}'.format(2024, 'ok', 10**9, 1/3, 'q', x=7) }}",
    "format with nested fields": "{{ '{0:{1}{2}}|{v:.{p}f}'.format('x', '>', 8, v=3.14159, p=2) }}",
    "format filter": "{{ '%s-%s'|format(1, 2) }}{{ '%(a)s'|format(a=3) }}",
    "width under the limit": "{{ ('{:>1000000}'.format('x'))|length }} {{ ('%1000000s' % 'x')|length }}",
    "doubling under the limit": "{% set a = 'x' %}" + "{% set a = a ~ a %}" * 19 + "{{ a|length }}",
    "joins and maps": "{{ messages|map(attribute='role')|join(', ') }} {{ (range(5)|list)|join(',') }} {{ 'ab'|list }}",
    "methods": "{{ ' A b '.strip().lower().center(9, '*') }}{{ 'a,b'.split(',') }}{{ 'x'.zfill(5) }}",
    "filters": "{{ 'ab cd'|title }}{{ 'x'|center(7) }}{{ 'a\nb'|indent(2, true) }}{{ 'a b c'|wordwrap(3) }}",
    "json": "{{ messages|tojson }}{{ {'a': [1, 2]}|tojson(indent=2) }}",
    "namespace": "{% set ns = namespace(s='') %}{% for m in messages %}{% set ns.s = ns.s ~ m.content %}{% endfor %}{{ ns.s }}",
    "macros and blocks": "{% macro f(x) %}<{{ x }}>{% endmacro %}{% set b %}{{ f(1) }}{% endset %}{{ b * 2 }}"
                         "{% filter upper %}{{ f('q') }}{% endfilter %}",
    "slices and loops": "{% for c in messages[0].content[::-1] %}{{ loop.index }}{{ c }}{% endfor %}",
    "printed values": "{{ [1, 'a', none, true, 2.5] }}{{ {'k': messages[0].role} }}{{ (1, 2) }}{{ messages[0].items()|list }}",
    "big numbers": "{{ 1700000000|string }}{{ 2 ** 64 }}{{ 10 ** 30 * 3 }}",
    "a long split": "{{ ('ab,' * 200000).split(',')|length }} {{ ('a b ' * 100000)|wordcount }}",
}


@pytest.mark.parametrize("template", ORDINARY.values(), ids=ORDINARY.keys())
def test_ordinary_templates_render_as_jinjas_own_sandbox_renders_them(trained, template, no_deadline):
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    expected = env.from_string(template).render(messages=messages, add_generation_prompt=True, bos_token="",
                                                 eos_token="")  # fmt: skip
    tok = tokenizer_with(trained, template)
    assert cheaply(lambda: tok.apply_chat_template(messages, tokenize=False)) == expected


def test_a_long_conversation_fits_its_larger_limits(trained):
    """Limits grow with the input: 8x its size for one value, and far more in all, so a
    template that accumulates every message (quadratic in the number of messages) still fits
    for a hundred messages of a thousand characters."""
    template = (
        "{% set ns = namespace(s='') %}{% for m in messages %}{% set ns.s = ns.s ~ m.content ~ '\n' %}"
        "{{ '<|im_start|>' + m.role + '\n' + m.content|trim + '<|im_end|>\n' }}{% endfor %}{{ ns.s|length }}"
    )
    messages = [{"role": "user", "content": f"message {k} " + "y" * 1000} for k in range(100)]
    tok = tokenizer_with(trained, template)
    text = cheaply(lambda: tok.apply_chat_template(messages, tokenize=False))
    assert text.endswith(str(sum(len(m["content"]) + 1 for m in messages)))


def test_the_deadline_still_stops_what_builds_nothing(trained):
    tok = tokenizer_with(trained, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    fails_cheaply(lambda: tok.apply_chat_template([{"role": "user", "content": "hi"}]), ValueError, "took longer than")


def test_a_syntax_error_is_still_a_clear_error(trained):
    with pytest.raises(ValueError, match=r"does not parse"):
        tokenizer_with(trained, "{% for %}").apply_chat_template([{"role": "user", "content": "hi"}])
    assert jinja2.__version__  # the sandbox relies on Jinja's code generator and filter table
