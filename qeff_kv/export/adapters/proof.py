"""The export's proof with adapters (docs/lora.md): a graph exported with ``--lora`` is verified with each adapter
as it is verified without (:mod:`.verify`: the same probe, prompt in chunks then decode steps, logits within the
dtype's tolerance and the same greedy tokens), against the PyTorch model with that adapter applied unmerged
(:class:`~qeff_kv.export.modeling.lora.Routing`, the delta the graph traces); the graph runs with every adapter
of the export stacked, so each adapter is read from its own slot.

PyTorch's references are computed before tracing (:func:`references`), the graph's runs after it is written
(:func:`verify`), as for the base model; a streamed export (weights attached lazily) records why it was not proved.
"""

from __future__ import annotations

import numpy as np
import torch

from qeff_kv.contract import naming
from qeff_kv.contract.lora import LoraGeometry, LoraModule
from qeff_kv.errors import VerificationError
from qeff_kv.export import transformers_adapter as hf
from qeff_kv.export import verify as verify_mod
from qeff_kv.export.adapters.plan import LoraPlan
from qeff_kv.export.modeling import lora as lora_mod


def geometry_of(routing: lora_mod.Routing, plan: LoraPlan, dtype: str) -> LoraGeometry:
    """The graph's adapter inputs as the export writes them (the adapted modules, in graph order)."""
    return LoraGeometry(tuple(LoraModule(a.layer, a.module, a.in_features, a.out_features) for a in routing.adapted),
                        dtype, plan.max_rank, plan.names)


def check_fit(model, plan: LoraPlan | None, dtype: str, base_name: str) -> None:
    """Refuse (:class:`~qeff_kv.errors.AdapterError`, one line) an adapter of ``plan`` that does not fit ``model``
    before anything is traced or written, whether or not the export is verified: its modules and layers, its rank,
    its hidden sizes, and its ``base_model_name_or_path`` against ``base_name`` (the source the manifest records,
    compared by its last path component, as a Session compares it when it loads an adapter)."""
    if plan is None or not plan.adapters:
        return
    from qeff_kv.tools import adapters as adapters_mod

    hf.find_decoder(model)
    routing = lora_mod.Routing(lora_mod.find_modules(model, hf.decoder(model), plan.modules, plan.targets))
    geometry = geometry_of(routing, plan, dtype)
    for adapter in plan.adapters:
        adapters_mod.fit(adapter, geometry, base_name=base_name)


def references(model, plan: LoraPlan | None, probe, dtype: str) -> dict | None:
    """PyTorch's :class:`~qeff_kv.export.verify.Reference` on ``probe`` with each adapter of ``plan``, and the
    stacked adapter inputs the graph will be fed; ``None`` without adapters or without a probe."""
    if plan is None or not plan.adapters or probe is None:
        return None
    from qeff_kv.tools import adapters as adapters_mod

    hf.find_decoder(model)
    routing = lora_mod.Routing(lora_mod.find_modules(model, hf.decoder(model), plan.modules, plan.targets))
    geometry = geometry_of(routing, plan, dtype)
    arrays = adapters_mod.stack(list(plan.adapters), geometry)
    weights = []
    for m in geometry.modules:
        weights += [torch.from_numpy(arrays[m.a_name]), torch.from_numpy(arrays[m.b_name])]
    refs = {}
    for slot, adapter in enumerate(plan.adapters, start=1):
        ids = torch.tensor([slot], dtype=torch.int64)
        with routing.active(ids, torch.ones(1, dtype=weights[0].dtype), weights):
            refs[adapter.name] = verify_mod.reference_run(model, probe)
    return {"arrays": arrays, "references": refs}


def verify(onnx_path, options, probe, proof: dict | None, why_not: str | None, say) -> dict:
    """The graph on the probe with each adapter (its slot, scale 1) against PyTorch's; raises
    :class:`~qeff_kv.errors.VerificationError` on a mismatch. Returns the manifest's record."""
    if proof is None:
        return {"status": "skipped", "reason": why_not}
    results = {}
    for slot, (name, ref) in enumerate(proof["references"].items(), start=1):
        say(f"verifying adapter {name!r} against PyTorch with it applied")
        feeds = dict(proof["arrays"])
        dt = feeds[next(iter(feeds))].dtype
        feeds[naming.LORA_IDS_INPUT] = np.array([slot], np.int64)
        feeds[naming.LORA_SCALES_INPUT] = np.ones(1, dt)
        try:
            result = verify_mod.verify_graph(onnx_path, probe, ref, ctx_len=options.ctx_len, dtype=options.dtype,
                                             kv_batch=options.full_batch_size if options.continuous_batching else 1,
                                             ccl=options.ccl, extra_feeds=feeds)
        except VerificationError as exc:
            raise VerificationError(f"with adapter {name!r}: {exc}") from None
        results[name] = {"max_abs_diff": result.max_abs_diff, "tolerance": result.tolerance, "steps": result.steps}
    return {"status": "passed", "adapters": results}
