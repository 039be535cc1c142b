"""Flush: one weight version; the pipeline fills and drains inside every step (every synchronous schedule).

engine.py: the runner of a step's action list (no Lightning); lightning.py: its layer in Lightning."""
