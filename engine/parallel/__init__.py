"""Tensor parallelism: one engine over several devices (see ``shard.py`` for the split)."""
