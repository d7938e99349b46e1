"""The device memory KV blocks and resident adapters share (S-LoRA's unified paging).

``budget.py`` sizes it (set, or to the machine); ``plan.py`` lays it out once, before
anything is allocated (blocks, scratch, the adapter cap and reserve, KV's floor, the draft
model's share, the context limit); ``arena.py`` holds the tensors (each layer's keys and
values, cut also into adapter rank-rows); ``kv_cache.py`` decides which blocks are whose.
Which rows are whose is the adapter pool's business (``engine/lora/pool.py``).
"""
