"""Option types shared by the commands: integers are range-checked while the command line is parsed, so an
absurd value (negative, zero, beyond 64 bits, beyond what any buffer can hold) is a one-line usage error."""

from __future__ import annotations

import click

from qeff_kv.compile_config import PRECISIONS
from qeff_kv.limits import MAX_DIM, MAX_INT64

#: ctx_len, prefill_seq_len, batch sizes, slots: 1 .. 2**31-1.
DIM = click.IntRange(min=1, max=MAX_DIM)
#: --sliding-window: the window W of a graph's ring buffers (axis 'sliding_window'): 1 .. 2**31-1.
SLIDING_WINDOW = DIM
#: counts that may be zero (max_new_tokens, top_k): 0 .. 2**31-1.
COUNT = click.IntRange(min=0, max=MAX_DIM)
#: token ids and seeds: 0 .. 2**63-1.
ID = click.IntRange(min=0, max=MAX_INT64)
#: onnxruntime intra-op threads.
THREADS = click.IntRange(min=1, max=4096)
PRECISION = click.Choice(list(PRECISIONS))
