"""Embeddings from a decoder export with the ``hidden_states`` output (``qeff-kv export --hidden-states``).

:func:`embed` prefills a text into a new sequence (the plain prefill, its chunks and cache) and pools the graph's
``hidden_states`` output of the last chunk: the final (normed) hidden state of the text's **last token**
(last-token pooling, as vLLM pools decoder embedding models), L2-normalised (as OpenAI's and vLLM's embeddings
are). The output is bound for that prefill only (then every output is bound again as the session binds them), so
the graph's other runs, whatever their shapes, never write it.
:func:`pooled` does the last part of such a prefill (the serving engine feeds a long text in chunks between
other sequences' decode steps, the last chunk through it). :func:`unsupported` says why a session cannot.
"""

from __future__ import annotations

from typing import Sequence as Seq

import numpy as np

from qeff_kv.contract import naming
from qeff_kv.errors import RuntimeInputError


def unsupported(session) -> str | None:
    """Why ``session`` cannot embed, in one line; None when it can."""
    if naming.HIDDEN_STATES_OUTPUT not in {t.name for t in session.graph.layout.outputs}:
        return ("the graph has no hidden_states output; export it with --hidden-states for /v1/embeddings")
    if session.media is not None:
        return "embeddings are not computed on a vision-language graph"
    if not session.binding.can_rebind_outputs():
        return "embeddings need the onnxruntime executor"
    return None


def embed(session, seq, tokens: Seq[int]) -> np.ndarray:
    """Prefill ``tokens`` into the empty sequence ``seq`` and return the L2-normalised final hidden state of the
    last one, ``[hidden]`` (float32). The sequence keeps the prompt (the caller frees or keeps it)."""
    why = unsupported(session)
    if why is not None:
        raise RuntimeInputError(why)
    if session.cache.get(seq).length:
        raise RuntimeInputError("embed takes an empty sequence")
    return pooled(session, seq, tokens)


def pooled(session, seq, tokens: Seq[int], **prefill_kw) -> np.ndarray:
    """Prefill ``tokens`` (the last part of a text: what precedes them is already in ``seq``, fed by plain
    ``session.prefill`` calls, as the serving engine feeds a prompt in chunks) with the ``hidden_states`` output
    bound, and return the L2-normalised final hidden state of the last one, ``[hidden]`` float32. ``prefill_kw``:
    passed to ``session.prefill`` (a recurrent graph's checkpoints). The session must embed (:func:`unsupported`)."""
    name = naming.HIDDEN_STATES_OUTPUT
    session.binding.bind_out(name, None)   # to the CPU, for this prefill's chunks
    try:
        session.prefill(seq, tokens, **prefill_kw)
        out = session.binding.output(name)
    finally:
        # every output bound again as the session binds them, without hidden_states; the next step binds its logits
        session.binding.rebind_outputs()
    vec = np.asarray(out, dtype=np.float64).reshape(-1, out.shape[-1])[-1]   # one row: the last token's
    norm = np.linalg.norm(vec)
    return (vec / norm if norm > 0 else vec).astype(np.float32)
