"""Tensor-parallel inference over ``torch.distributed`` (notebook 15). See ``shard`` first."""
