"""Tensor-parallel inference over ``torch.distributed`` (notebook 15).

One model, cut across ``world_size`` processes ("ranks"): each holds a slice of every matrix
and of the vocabulary, and the ranks add up their pieces with two all-reduces per layer.
Read in this order:

* ``shard``: the layout — which heads (whole GQA groups), feed-forward channels and vocabulary
  rows each rank holds, and the error when a world size cannot split (plain Python);
* ``group``: the run's ranks and the collectives, whose failures name the rank that stopped;
* ``layers``: a rank's model — a normal ``Transformer`` of its shard, plus ``RowParallel``
  (o_proj, down_proj: one all-reduce each), ``VocabParallelEmbedding`` and ``VocabParallelHead``
  (an all-gather of the logits, so every rank holds them all);
* ``loader``: ``load_tensor_parallel`` — each rank reads only its slices (``get_slice`` on the
  safetensors cache; block slices of the GGUF for ``weights="native"``); ``quantize`` for
  ``weights="q8_0"`` and friends;
* ``step``: rank 0 plans, the others follow — ``TensorParallelBackend`` broadcasts each
  ``PagedStep`` before running it, ``serve_steps`` is a worker rank's whole loop;
* ``launch``: ``run_ranks`` starts the ranks as processes of this machine (``torchrun`` works too).

How the engine uses it (nothing here imports the engine): the scheduler, block manager and
sampler run on rank 0 only, unchanged. Rank 0 loads its shard with ``load_tensor_parallel``,
builds its cache as ``step.TensorParallelKVCache`` (copy-on-write copies reach every rank)
with the shard's ``local_config`` (its KV heads only), and wraps the backend it would pick in
``step.TensorParallelBackend`` — ``eager`` for now: ``packed-cpu`` runs a whole step in C++ and
refuses these models, and ``compiled`` would need the collectives traced. Every other rank
loads its shard, builds a plain ``PagedKVCache`` of the same blocks, and runs
``step.serve_steps`` until rank 0's backend ``stop()``s. Rank 0 samples from the gathered
logits; the others' logits are dropped.
"""
