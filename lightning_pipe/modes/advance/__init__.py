"""AvgPipe's advance forward propagation (§4.2): Algorithm 1's rule raising advance_num between steps.

engine.py: the rule (no Lightning); settings.py: a fixed advance_num's checks; lightning.py: the
controller handing the rule to the runner. Its schedule is `schedules/advance.py`."""
