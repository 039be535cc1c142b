"""Profiling: what the planners need measured on the real device.

`blocks` (per-block forward / backward time, bytes, memory: the `Profile`), `sized` (the same at
several micro-batch sizes, for PipeDream-2BW's planner), `messages` (what a message costs the ranks
in training), `link` (the one link measurement: round trips halved), `saved` (bytes autograd saves).
"""

from .blocks import Profile, check_activation, profile_blocks
from .messages import MessageCosts, measure_messages

__all__ = ["MessageCosts", "Profile", "check_activation", "measure_messages", "profile_blocks"]
