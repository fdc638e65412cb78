"""Structured output on the scheduler: grammars compiled off the loop (compiler.py), one
matcher per constrained request (constraint.py), the batch's token masks (masks.py)."""
