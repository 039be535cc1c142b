"""Replicas of one pipeline across `width` (data parallel), or one pipeline: lightning.py."""
