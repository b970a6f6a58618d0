"""The family matrix: every family of tests/helpers/families.py on every target, exact or refused up front.

For each (family, target) cell of ``families.EXPECT``:

* ``exact``: the export (streamed from the checkpoint, verified at export against PyTorch) gives transformers'
  greedy tokens on two prompts unlike the tracing input, its logits after the first prefill chunk are within
  tolerance of transformers', and ``qeff-kv check`` passes every rule (in-place safety included);
* ``refused: MSG``: export raises an :class:`ExportError` whose one-line message starts with ``MSG``, before
  anything is written.

Each tiny model is built once per session and each (family, target) exported once.
"""

from __future__ import annotations

import numpy as np
import pytest

from suite import requires_torch
from families import CHUNK, CTX, EXPECT, FAMILIES, NEW, PROMPTS, TARGETS

pytestmark = [requires_torch]

CELLS = [(name, t) for name in FAMILIES for t in TARGETS]


@pytest.mark.parametrize("name,target", CELLS, ids=[f"{n}-{t}" for n, t in CELLS])
def test_family_cell(name, target, family_exports, family_refs):
    from hf_models import PlainLoop
    from qeff_kv.tools.check import check
    from qeff_kv.errors import ExportError

    expected = EXPECT[name][target]
    result = family_exports(name, target)
    if expected.startswith("refused: "):
        assert isinstance(result, ExportError), f"expected a refusal, got {result!r}"
        msg = str(result)
        assert msg.startswith(expected[len("refused: "):]), msg
        assert "\n" not in msg
        out = family_exports.root / f"{name}-{target}"
        assert not (out / "manifest.json").exists()
        return
    if isinstance(result, BaseException):
        raise result
    assert result.manifest["verification"]["status"] == "passed"
    notes = family_exports.notes[(name, target)]   # streamed from the checkpoint: no family loads whole (issue 51)
    assert any("without its weights (they stream from the checkpoint" in n for n in notes), notes
    assert not any("loading the whole model" in n for n in notes), notes
    refs = family_refs(name)
    got = [PlainLoop(result.onnx_path, CTX).greedy(p, NEW, CHUNK) for p in PROMPTS]
    assert got == refs
    assert len(set(refs[0])) > 1 or len(set(refs[1])) > 1, "greedy tokens do not vary: the parity proves little"
    report = check(result.onnx_path)
    assert report.ok, report.format_text()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_first_chunk_logits(name, family_exports, family_models):
    """Logits after the first prefill chunk within tolerance of transformers' (the portable graph)."""
    import torch

    from hf_models import PlainLoop, load_causal_lm

    target = next((t for t in TARGETS if EXPECT[name][t] == "exact"), None)
    if target is None:
        pytest.skip(f"{name} is refused on every target")
    result = family_exports(name, target)
    prompt = PROMPTS[0][:CHUNK]
    got = PlainLoop(result.onnx_path, CTX).prefill(prompt, CHUNK)[0, -1].astype(np.float64)
    model = load_causal_lm(family_models(name))
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0, -1].double().numpy()
    tol = 1e-3 * max(1.0, float(np.abs(want).max()))
    assert float(np.abs(got - want).max()) <= tol
