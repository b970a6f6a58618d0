"""Where a session's values live and what runs its graph: the device allocator (device.py), the executor
seam (executor.py), the session's binding (binding.py) and which execution provider is proved exact (ep_proofs.py)."""
