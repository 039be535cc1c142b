"""The user's model -> pipeline blocks, with no rewrite (see pipeline.py and trace.py)."""

from .find import FrontendError, candidate_lists, find_blocks
from .pipeline import TracedPipeline, attach_user_names
from .trace import convert, restore, trace

__all__ = ["FrontendError", "TracedPipeline", "attach_user_names", "candidate_lists", "convert", "find_blocks", "restore", "trace"]
