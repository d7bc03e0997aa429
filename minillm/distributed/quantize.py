"""``weights="q8_0" | "q4_0" | "q4_1"`` under tensor parallelism: each rank quantizes its own slices.

A block format quantizes each row in blocks of 32 inputs, so quantizing a slice of whole rows
(a column-parallel layer) or of whole blocks of every row (a row-parallel one: the shard
splits there) gives exactly the blocks one process would give for those rows and columns.

What one process adds is calibration (``quant.quantize_model``): the model runs once in
float on a built-in text and each matrix keeps the input channels whose activations peaked
highest in float32 (``quantize_with_outliers``). Here the rank's float model runs that text
(a normal tensor-parallel forward); a column-parallel layer sees the full input, the same on
every rank, so every rank picks the same channels; a row-parallel layer sees only the rank's
slice of its input, so the ranks all-gather their peaks, pick the top channels of the whole
row, and each keeps those that fall in its slice. The peaks come from a forward whose sums
run in another order than one process's, so in a near tie a different channel can win:
the blocks then differ slightly from one process's (their error is of the same size).
"""

from __future__ import annotations

import torch

from minillm.distributed.group import Group
from minillm.distributed.layers import RowParallel, VocabParallelEmbedding, VocabParallelHead
from minillm.model.layers import Linear
from minillm.model.llama import Transformer
from minillm.model.quant import (
    BLOCK_SIZE,
    OUTLIER_COLUMNS,
    TABLE_FORMAT,
    QuantizedEmbedding,
    QuantizedLinear,
    quantize_with_outliers,
)


def quantize_shard(model: Transformer, fmt: str, calibration: torch.Tensor, group: Group,
                   outliers: int = OUTLIER_COLUMNS) -> Transformer:
    """Replace the rank's matrices by ``fmt`` blocks (the table and head by Q8_0), in place,
    keeping each matrix's ``outliers`` calibrated input channels in float32. Every rank calls
    it with the same ``calibration`` ids [1, n] (it runs a forward: collectives)."""
    layers = {name: module for name, module in model.named_modules()
              if type(module) is Linear and name.startswith("layers.")}
    row_parallel = {f"{name}.layer" for name, module in model.named_modules() if isinstance(module, RowParallel)}
    peaks: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0).float().cpu()
            peaks[name] = torch.maximum(peaks[name], x) if name in peaks else x
        return hook

    handles = [module.register_forward_pre_hook(record(name)) for name, module in layers.items()]
    try:
        with torch.inference_mode():
            model(calibration.to(model.device))
    finally:
        for handle in handles:
            handle.remove()
    for name, module in layers.items():
        cols = _outlier_columns(peaks[name], name in row_parallel, outliers, group)
        blocks = quantize_with_outliers(module.weight, fmt, f"{name}.weight", cols if cols.numel() else None)
        quantized = QuantizedLinear(fmt, **{k: v.to(model.device) for k, v in blocks.items()}, bias=module.bias)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, quantized)
    _quantize_vocab(model)
    return model


def _outlier_columns(peak: torch.Tensor, row_parallel: bool, k: int, group: Group) -> torch.Tensor:
    """The rank's local indices of the ``k`` input channels that peaked highest over the whole row."""
    if not row_parallel:
        return peak.topk(min(k, peak.numel() // BLOCK_SIZE)).indices.sort().values
    sizes = group.all_gather(torch.tensor([[peak.numel()]]), [1] * group.world_size)[0].tolist()
    whole = group.all_gather(peak[None], sizes)[0]
    start = sum(sizes[: group.rank])
    top = whole.topk(min(k, whole.numel() // BLOCK_SIZE)).indices.sort().values
    return top[(top >= start) & (top < start + peak.numel())] - start


def _quantize_vocab(model: Transformer) -> None:
    """The rank's rows of the table (and of an untied head) as Q8_0 blocks, whole (no outliers)."""
    table: VocabParallelEmbedding = model.embed_tokens
    head: VocabParallelHead = model.lm_head
    tied = head.layer.weight.data_ptr() == table.table.weight.data_ptr()
    packed = QuantizedLinear(TABLE_FORMAT, **quantize_with_outliers(table.table.weight, TABLE_FORMAT, "embed_tokens"))
    table.table = QuantizedEmbedding(packed.to(model.device), model.dtype)
    head.layer = packed if tied else QuantizedLinear.from_float(head.layer.weight, TABLE_FORMAT, name="lm_head")
