"""PipeDream-2BW: two weight versions, no flush, 1-stale updates.

engine.py: the runner (the version lag is its state; no Lightning); settings.py: its settings' and
the Trainer's checks; lightning.py: the optimizer step one Lightning step behind, made exact.
Its schedule is `schedules/two_bw.py`, its planner `planning/two_bw.py` (set up by `lightning/plan_2bw.py`)."""
