"""Scheduling (vLLM's ``v1/core/sched``): which requests run this step, and how many of their tokens."""
