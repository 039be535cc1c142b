"""AvgPipe: N parallel pipelines joined by elastic averaging against reference processes.

engine.py: the elastic pull (no Lightning); settings.py: the pipelines', the pull's and the tuner's
checks; lightning.py: the replicas layer (the optimizer step wrapped, checkpoints of every pipeline).
Its reference processes are `runtime/elastic.py`; its advance forward is the `advance` mode."""
