"""Constrained decoding: the output must match a regex or a JSON Schema (notebook 13).

The pipeline, one module per step::

    pattern --regex.parse--> tree --nfa.compile_nfa--> NFA over bytes --dfa--> minimal DFA
    JSON Schema --json_schema.schema_to_regex--> pattern   (constraint.ResponseFormat: the API's forms)
    DFA + tokenizer --index.token_index--> allowed tokens and next state, per DFA state
    per request: processor.GrammarState; per batch: processor.apply_grammar (logits -> -inf)

It sits between the tokenizer (it reads the vocabulary's bytes) and sampling (the sampler
masks the logits with it); it knows nothing of the model, the cache or the engine.
"""

from minillm.structured.constraint import ResponseFormat
from minillm.structured.dfa import DEAD, DFA, MAX_DFA_STATES, compile_regex, find_difference
from minillm.structured.index import TokenIndex, VocabTrie, token_index, vocab_trie
from minillm.structured.json_schema import SchemaError, json_object_regex, json_value_regex, schema_to_regex
from minillm.structured.nfa import MAX_NFA_STATES, NFA, pattern_to_nfa
from minillm.structured.processor import GrammarState, apply_grammar, grammar_mask
from minillm.structured.regex import GrammarTooLarge, RegexError, escape, parse

__all__ = [
    "DEAD",
    "DFA",
    "MAX_DFA_STATES",
    "MAX_NFA_STATES",
    "NFA",
    "GrammarState",
    "GrammarTooLarge",
    "RegexError",
    "ResponseFormat",
    "SchemaError",
    "TokenIndex",
    "VocabTrie",
    "apply_grammar",
    "compile_regex",
    "escape",
    "find_difference",
    "grammar_mask",
    "json_object_regex",
    "json_value_regex",
    "parse",
    "pattern_to_nfa",
    "schema_to_regex",
    "token_index",
    "vocab_trie",
]
