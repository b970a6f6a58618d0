"""Runtime sidecars beside a retained-state, shared-buffer past/present or static-cache graph: ``genai_config.json`` and ``inference_metadata.yaml``.

* :func:`write_sidecars` writes both for a graph (from its layout and :class:`SidecarFacts`), atomically; a file the
  format cannot describe truthfully is not written (:func:`reasons` says why).
* :func:`read_declared` reads what a folder's sidecar declares (``inference_metadata.yaml`` in either form, else
  ``genai_config.json``) and checks it against the graph's input and output names.
* :func:`carry_over` keeps a folder's sidecars in step with a rewritten graph (new KV prefix, new file name).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import onnx_ir as ir
import yaml

from qeff_kv.contract import naming
from qeff_kv.contract.layout import KVLayout
from qeff_kv.errors import SidecarError
from qeff_kv.graph import graphio
from qeff_kv.graph.sidecars import genai_config, inference_metadata, workflow
from qeff_kv.graph.sidecars.declared import (GENAI_CONFIG_FILE, INFERENCE_METADATA_FILE, SIDECAR_FILES, Declared,
                                             DeclaredPair, SidecarFacts, check_against)
from qeff_kv.support import fsutil

__all__ = ["GENAI_CONFIG_FILE", "INFERENCE_METADATA_FILE", "SIDECAR_FILES", "Declared", "DeclaredPair",
           "SidecarFacts", "SidecarError", "write_sidecars", "read_declared", "reasons", "carry_over", "layout_beside",
           "sidecar_issues"]


def _layout(model_or_layout) -> KVLayout:
    if isinstance(model_or_layout, KVLayout):
        return model_or_layout
    if isinstance(model_or_layout, ir.Model):
        return graphio.layout_of(model_or_layout)
    return graphio.layout_of(graphio.load(model_or_layout))


def reasons(model_or_layout) -> dict[str, str]:
    """File name -> why it is not written for this graph (empty: both are)."""
    layout = _layout(model_or_layout)
    out = {GENAI_CONFIG_FILE: genai_config.unsupported_reason(layout),
           INFERENCE_METADATA_FILE: workflow.unsupported_reason(layout)}
    return {k: v for k, v in out.items() if v is not None}


def yaml_text(layout: KVLayout, facts: SidecarFacts) -> str:
    return workflow.header(layout, facts) + yaml.safe_dump(workflow.build(layout, facts), sort_keys=False)


def write_sidecars(model_or_layout, folder: str | os.PathLike, facts: SidecarFacts) -> list[Path]:
    """Write the sidecars that can describe the graph into ``folder``; return the paths written."""
    layout = _layout(model_or_layout).require_valid()
    folder = Path(folder)
    skip = reasons(layout)
    written = []
    if GENAI_CONFIG_FILE not in skip:
        fsutil.write_json(folder / GENAI_CONFIG_FILE, genai_config.build(layout, facts))
        written.append(folder / GENAI_CONFIG_FILE)
    if INFERENCE_METADATA_FILE not in skip:
        fsutil.write_text(folder / INFERENCE_METADATA_FILE, yaml_text(layout, facts))
        written.append(folder / INFERENCE_METADATA_FILE)
    return written


def read_declared(folder: str | os.PathLike, inputs: Iterable, outputs: Iterable) -> Declared | None:
    """What the sidecar in ``folder`` declares, checked against the graph's ``inputs``/``outputs`` (names or
    TensorInfo); ``inference_metadata.yaml`` first, else ``genai_config.json``; ``None`` when neither is there."""
    folder = Path(folder)
    path = folder / INFERENCE_METADATA_FILE
    if path.is_file():
        declared = inference_metadata.read(inference_metadata.load(path), path.name)
    elif (folder / GENAI_CONFIG_FILE).is_file():
        path = folder / GENAI_CONFIG_FILE
        declared = genai_config.read(genai_config.load(path), path.name)
    else:
        return None
    return check_against(declared, list(inputs), list(outputs), source=path.name)


def _facts_from_yaml(doc: dict, onnx_name: str, window: int | None) -> SidecarFacts:
    special = ((doc.get("package") or {}).get("tokenizer") or {}).get("special_tokens") or {}
    return SidecarFacts(onnx_name=onnx_name, ctx_len=int((doc.get("model") or {}).get("max_sequence_length") or 0),
                        eos_token_ids=list(special.get("eos_token_id") or []),
                        bos_token_id=special.get("bos_token_id"), sliding_window=window)


def carry_over(src_dir: Path, dst_graph: Path, model: ir.Model, *, source_name: str,
               renames: dict[str, str] | None = None, converted: bool = False) -> list[Path]:
    """After a rewrite: the sidecars of ``src_dir`` that describe ``source_name`` rewritten for ``model`` (the
    rewritten graph, saved at ``dst_graph``) beside it, atomically. Nothing when ``src_dir`` has none, when they
    describe another graph, or when the new graph goes to another name in the same folder (they still describe
    the source graph there). A file whose format cannot describe the rewritten graph (:func:`reasons`: a static cache
    for ``genai_config.json``; the workflow form is regenerated from the new layout, an ``indexed_scatter`` group for a
    static cache) is not carried over, and removed when
    the graph was converted in place (it would name ports the graph no longer has). Another writer's
    ``inference_metadata.yaml`` (mobius' ``model.io`` form...) that names the graph's old ports follows a renaming
    (``renames``: old -> new port names; every string equal to an old name becomes the new one) and, after a
    conversion (``converted``), is not carried over (removed in place)."""
    dst_dir = dst_graph.parent
    if src_dir.resolve() == dst_dir.resolve() and dst_graph.name != source_name:
        return []
    layout = graphio.layout_of(model)
    skip = reasons(layout)   # a converted graph a format cannot describe: its old file must not stay beside it
    written = []
    gpath = src_dir / GENAI_CONFIG_FILE
    if gpath.is_file():
        doc = genai_config.load(gpath)
        if (doc.get("model") or {}).get("decoder", {}).get("filename") == source_name:
            if GENAI_CONFIG_FILE in skip:
                _drop_stale(dst_dir / GENAI_CONFIG_FILE, dst_dir.resolve() == src_dir.resolve())
            else:
                fsutil.write_json(dst_dir / GENAI_CONFIG_FILE,
                                  genai_config.renamed(doc, layout.prefix, dst_graph.name, layout.dialect))
                written.append(dst_dir / GENAI_CONFIG_FILE)
    ypath = src_dir / INFERENCE_METADATA_FILE
    if ypath.is_file():
        doc = inference_metadata.load(ypath)
        decoder = ((doc.get("pipeline") or {}).get("workflow") or {}).get("components", {}).get("decoder") or {}
        if not decoder and _names_any(doc, renames or {}):   # another writer's form, naming this graph's ports
            if converted:
                _drop_stale(dst_dir / INFERENCE_METADATA_FILE, dst_dir.resolve() == src_dir.resolve())
            else:
                fsutil.write_text(dst_dir / INFERENCE_METADATA_FILE,
                                  yaml.safe_dump(_renamed_leaves(doc, renames or {}), sort_keys=False))
                written.append(dst_dir / INFERENCE_METADATA_FILE)
        elif (decoder.get("implementation") or {}).get("artifact") == source_name:
            if INFERENCE_METADATA_FILE in skip:
                _drop_stale(dst_dir / INFERENCE_METADATA_FILE, dst_dir.resolve() == src_dir.resolve())
            else:
                facts = _facts_from_yaml(doc, dst_graph.name, layout.sliding_window)
                fsutil.write_text(dst_dir / INFERENCE_METADATA_FILE, yaml_text(layout, facts))
                written.append(dst_dir / INFERENCE_METADATA_FILE)
    return written


def _names_any(doc, names: dict[str, str]) -> bool:
    """Whether some string of ``doc`` (at any depth) is one of ``names``' keys."""
    if isinstance(doc, str):
        return doc in names
    if isinstance(doc, dict):
        return any(_names_any(v, names) for v in doc.values())
    if isinstance(doc, list):
        return any(_names_any(v, names) for v in doc)
    return False


def _renamed_leaves(doc, names: dict[str, str]):
    """``doc`` with every string equal to a key of ``names`` replaced by its value (port names, never substrings)."""
    if isinstance(doc, str):
        return names.get(doc, doc)
    if isinstance(doc, dict):
        return {k: _renamed_leaves(v, names) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_renamed_leaves(v, names) for v in doc]
    return doc


def _drop_stale(path: Path, same_folder: bool) -> None:
    """A sidecar that described the graph before an in-place conversion no format can follow: removed (it would
    name ports the graph no longer has)."""
    if same_folder:
        path.unlink(missing_ok=True)


def _folder(model: ir.Model) -> Path | None:
    src = model.meta.get(naming.SOURCE_PATH_META)
    return Path(src).parent if src else None


def layout_beside(model: ir.Model) -> KVLayout:
    """The layout of ``model`` (read with :func:`qeff_kv.graph.graphio.load`): its pairs by a dialect's names, else
    the pairs a sidecar beside the file declares (``source`` names it); a sidecar that does not fit the graph leaves
    the layout without KV (``check``'s ``sidecar`` rule says why)."""
    layout = graphio.layout_of(model)
    folder = _folder(model)
    if layout.kv_names or folder is None:
        return layout
    try:
        declared = read_declared(folder, layout.inputs, layout.outputs)
    except SidecarError:
        return layout
    if declared is None:
        return layout
    pairs = [(p.input, p.output, naming.STEM_OF_ROLE[p.role], p.layer) for p in declared.pairs
             if p.role in naming.STEM_OF_ROLE]
    ins, outs = graphio.io_of(model)
    return KVLayout.from_io(ins, outs, graphio.metadata_of(model), declared=pairs,
                            source=INFERENCE_METADATA_FILE if (folder / INFERENCE_METADATA_FILE).is_file()
                            else GENAI_CONFIG_FILE)


def sidecar_issues(model: ir.Model, layout: KVLayout) -> tuple[str | None, list[str]]:
    """``(file, problems)`` of the sidecar beside ``model`` checked against its graph: every port it names exists and
    pairs as the graph pairs it, layers in numeric order, every KV pair of the graph named (so its prefix is the
    graph's); ``(None, [])`` without a sidecar."""
    folder = _folder(model)
    if folder is None:
        return None, []
    found = [f for f in (INFERENCE_METADATA_FILE, GENAI_CONFIG_FILE) if (folder / f).is_file()]
    if not found:
        return None, []
    problems: list[str] = []
    for name in found:
        try:   # each file alone (read_declared takes the first it finds)
            doc = inference_metadata.load(folder / name) if name == INFERENCE_METADATA_FILE \
                else genai_config.load(folder / name)
            declared = (inference_metadata.read(doc, name) if name == INFERENCE_METADATA_FILE
                        else genai_config.read(doc, name))
            check_against(declared, layout.inputs, layout.outputs, source=name)
        except SidecarError as exc:
            problems.append(str(exc))
            continue
        named = {p.input for p in declared.pairs}
        missing = [p.input_name for p in layout.pairs if p.input_name not in named]
        if missing:
            problems.append(f"{name}: does not name the graph's KV input {missing[0]!r}"
                            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return ", ".join(found), problems
