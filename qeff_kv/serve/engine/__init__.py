"""The local engine: the scheduler thread that owns the Session (scheduler.py) and its collaborators (its inbox,
prefill turns, choice groups, the decode step, slots, speculative steps), each returning outcomes the scheduler
applies, and the Engine interface the front end talks to."""
