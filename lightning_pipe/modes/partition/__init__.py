"""Partition control: a static cut (re-partitioned by hand), or AutoPipe-RL's adaptive re-partitioning.

settings.py: the adaptive settings' checks; lightning.py: the partition layers. The decisions and the
transfers are `lightning_pipe/adaptive/` (no Lightning); a live switch on a rank is
`lightning/adaptive.py` and `lightning/fine_switch.py`."""
