"""The token index: from a DFA over bytes to the tokens allowed in each state (notebook 13, step 3).

At every step the sampler needs the set of tokens whose bytes keep the output a viable prefix
of the pattern, and for the token it picks, the state the DFA is in afterwards. Walking each of
the 49,152 tokens of SmolLM2 byte by byte through the DFA is 330,000 table lookups per state:
too slow in Python, and wasteful, because tokens share prefixes (``Ġthe``, ``Ġthere``,
``Ġtheir`` all start with ``Ġthe``).

So the vocabulary is stored once as a **trie** whose nodes are numbered level by level (all
nodes of depth 1, then depth 2, ...), with each node's byte and its parent. Walking the whole
trie from a DFA state is then one vectorized gather per level::

    state[nodes of depth d] = table[state[their parents], byte_class[their bytes]]

each shared prefix is walked once, and a level where every node is dead ends the walk. A token's
state is the state of its node; it is allowed when that state is not ``DEAD`` (the DFA is
trimmed, so not dead means "can still be completed"). About a millisecond per DFA state for
SmolLM2, so states are explored **lazily**, the first time a generation reaches them, and
cached (``TokenIndex.next_states``).

Special tokens (``<|im_start|>``, ...) never match the pattern: their text is not what they
mean. The end-of-sequence ids are allowed exactly in accepting states, and they keep the state
where it is (the request ends there).

``token_index(pattern, tokenizer)`` caches whole indexes in an LRU keyed by the pattern and a
fingerprint of the tokenizer's vocabulary, so every request with the same schema shares one.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from minillm.structured.dfa import DEAD, DFA, compile_regex

if TYPE_CHECKING:
    from minillm.tokenizer import Tokenizer

MAX_CACHED_STATES = 1024  # explored DFA states kept per index (an evicted one is re-walked if needed)
MAX_CACHED_INDEXES = 16


@dataclass(frozen=True, eq=False)
class VocabTrie:
    """The byte strings of a vocabulary's matchable tokens, as a level-ordered trie.

    Node 0 is the root (the empty prefix); nodes ``levels[d-1]:levels[d]`` have depth ``d``,
    each with its last byte ``byte[k]`` and its parent ``parent[k]``.
    """

    byte: np.ndarray  # uint8 [n_nodes] (0 for the root)
    parent: np.ndarray  # int64 [n_nodes] (0 for the root)
    levels: tuple[int, ...]  # levels[d] = the first node of depth d + 1
    token_ids: np.ndarray  # int64 [n_tokens]: the matchable tokens ...
    token_node: np.ndarray  # int64 [n_tokens]: ... and their nodes
    vocab_size: int
    fingerprint: str

    @classmethod
    def build(cls, tokens: dict[int, bytes], vocab_size: int) -> VocabTrie:
        """``tokens``: id -> bytes, only the ones that may match (no special tokens)."""
        tokens = {i: data for i, data in tokens.items() if data}
        digest = hashlib.sha256(str(vocab_size).encode())
        for i in sorted(tokens):
            digest.update(b"%d:%d:" % (i, len(tokens[i])) + tokens[i])
        node_of: dict[bytes, int] = {b"": 0}
        byte, parent, levels = [0], [0], [1]
        depth_max = max((len(d) for d in tokens.values()), default=0)
        for depth in range(1, depth_max + 1):
            for prefix in sorted({data[:depth] for data in tokens.values() if len(data) >= depth}):
                node_of[prefix] = len(byte)
                byte.append(prefix[-1])
                parent.append(node_of[prefix[:-1]])
            levels.append(len(byte))
        ids = np.array(sorted(tokens), dtype=np.int64)
        return cls(np.array(byte, dtype=np.uint8), np.array(parent, dtype=np.int64), tuple(levels), ids,
                   np.array([node_of[tokens[i]] for i in ids.tolist()], dtype=np.int64), vocab_size,
                   digest.hexdigest())

    @property
    def n_nodes(self) -> int:
        return len(self.byte)

    def walk(self, dfa: DFA, state: int, node_class: np.ndarray | None = None) -> np.ndarray:
        """The DFA state at every trie node, starting from ``state`` at the root: int32 [n_nodes]."""
        node_class = dfa.byte_class[self.byte] if node_class is None else node_class
        n_classes = dfa.table.shape[1]
        flat = dfa.table.reshape(-1)
        states = np.zeros(self.n_nodes, dtype=np.int64)
        states[0] = state
        for lo, hi in zip(self.levels[:-1], self.levels[1:]):
            level = flat[states[self.parent[lo:hi]] * n_classes + node_class[lo:hi]]
            states[lo:hi] = level
            if not level.any():  # every prefix of this length is dead: so are the longer ones
                break
        return states


_TRIES: weakref.WeakKeyDictionary[Tokenizer, VocabTrie] = weakref.WeakKeyDictionary()


def vocab_trie(tokenizer: Tokenizer) -> VocabTrie:
    """The trie of ``tokenizer``'s ordinary tokens (special ones left out), built once per tokenizer."""
    trie = _TRIES.get(tokenizer)
    if trie is None:
        special = set(tokenizer.special_tokens.values())
        tokens = {i: data for i, data in tokenizer.vocab.items() if i not in special}
        trie = _TRIES[tokenizer] = VocabTrie.build(tokens, tokenizer.vocab_size)
    return trie


class TokenIndex:
    """The allowed tokens and next states of one DFA over one vocabulary, explored lazily.

    ``next_states(state)`` is an array over the whole vocabulary: the state after each token,
    ``DEAD`` (0) for a token that is not allowed. ``allowed(state)`` is its boolean mask.
    """

    def __init__(self, dfa: DFA, trie: VocabTrie, eos_ids: Iterable[int]) -> None:
        self.dfa, self.trie = dfa, trie
        eos = {int(i) for i in eos_ids if i is not None}
        if bad := [i for i in eos if not 0 <= i < trie.vocab_size]:
            raise ValueError(f"eos id {bad[0]} is outside the vocabulary (0..{trie.vocab_size - 1})")
        self.eos_ids = np.array(sorted(eos), dtype=np.int64)
        self.eos_set = frozenset(eos)
        self._node_class = dfa.byte_class[trie.byte]
        self._eos_in_trie = np.isin(trie.token_ids, self.eos_ids)  # (an eos id that is an ordinary token)
        self._dtype = np.int16 if dfa.n_states < 2**15 else np.int32
        # state -> (the state after each token, the allowed mask): both read every step, so both kept
        self._cache: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self.explored = 0  # how many times a state was walked (a cache miss)

    @property
    def start(self) -> int:
        return self.dfa.start

    @property
    def vocab_size(self) -> int:
        return self.trie.vocab_size

    def is_accepting(self, state: int) -> bool:
        return bool(self.dfa.accepting[state])

    def next_states(self, state: int) -> np.ndarray:
        """The state after each token id from ``state`` (``DEAD`` where the token is not allowed)."""
        return self._explored(state)[0]

    def allowed(self, state: int) -> np.ndarray:
        """Boolean mask [vocab_size] of the tokens allowed in ``state`` (read-only)."""
        return self._explored(state)[1]

    def _explored(self, state: int) -> tuple[np.ndarray, np.ndarray]:
        found = self._cache.get(state)
        if found is not None:
            self._cache.move_to_end(state)
            return found
        out = np.zeros(self.trie.vocab_size, dtype=self._dtype)
        if state != DEAD:
            nodes = self.trie.walk(self.dfa, state, self._node_class)
            ends = nodes[self.trie.token_node]
            ends[self._eos_in_trie] = DEAD
            out[self.trie.token_ids] = ends
            if self.dfa.accepting[state]:
                out[self.eos_ids] = state
        allowed = out != DEAD
        out.flags.writeable = allowed.flags.writeable = False
        self.explored += 1
        self._cache[state] = (out, allowed)
        if len(self._cache) > MAX_CACHED_STATES:
            self._cache.popitem(last=False)
        return out, allowed

    def allowed_ids(self, state: int) -> np.ndarray:
        return np.flatnonzero(self.next_states(state))

    def next_state(self, state: int, token_id: int) -> int:
        """The state after ``token_id``; ``DEAD`` if it is not allowed."""
        if not 0 <= token_id < self.trie.vocab_size:
            return DEAD
        return int(self.next_states(state)[token_id])

    def explore_all(self) -> int:
        """Explore every state reachable from the start through tokens (what an eager index
        builds up front); returns how many there are."""
        seen, todo = {self.start}, [self.start]
        while todo:
            for nxt in np.unique(self.next_states(todo.pop())).tolist():
                if nxt != DEAD and nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return len(seen)


_INDEXES: OrderedDict[tuple, TokenIndex] = OrderedDict()
_INDEXES_LOCK = threading.Lock()  # the server compiles in a request thread, the engine reads in its own


def token_index(pattern: str, tokenizer: Tokenizer, eos_ids: Iterable[int] | None = None) -> TokenIndex:
    """The (cached) index of ``pattern`` over ``tokenizer``'s vocabulary.

    ``eos_ids`` are the ids that end generation (default: the tokenizer's eos id); they are
    allowed exactly where the output so far is a whole match.
    """
    trie = vocab_trie(tokenizer)
    if eos_ids is None:
        eos_ids = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    eos = tuple(sorted({int(i) for i in eos_ids if i is not None}))
    key = (pattern, trie.fingerprint, eos)
    with _INDEXES_LOCK:
        index = _INDEXES.get(key)
        if index is not None:
            _INDEXES.move_to_end(key)
            return index
    index = TokenIndex(compile_regex(pattern), trie, eos)  # (outside the lock: it may take a second)
    with _INDEXES_LOCK:
        index = _INDEXES.setdefault(key, index)
        while len(_INDEXES) > MAX_CACHED_INDEXES:
            _INDEXES.popitem(last=False)
    return index
