"""Replicas of one pipeline across `width` (data parallel), or one pipeline; `shard="optimizer"`: ZeRO-1
over the replicas. engine.py (ownership, broadcast), settings.py (`shard`), lightning.py (the layers)."""
