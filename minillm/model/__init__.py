"""Stage 2 of the pipeline: ids -> logits with a Llama-family transformer (notebooks 03-06)."""

from minillm.model.config import ModelConfig
from minillm.model.llama import Transformer
from minillm.model.loading import load_model
from minillm.model.validate import validate

__all__ = ["ModelConfig", "Transformer", "load_model", "validate"]
