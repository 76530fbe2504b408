"""Sharded senders and receivers (issue 28): the trainer's FSDP2 / DTensor shards over N ranks land in
an engine's tensor-parallel shards over M ranks, as vLLM splits them, bit for bit per shard.

- `layout`: a tiny Llama-shaped model's parameters as the trainer holds them (Shard(0) / Replicate
  over N ranks) and as the engine holds them (column, row, replicated, vocab, fused qkv / gate_up,
  tied lm_head), each side from its own rules.
- `plan`: the static resharding plan computed once from both layouts: which rows (and columns) of
  which trainer shard land where in which engine shard; printable, JSON, bytes per rank vs minimum.
- `oracle`: what every engine shard must hold, cut from the full weights with torch's own splits,
  independently of the plan.
- `trainer_shards`: the trainer's shards built by torch's own FSDP2 (`fully_shard`) or DTensor APIs.
- `sync`: the plan executed over torch.distributed, point to point from the owning trainer rank.
- `world`: N trainer + M engine rank processes in one gloo world that runs jobs sent to it.
"""
