"""``qeff-kv rewrite``: add, change or strip the KV-cache prefix of a retained-state ONNX file.

Loads the graph with :func:`qeff_kv.graph.graphio.load` (external weights stay on disk, never read), runs
:class:`~qeff_kv.graph.passes.SetKVPrefixPass`, and writes the result atomically with :func:`qeff_kv.graph.graphio.save`.
Every refusal is raised as a typed :class:`~qeff_kv.errors.QeffKvError` before anything is written:

* an invalid prefix, or both/neither of ``prefix`` and ``strip``;
* no output path, or an output path that is the input (or a hard link to it) without ``in_place``;
* a file that is missing, not ONNX or truncated; external data that is absolute or escapes the folder;
* a graph with no KV buffers, unpaired KV buffers, or mixed prefixes (unless ``allow_mixed``);
* a prefix that would create a name that already exists, or that occurs in a non-KV input/output name;
* an output that would overwrite an external-data file, or a different file already sitting where the
  external data has to be copied beside the output.

External data is never read into memory: in the same folder the new graph refers to the same data file; in
another folder the data file is cloned (reflink) or copied in the kernel (constant memory, holes kept).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from qeff_kv.support import fsutil, validate
from qeff_kv.graph import graphio, sidecars
from qeff_kv.contract import naming
from qeff_kv.errors import ExternalDataError, RewriteError
from qeff_kv.graph.passes import SetKVPrefixPass
from qeff_kv.graph.passes.dialects.to_dialect import conversion_pass, target_dialect


@dataclass
class RewriteResult:
    """What a rewrite did."""

    source: Path
    output: Path
    old_prefixes: list[str | None]
    prefix: str | None
    renamed: list[tuple[str, str]] = field(default_factory=list)
    #: External-data files (relative locations) the output refers to.
    external_data: list[str] = field(default_factory=list)
    #: ``"none"`` (no external data), ``"referenced"`` (same folder: the output points at the same files) or
    #: ``"copied"`` (other folder: cloned/copied beside the output; never hard-linked, which onnx refuses).
    external_data_action: str = "none"
    written: bool = True
    #: the KV dialect before and after (``rewrite --to``; equal when only the prefix changed)
    old_dialect: str | None = None
    dialect: str | None = None

    @property
    def changed(self) -> bool:
        return bool(self.renamed)

    def to_json(self) -> dict:
        return {
            "source": str(self.source), "output": str(self.output),
            "old_prefixes": list(self.old_prefixes), "prefix": self.prefix,
            "renamed": [{"from": a, "to": b} for a, b in self.renamed],
            "external_data": list(self.external_data), "external_data_action": self.external_data_action,
            "written": self.written, "old_dialect": self.old_dialect, "dialect": self.dialect,
        }

    def summary(self) -> str:
        what = ("stripped the KV-cache prefix" if self.prefix is None
                else f"set the KV-cache prefix to {self.prefix!r}")
        if self.dialect != self.old_dialect:
            what = f"converted the KV cache from {self.old_dialect} to {self.dialect}"
            if self.prefix not in self.old_prefixes or len(self.old_prefixes) > 1:
                what += " and " + ("stripped the prefix" if self.prefix is None else f"set the prefix {self.prefix!r}")
        olds = ", ".join("(none)" if p is None else repr(p) for p in self.old_prefixes)
        line = f"{what} (was {olds}): renamed {len(self.renamed)} input/output names; wrote {self.output}"
        if not self.written:
            line = f"{what}: nothing to rename; {self.output} left as it was"
        if self.external_data_action == "copied":
            line += f"; external data copied beside it ({', '.join(self.external_data)})"
        elif self.external_data_action == "referenced":
            line += f"; external data referenced in place ({', '.join(self.external_data)})"
        return line


def _same_path(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _output_path(src: Path, dst, in_place: bool) -> Path:
    """Where the rewritten graph goes: ``src`` itself in place, else ``dst`` (refused when it is a folder or the
    input)."""
    if in_place:
        if dst is not None and not _same_path(src, Path(dst)):
            raise RewriteError(f"in-place rewrite of {src} cannot also write to another file {dst}")
        return src
    if dst is None:
        raise RewriteError("no output file given (use -o OUTPUT, or --in-place to rewrite the input)")
    dst_path = Path(dst)
    if dst_path.exists() and dst_path.is_dir():
        raise RewriteError(f"output {dst_path} is a folder; give a file name")
    fsutil.check_output_file(dst_path)  # a folder, FIFO, device node or a path below a file: refused
    if src.exists() and dst_path.exists() and _same_path(src, dst_path):
        raise RewriteError(f"output {dst_path} is the input file; pass --in-place to rewrite it")
    return dst_path


def _external_data(model, src: Path, dst_path: Path) -> list[str]:
    """The external-data files of ``src`` (refused when writing ``dst_path`` would overwrite one, or would copy
    one over a different file of the same name)."""
    externals = sorted({str(t.location) for t in graphio.external_tensors(model)})
    src_dir, dst_dir = src.parent.resolve(), dst_path.parent.resolve()
    for location in externals:
        data_src = (src_dir / location)
        if dst_path.exists() and _same_path(dst_path, data_src):
            raise RewriteError(f"output {dst_path} is the external-data file {location!r} of the input")
        if dst_dir != src_dir:
            data_dst = dst_dir / location
            if data_dst.resolve() == dst_path.resolve():
                raise RewriteError(f"output {dst_path} would overwrite the external data {location!r} it needs")
            if data_dst.exists() and not (_same_path(data_src, data_dst)
                                          or graphio.same_content(data_src, data_dst)):
                raise ExternalDataError(
                    f"{data_dst} already exists and is not the external data of the input model; "
                    "refusing to overwrite it (choose another output folder)")
    return externals


def _new_prefix(prefix, strip: bool, to) -> object:
    """The prefix to set (``None``: strip it; :data:`_KEEP`: leave it, a conversion alone)."""
    if strip and prefix is not None:
        raise RewriteError("give either a prefix or strip, not both")
    if not strip and prefix is None:
        if to is not None:
            return _KEEP
        raise RewriteError("nothing to do: give a prefix to set, or strip=True to remove the prefix (or to=DIALECT "
                           "to convert)")
    return None if strip else naming.validate_prefix(prefix)


_KEEP = object()


def _kv_renames(before: list[str], after: list[str]) -> list[tuple[str, str]]:
    """(old, new) of every KV name renamed, matched by stem, layer and side (a conversion may drop inputs)."""
    def key(name: str):
        parsed = naming.parse_any_kv_name(name)
        return None if parsed is None else (parsed.stem, parsed.layer, parsed.retained)

    now = {key(n): n for n in after if key(n) is not None}
    return [(n, now[key(n)]) for n in before if key(n) in now and now[key(n)] != n]


def rewrite(src: str | os.PathLike, dst: str | os.PathLike | None = None, *, prefix: str | None = None,
            strip: bool = False, in_place: bool = False, allow_mixed: bool = False,
            to: str | None = None, capacity: int | None = None) -> RewriteResult:
    """Rewrite the KV-cache prefix of the graph at ``src`` into ``dst`` (or ``src`` itself with ``in_place``).

    At most one of ``prefix`` (add or change to it) and ``strip=True`` (remove any prefix) may be given, and one
    of them must be unless ``to`` is. ``allow_mixed`` accepts a graph whose layers carry different prefixes and makes
    them uniform. ``to`` (``retained-state``, ``static-cache``, ``shared-past-present``) converts the KV cache to
    that dialect first (:func:`qeff_kv.graph.passes.dialects.to_dialect.conversion_pass`; the prefix kept unless
    changed too); a conversion that cannot be made exactly raises :class:`~qeff_kv.errors.DialectError`.
    ``capacity``: the positions of the fixed-capacity cache a growing past/present graph is rebuilt over (required
    for one); with ``to="static-cache"`` on a graph whose positions axis is symbolic, the static buffers' fixed size.
    """
    # ------------------------------------------------------------------ arguments (nothing read yet)
    validate.path_like("src", src, error=RewriteError)
    validate.path_like("dst", dst, optional=True, error=RewriteError)
    for label, v in (("strip", strip), ("in_place", in_place), ("allow_mixed", allow_mixed)):
        validate.flag(label, v, error=RewriteError)
    new_prefix = _new_prefix(prefix, strip, to)
    capacity = validate.optional_int("capacity", capacity, error=RewriteError)
    if capacity is not None and to is None:
        raise RewriteError("capacity is for a conversion: give to= (--to DIALECT) with it")
    if to is not None:
        target_dialect(to)
    src = Path(src)
    dst_path = _output_path(src, dst, in_place)

    # ------------------------------------------------------------------ read and plan
    model = graphio.load(src)
    layout = graphio.layout_of(model)
    old_prefixes = layout.prefixes
    externals = _external_data(model, src, dst_path)
    src_dir, dst_dir = src.parent.resolve(), dst_path.parent.resolve()

    old_dialect = layout.dialect
    # planned first: refused before anything changes
    convert = None if to is None else conversion_pass(model, to, capacity)
    if new_prefix is _KEEP:
        new_prefix = old_prefixes[0] if len(old_prefixes) == 1 else None
    before = [v.name for v in list(model.graph.inputs) + list(model.graph.outputs)]
    if convert is not None:
        convert(model)
    SetKVPrefixPass(new_prefix, allow_mixed=allow_mixed)(model)  # raises before mutating on refusal
    after = [v.name for v in list(model.graph.inputs) + list(model.graph.outputs)]
    renamed = _kv_renames(before, after)

    result = RewriteResult(
        source=src, output=dst_path, old_prefixes=old_prefixes, prefix=new_prefix, renamed=renamed,
        external_data=externals,
        external_data_action="none" if not externals else ("referenced" if src_dir == dst_dir else "copied"),
        old_dialect=old_dialect, dialect=graphio.layout_of(model).dialect)
    if in_place and not renamed and convert is None:
        result.written = False
        return result
    graphio.save(model, dst_path, source_dir=src.parent)
    _carry_sidecars(src, dst_path, model, dict(renamed), converted=result.dialect != old_dialect)
    return result


def _carry_sidecars(src: Path, dst_path: Path, model, renames: dict[str, str], *, converted: bool) -> None:
    """The runtime sidecars beside ``src`` (genai_config.json, inference_metadata.yaml), rewritten for the new
    names beside the output (:func:`qeff_kv.graph.sidecars.carry_over`; in place: updated where they are)."""
    sidecars.carry_over(src.parent, dst_path, model, source_name=src.name, renames=renames, converted=converted)
