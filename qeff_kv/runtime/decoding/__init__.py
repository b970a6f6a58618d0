"""Decoding over a Session: token selection (sampling.py), the one budget and stop rule (stopping.py), the
generation loop (decode_loop.py), speculative decoding, prompt logprob rows, lock-step and row batching."""
