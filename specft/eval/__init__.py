"""`specft eval`: speculative decoding measured the way a serving engine runs it."""

from specft.eval.runner import run_eval

__all__ = ["run_eval"]
