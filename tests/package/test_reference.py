"""minillm.reference loads transformers' model without progress bars.

In a notebook a tqdm bar is a widget, and its state stays in the saved notebook's metadata with
no output that shows it; so the reference loads quietly, and leaves transformers' own progress-bar
switch as it found it.
"""

from __future__ import annotations

import pytest


def test_the_reference_model_loads_without_a_progress_bar(capfd):
    pytest.importorskip("transformers")
    import transformers.modeling_gguf_pytorch_utils as gguf_loader
    from transformers.utils import logging

    from minillm.reference import hf_causal_lm

    converter_bar = gguf_loader.tqdm
    assert logging.is_progress_bar_enabled()
    model = hf_causal_lm()  # a fresh load of the default GGUF file
    assert model.config.vocab_size > 0
    assert "Converting" not in capfd.readouterr().err  # the GGUF converter's bar
    assert logging.is_progress_bar_enabled() and gguf_loader.tqdm is converter_bar  # switched back on
