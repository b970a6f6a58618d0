"""The local engine: the scheduler thread that owns the Session (scheduler.py) and its collaborators (prefill
turns, choice groups, the decode step, slots, speculative steps), and the Engine interface the front end talks to."""
