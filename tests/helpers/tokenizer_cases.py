"""Texts and hypothesis strategies shared by the tokenizer tests."""

from __future__ import annotations

from hypothesis import strategies as st


def hf_ids(hf_tokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    """Raw ids from an HF ``tokenizers.Tokenizer`` (no BOS/EOS unless asked)."""
    return hf_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


def hf_chat_ids(hf, messages, add_generation_prompt: bool) -> list[int]:
    """transformers' chat-template ids; v5 may return a BatchEncoding where v4 returned a list."""
    out = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


# One text that packs every awkward case in.
EDGE_TEXT = (
    "Hello,   world!  \t\tTabs\tand  spaces   \n"
    "Windows line\r\nend\r\n\r\n  indented\n\n\n"
    "Digits: 0 7 42 1234567890 3.14159 1,000,000 ٣٤٥ ①②\n"
    "Contractions: I'm you're we've they'll she'd it's DON'T I'M WE'LL can't O'Neil\n"
    "CJK: 苹果手机很好用 日本語のテキスト 한국어\n"
    "Emoji: 👋🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🦀😀\n"
    "Combining: e\u0301 a\u0308 n\u0303\u0301 Z\u0335\u0321\n"
    "Controls: \x00 \x01 a\x00b \x1f \x7f \x1b[0m\n"
    "Spaces: a\u00a0b c\u2003d e\u3000f g\u2009h i\u200bj k\u2028l m\u2029n o\u0085p\n"
    "Specials: <|im_start|>user\nhi<|im_end|>\n<|endoftext|>"
    "<|im_start|><|im_end|> <|im_end|> x<|endoftext|>y\n"
    "Broken: <|im_start| <|im_end <im_start|> <|endoftext |> <||> <| |>\n"
    "   trailing spaces   "
)

# Pieces that stress the special-token splitter and the pre-tokenizer when mixed into text.
SPECIAL_PIECES = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|im_start|", "<|endoftext|", "<|", "|>",
    " ", "  ", "\n", "\r\n", "\t", "'s", "'S", "\u00a0", "123", "e\u0301", "👨‍👩‍👧‍👦",
]  # fmt: skip

text_with_specials = st.lists(st.one_of(st.text(), st.sampled_from(SPECIAL_PIECES)), max_size=8).map("".join)
any_text = st.one_of(st.text(), text_with_specials)

# Text whose UTF-8 never uses a byte SmolLM2 lacks: no 0x04/0x06/0x13/0x14/0x16/0x1d controls,
# and no characters U+40000..U+BFFFF (lead bytes 0xF1, 0xF2). 0xC0, 0xC1, 0xF5..0xFF never occur
# in valid UTF-8 anyway.
SMOL_MISSING_CONTROLS = "\x04\x06\x13\x14\x16\x1d"
smol_safe_char = st.one_of(
    st.characters(codec="utf-8", max_codepoint=0x3FFFF, exclude_characters=SMOL_MISSING_CONTROLS),
    st.characters(codec="utf-8", min_codepoint=0xC0000),
)
smol_safe_text = st.one_of(
    st.text(smol_safe_char),
    st.lists(st.one_of(st.text(smol_safe_char), st.sampled_from(SPECIAL_PIECES[:7])), max_size=8).map("".join),
)
