"""The BPE trainer: hand-computed merges, the tie-break rule, vocabulary accounting, specials.

Byte ids used below: ' '=32, 'a'=97, 'b'=98, 'c'=99, 'd'=100, 'e'=101, 'h'=104, 'l'=108, 'o'=111.
"""

from __future__ import annotations

import pytest
import regex

from minillm import Tokenizer, train_bpe


def test_first_merges_by_hand():
    """'aaabdaaabac' is one chunk. Pair counts: aa 4, ab 2, bd 1, da 1, ba 1, ac 1.

    1. (a, a) -> 256, the most frequent.          word: [256 a b d 256 a b a c]
    2. (256, a) and (a, b) both occur twice: the tie goes to the smaller pair (97, 98) -> 257.
                                                    word: [256 257 d 256 257 a c]
    3. (256, 257) occurs twice -> 258.              word: [258 d 258 a c]
    """
    tok = train_bpe("aaabdaaabac", 259, progress=False)
    assert tok.merges == [(97, 97), (97, 98), (256, 257)]
    assert [tok.vocab[i] for i in (256, 257, 258)] == [b"aa", b"ab", b"aaab"]
    assert tok.encode("aaabdaaabac") == [258, 100, 258, 97, 99]


def test_training_continues_on_pairs_seen_once_until_the_word_is_one_token():
    """After the three merges above every pair occurs once; ties keep going to the smallest pair:
    (a, c), then (d, 258), then (258, 260), then (261, 259): the whole word is one token, and
    training stops early with 7 merges though 44 were allowed."""
    tok = train_bpe("aaabdaaabac", 300, progress=False)
    assert tok.merges == [(97, 97), (97, 98), (256, 257), (97, 99), (100, 258), (258, 260), (261, 259)]
    assert tok.vocab[262] == b"aaabdaaabac"
    assert tok.encode("aaabdaaabac") == [262]
    assert tok.vocab_size == 256 + 7


def test_tie_break_across_chunks_by_hand():
    """Chunks 'ab', ' ab', ' cd' (once each). (a, b) occurs twice -> 256; then every pair occurs
    once and the smallest wins each time: (32, 99) -> 257, (32, 256) -> 258, (257, 100) -> 259."""
    tok = train_bpe("ab ab cd", 300, progress=False)
    assert tok.merges == [(97, 98), (32, 99), (32, 256), (257, 100)]


def test_merges_never_cross_a_pretokenizer_boundary():
    """' ab' and ' ab' chunks: 'b' is never followed by ' ' inside a chunk, so no token has b'b '."""
    tok = train_bpe("ab ab ab ab", 300, progress=False)
    assert all(b"b " not in tok.vocab[i] for i in range(256, tok.vocab_size))


def test_vocab_size_accounting_256_plus_merges_plus_specials(corpus_text):
    specials = ["<|a|>", "<|b|>"]
    tok = train_bpe(corpus_text[:20_000], 300, specials, progress=False)
    assert len(tok.merges) == 300 - 256 - 2
    assert tok.vocab_size == len(tok) == 300
    assert len(tok.vocab) == 256 + len(tok.merges)


def test_special_tokens_get_the_ids_after_the_merges_in_order(trained):
    n = 256 + len(trained.merges)
    assert trained.special_tokens == {"<|endoftext|>": n, "<|im_start|>": n + 1, "<|im_end|>": n + 2}
    assert trained.vocab_size == n + 3 == 400


def test_special_tokens_are_never_merged_into():
    """The corpus is mostly '<|sep|>', yet no learned token holds any of its bytes: specials are cut
    out before counting. 'hello' x50: el, he... -> (e,l)=256, (h,256)=257, (l,o)=258, (257,258)=259."""
    tok = train_bpe("hello<|sep|>" * 50, 300, ["<|sep|>"], progress=False)
    assert tok.merges == [(101, 108), (104, 256), (108, 111), (257, 258)]
    assert tok.special_tokens == {"<|sep|>": 260}
    assert tok.encode("hello<|sep|>hello") == [259, 260, 259]
    assert all(tok.vocab[i] in b"hello" for i in range(256, 256 + len(tok.merges)))


def test_trained_tokens_respect_the_pretokenizer_on_a_real_corpus(trained):
    """No learned token joins a letter to a following space (GPT-2's pattern keeps the space in front)."""
    letter_then_space = regex.compile(rb"[A-Za-z] ")
    learned = [trained.vocab[i] for i in range(256, 256 + len(trained.merges))]
    assert [token for token in learned if letter_then_space.search(token)] == []


def test_training_is_deterministic(corpus_text):
    text = corpus_text[:30_000]
    first = train_bpe(text, 350, ["<|endoftext|>"], progress=False)
    second = train_bpe(text, 350, ["<|endoftext|>"], progress=False)
    assert first.merges == second.merges
    assert first.vocab == second.vocab
    assert first.special_tokens == second.special_tokens


def test_tokenizer_trained_with_no_merges_is_plain_bytes():
    tok = train_bpe("anything", 256, progress=False)
    assert tok.merges == []
    assert tok.encode("hé") == [104, 0xC3, 0xA9]


def test_vocab_size_too_small_names_the_sizes():
    with pytest.raises(ValueError, match=r"vocab_size=257") as err:
        train_bpe("abc", 257, ["<|a|>", "<|b|>"], progress=False)
    assert "256" in str(err.value) and "2 special" in str(err.value)


@pytest.mark.parametrize("corpus", [b"bytes corpus", ["a", "list"], None], ids=["bytes", "list", "None"])
def test_non_str_corpus_is_a_type_error(corpus):
    with pytest.raises(TypeError, match=r"str"):
        train_bpe(corpus, 300, progress=False)


def test_empty_special_token_is_rejected():
    with pytest.raises(ValueError, match=r"special tokens"):
        train_bpe("abc", 300, [""], progress=False)


def test_trained_tokenizer_is_a_tokenizer(trained):
    assert isinstance(trained, Tokenizer)
    assert trained.encode("<|im_start|>") == [trained.special_tokens["<|im_start|>"]]
