"""Export options, the options hash and the export cache folder. No torch here.

:class:`ExportOptions` is the one object the CLI fills (its click options are named as the fields) and
:func:`~qeff_kv.export.api.export_model` takes: each option is checked once, here (its kind when the object is
made, the values and their combinations in :meth:`ExportOptions.validate` once the model fixed ``ctx_len``)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from qeff_kv.contract import ccl as ccl_values
from qeff_kv.contract import naming
from qeff_kv.contract.lora import adapter_name_problem
from qeff_kv.support import validate
from qeff_kv.errors import ExportError
from qeff_kv.support.limits import positive_int
from qeff_kv.export import targets
from qeff_kv.export.schemes import check_scheme, resolve_options
from qeff_kv.export.versions import EXPORTER_VERSION, IR_VERSION, OPSET  # noqa: F401 (read as opt.OPSET)

DTYPES = ("float32", "float16")
#: ``--kv-cache-dtype``: the retained KV buffers' dtype; ``None`` (or the export dtype): the export dtype. ``int8``:
#: static per-channel scales (onnxruntime's GroupQueryAttention quantized cache on the fused target); ``int4``: the same,
#: two values per byte (the fused target only)
KV_CACHE_DTYPES = ("float32", "float16", "int8", "int4")
#: the quantized cache dtypes' bit widths (GroupQueryAttention's ``kv_cache_bit_width``)
KV_CACHE_BITS = {"int8": 8, "int4": 4}
#: how sliding-window layers keep their cache (``ExportOptions.sliding_cache``)
SLIDING_CACHES = ("ring", "full")
#: portable: static-shape friendly, standard ops (accelerator compilers); onnxruntime: attention follows the
#: valid length through a data-dependent Slice (same names, pairing and in-place safety); onnxruntime-fused:
#: onnxruntime's GroupQueryAttention appends to the retained buffers in place (no continuous batching).
TARGETS = targets.NAMES  # ("portable", "onnxruntime", "onnxruntime-fused"): one module each
DEFAULT_PREFILL_SEQ_LEN = 32
#: ``ctx_len`` left out: the model's ``max_position_embeddings``, at most this
DEFAULT_MAX_CTX_LEN = 4096
#: Weights above this many bytes go to an external data file ``<name>.onnx.data``. Protobuf's limit is 2 GiB,
#: but inline weights also make every reader hold two copies while parsing (file bytes and message), so
#: anything but tiny models goes external: a serving host then loads the graph structure without the weights.
EXTERNAL_DATA_THRESHOLD = 64 * 2**20


@dataclass(frozen=True)
class ExportOptions:
    """What determines an exported graph (its :meth:`to_json` is hashed into the export cache's name): the fields
    ``qeff-kv export``'s options are named after, and :func:`~qeff_kv.export.api.export_model`'s keywords."""

    #: KV capacity; ``None`` (before :meth:`resolved`): the model's ``max_position_embeddings``, at most
    #: :data:`DEFAULT_MAX_CTX_LEN`
    ctx_len: int | None = None
    prefill_seq_len: int = DEFAULT_PREFILL_SEQ_LEN
    #: prefix of the KV buffers only (``past_key.{i}_P``); checked by :func:`qeff_kv.contract.naming.validate_prefix`
    kv_cache_prefix: str | None = None
    dtype: str = "float32"
    continuous_batching: bool = False
    full_batch_size: int | None = None
    target: str = "portable"
    #: compute-context lengths (contract section 9): the graph takes ``comp_ctx_lengths`` and attends over the
    #: first ``len(comp_ctx_lengths)`` slots; one prefill and one decode specialization per value. As given
    #: (``"auto"``, ``"512,1024"`` or a list of ints) until :meth:`resolved` parses it into a tuple
    ccl: tuple[int, ...] | str | list | None = None
    #: weight-only quantization for the onnxruntime targets (``int4``/``int8``, see ``quantize.py``); ``None``:
    #: float weights. ``block_size``/``accuracy_level`` are resolved to their defaults when ``weights`` is set.
    weights: str | None = None
    block_size: int | None = None
    accuracy_level: int | None = None
    #: ``--zero-points/--no-zero-points``: asymmetric blocks with a zero point each (``MatMulNBits``'
    #: ``zero_points``) or symmetric ones; resolved to the scheme's default (symmetric: schemes.DEFAULT_ZERO_POINTS)
    zero_points: bool | None = None
    #: how sliding-window layers keep their cache when ``ctx_len`` exceeds the window (contract section 7):
    #: ``"ring"`` (``sliding_window`` slots written at ``position % window``), ``"full"`` (``ctx_len`` slots, the
    #: window in the attention mask: deeper rewinds, more memory); ``None``: ring where the target can (the
    #: portable and onnxruntime targets), full on the fused one
    sliding_cache: str | None = None
    #: vision-language models: one graph with the vision encoder inside (``pixel_values`` retained) instead of
    #: a vision graph and a language graph (contract section 6)
    single_graph: bool = False
    #: vision-language models whose vision config fixes no image size (Qwen2.5-VL): the side of the square image
    #: the vision graph is traced for (``None``: the config's ``image_size``, else 448)
    image_size: int | None = None
    #: multi-head latent attention models (DeepSeek-V2/V3; contract section 11): ``"latent"`` retains the
    #: compressed pair ``compressed_kv``/``k_pe`` and attends over it with absorbed projections; ``None`` or
    #: ``"full"``: the model's own attention over ``past_key``/``past_value`` (the default)
    mla_cache: str | None = None
    #: speculative decoding (a "target language model" graph): the graph takes ``num_logits_to_keep`` and returns
    #: the logits of that many last rows, so a decode step verifies up to ``K`` drafted tokens (``K+1`` rows)
    speculative_tokens: int | None = None
    #: one more output, last: the final hidden state at the logits' rows (``naming.HIDDEN_STATES_OUTPUT``;
    #: embeddings); text decoders only
    hidden_states: bool = False
    #: ``--weights int4`` from a GGUF file: MatMul weights whose GGUF type fits MatMulNBits exactly take the
    #: GGUF's own blocks (:mod:`qeff_kv.export.weights.gguf_grid`)
    gguf_grid: bool = False
    #: a pre-quantized int4 checkpoint's format (``awq``, ``gptq``, ``compressed-tensors``; set by
    #: :func:`~qeff_kv.export.api.resolve` from ``config.json``, never a flag): its own blocks become MatMulNBits
    #: (:mod:`qeff_kv.export.weights.prequant`)
    prequant: str | None = None
    #: LoRA adapters the graph takes per row (docs/lora.md): ``(name, PEFT folder)`` pairs (``"name=DIR"`` strings
    #: accepted); the graph adapts their modules at the largest rank among them (or :attr:`max_lora_rank`) and the
    #: export is proved with each of them
    lora: tuple[tuple[str, str], ...] | None = None
    #: the largest adapter rank the graph takes; alone (no :attr:`lora`), the graph adapts :attr:`lora_targets`
    max_lora_rank: int | None = None
    #: with :attr:`max_lora_rank` alone: the module names adapted (comma-separated, e.g. ``q_proj,v_proj``; default
    #: the attention and MLP projections)
    lora_targets: str | None = None
    #: the KV cache's dtype (:data:`KV_CACHE_DTYPES`); ``None``: :attr:`dtype` (docs/export.md, "A quantized KV
    #: cache")
    kv_cache_dtype: str | None = None

    def __post_init__(self) -> None:
        """The kinds, refused in one line before anything is read: flags are real booleans (``"no"`` is refused,
        not taken as true), integers are integers, the prefix is a valid prefix. Values are :meth:`validate`'s."""
        if self.kv_cache_prefix is not None:
            naming.validate_prefix(self.kv_cache_prefix)
        for label in ("continuous_batching", "single_graph"):
            validate.flag(label, getattr(self, label), error=ExportError)
        validate.flag("zero_points", self.zero_points, optional=True, error=ExportError)
        for label, lo in (("block_size", 1), ("accuracy_level", 0), ("full_batch_size", 1), ("image_size", 1)):
            validate.optional_int(label, getattr(self, label), minimum=lo, error=ExportError)
        for label in ("single_graph", "gguf_grid", "hidden_states"):   # truthy values taken as the flag
            object.__setattr__(self, label, bool(getattr(self, label)))
        validate.optional_int("max_lora_rank", self.max_lora_rank, minimum=1, error=ExportError)
        object.__setattr__(self, "lora", lora_pairs(self.lora))

    @property
    def target_info(self) -> targets.TargetInfo:
        """What the registry knows of :attr:`target` without torch (ring buffers, GroupQueryAttention): the
        family facts' refusals and cache plan read it here, so the facts never import the targets."""
        return targets.info(self.target)

    def resolved(self, max_position_embeddings) -> "ExportOptions":
        """The options for a model whose ``config.json`` gives ``max_position_embeddings``: ``ctx_len`` defaulted,
        ``ccl`` parsed, the weight scheme's block size and accuracy level defaulted; validated."""
        ctx_len = self.ctx_len
        if ctx_len is None:
            ctx_len = min(int(max_position_embeddings or DEFAULT_MAX_CTX_LEN), DEFAULT_MAX_CTX_LEN)
        ccl = parse_ccl(self.ccl, ctx_len, self.prefill_seq_len) if isinstance(ctx_len, int) else self.ccl
        return replace(self, ctx_len=ctx_len, ccl=ccl,
                       **resolve_options(self.weights, self.block_size, self.accuracy_level,
                                         self.zero_points)).validate()

    def validate(self) -> "ExportOptions":
        """The values and their combinations (one line each); returns the options with numpy integers as ints."""
        for label, v in (("ctx_len", self.ctx_len), ("prefill_seq_len", self.prefill_seq_len)):
            positive_int(label, v, error=ExportError)
        if type(self.ctx_len) is not int or type(self.prefill_seq_len) is not int:  # numpy integers -> int
            return replace(self, ctx_len=int(self.ctx_len), prefill_seq_len=int(self.prefill_seq_len)).validate()
        if self.full_batch_size is not None and not isinstance(self.full_batch_size, bool) \
                and isinstance(self.full_batch_size, np.integer):
            return replace(self, full_batch_size=int(self.full_batch_size)).validate()
        if self.prefill_seq_len > self.ctx_len:
            raise ExportError(f"prefill_seq_len {self.prefill_seq_len} is larger than ctx_len {self.ctx_len}")
        if self.dtype not in DTYPES:
            raise ExportError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.target not in TARGETS:
            raise ExportError(f"target must be one of {', '.join(TARGETS)}, got {self.target!r}")
        refuses = targets.info(self.target).refuses   # what the target cannot honour, in one line each
        if self.continuous_batching and "continuous_batching" in refuses:
            raise ExportError(refuses["continuous_batching"])
        if self.continuous_batching:
            if self.full_batch_size is None:
                raise ExportError("--continuous-batching needs --full-batch-size N")
            positive_int("full_batch_size", self.full_batch_size, error=ExportError)
        elif self.full_batch_size is not None:
            raise ExportError("--full-batch-size is only meaningful with --continuous-batching")
        if self.ccl is not None:
            if "ccl" in refuses:
                raise ExportError(refuses["ccl"])
            check_ccl(self.ccl, self.ctx_len, self.prefill_seq_len)
        if self.image_size is not None:
            positive_int("image_size", self.image_size, error=ExportError)
        if self.sliding_cache not in (None, *SLIDING_CACHES):
            raise ExportError(f"sliding_cache must be 'ring' or 'full', got {self.sliding_cache!r}")
        if self.sliding_cache == "ring" and "ring" in refuses:
            raise ExportError(refuses["ring"])
        if self.speculative_tokens is not None:
            positive_int("speculative_tokens", self.speculative_tokens, error=ExportError)
            if "speculative" in refuses:
                raise ExportError(refuses["speculative"])
            if self.speculative_tokens + 1 > self.ctx_len:
                raise ExportError(f"--speculative-tokens {self.speculative_tokens}: a verification step of "
                                  f"{self.speculative_tokens + 1} tokens does not fit in ctx_len {self.ctx_len}")
        check_scheme(self.weights, self.block_size, self.accuracy_level, self.target, zero_points=self.zero_points)
        if self.gguf_grid and self.weights != "int4":
            raise ExportError("--gguf-grid needs --weights int4 (the GGUF's 4-bit blocks become MatMulNBits)")
        if self.gguf_grid and self.block_size != 32:
            raise ExportError(f"--gguf-grid takes the GGUF's blocks of 32 values; --block-size {self.block_size} "
                              "cannot be used with it")
        check_mla_cache(self)
        check_lora(self)
        check_kv_cache_dtype(self)
        return self

    @property
    def quantized_kv(self) -> bool:
        """The KV buffers are quantized (``--kv-cache-dtype int8`` or ``int4``)."""
        return self.kv_cache_dtype in KV_CACHE_BITS

    @property
    def kv_cache_bits(self) -> int | None:
        """The quantized cache's bit width (8 or 4), or ``None`` for a float cache."""
        return KV_CACHE_BITS.get(self.kv_cache_dtype)

    @property
    def adapts(self) -> bool:
        """The graph takes LoRA adapters (``--lora`` or ``--max-lora-rank``)."""
        return bool(self.lora) or self.max_lora_rank is not None

    def to_json(self) -> dict:
        d = asdict(self)
        if d["ccl"] is None:
            del d["ccl"]  # exports without CCL keep the options hash they had before CCL existed
        else:
            d["ccl"] = list(d["ccl"])
        if not d["single_graph"]:
            del d["single_graph"]
        if d["image_size"] is None:
            del d["image_size"]
        if not d["hidden_states"]:
            del d["hidden_states"]   # exports without it keep their options hash
        if not d["gguf_grid"]:
            del d["gguf_grid"]   # exports without it keep their options hash
        if d["prequant"] is None:
            del d["prequant"]
        if not d["zero_points"]:
            del d["zero_points"]   # symmetric blocks (int8, --no-zero-points) keep the options hash they had
        if d["mla_cache"] in (None, "full"):
            del d["mla_cache"]   # the default keeps the options hash it had before --mla-cache existed
        if d["lora"] is None:
            del d["lora"]
        else:
            d["lora"] = [list(pair) for pair in d["lora"]]
        if d["kv_cache_dtype"] == self.dtype:
            d["kv_cache_dtype"] = None   # the export dtype named: the same graph as the default
        for key in ("weights", "block_size", "accuracy_level", "sliding_cache", "speculative_tokens",
                    "max_lora_rank", "lora_targets", "kv_cache_dtype"):
            if d[key] is None:
                del d[key]  # exports without these options keep the options hash they had before they existed
        return d


def check_kv_cache_dtype(options: ExportOptions) -> None:
    """``--kv-cache-dtype``: one of :data:`KV_CACHE_DTYPES`; a float one is the export dtype; int8 (every target:
    GroupQueryAttention's quantized cache, or quantize/dequantize around the ScatterND); int4 on the fused target only
    (ONNX's ScatterND has no int4 type; one line each). What a model's layers cannot hold quantized is
    :meth:`ModelFacts.kv_quant_refusal`'s."""
    kv = options.kv_cache_dtype
    if kv is None or kv == options.dtype:
        return
    if kv not in KV_CACHE_DTYPES:
        raise ExportError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv!r}")
    if kv in DTYPES:
        raise ExportError(f"--kv-cache-dtype {kv} differs from --dtype {options.dtype}: a float cache is kept in "
                          f"the export dtype; use --dtype {kv}, or --kv-cache-dtype int8")
    if kv == "int4" and options.target != "onnxruntime-fused":
        raise ExportError(f"--kv-cache-dtype int4 needs --target onnxruntime-fused (GroupQueryAttention's packed 4-bit "
                          f"cache; ONNX's ScatterND on the {options.target} target has no int4 type); use "
                          f"--target onnxruntime-fused, or --kv-cache-dtype int8")
    if options.dtype != "float32":
        raise ExportError(f"--kv-cache-dtype {kv} is verified with --dtype float32 only; use --dtype float32")


def check_run(*, model, out_dir, progress, verify, force) -> None:
    """The kinds of :func:`~qeff_kv.export.export_model`'s arguments that are not options, before anything is read:
    paths are paths, flags are real booleans (``verify="no"`` is refused, not taken as true), ``progress`` is
    callable."""
    validate.path_like("model", model, optional=True, error=ExportError)
    validate.path_like("out_dir", out_dir, optional=True, error=ExportError)
    validate.callable_or_none("progress", progress, error=ExportError)
    validate.flag("verify", verify, optional=True, error=ExportError)
    validate.flag("force", force, error=ExportError)


#: the fields a caller gives (``prequant`` is read from the checkpoint, never given)
GIVEN_FIELDS = tuple(f.name for f in fields(ExportOptions) if f.name != "prequant")


def options_of(options: ExportOptions | None, given: dict, caller: str = "export_model") -> ExportOptions:
    """``options`` (default: all defaults) with the keyword arguments ``given`` (fields of :class:`ExportOptions`)
    over it; an unknown keyword is a ``TypeError``, as for any function."""
    for key in given:
        if key not in GIVEN_FIELDS:
            raise TypeError(f"{caller}() got an unexpected keyword argument {key!r}")
    if options is None:
        return ExportOptions(**given)
    if not isinstance(options, ExportOptions):
        raise ExportError(f"options must be an ExportOptions, got {type(options).__name__}")
    return replace(options, **given) if given else options


def lora_pairs(value) -> tuple[tuple[str, str], ...] | None:
    """``--lora`` as ``((name, folder), ...)``: from ``"name=DIR"`` strings or pairs; names are 1-64 characters of
    letters, digits, ``.``, ``_``, ``-`` and unique (one line each otherwise)."""
    if value is None or value == () or value == []:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ExportError(f"lora must be a list of name=PEFT_DIR, got {value!r}")
    pairs = []
    for item in value:
        if isinstance(item, str):
            name, sep, folder = item.partition("=")
            if not sep or not folder:
                raise ExportError(f"--lora takes name=PEFT_DIR, got {item!r}")
        elif isinstance(item, (list, tuple)) and len(item) == 2:
            name, folder = item
        else:
            raise ExportError(f"--lora takes name=PEFT_DIR, got {item!r}")
        if adapter_name_problem(name) is not None:
            raise ExportError(adapter_name_problem(name))
        pairs.append((name, os.fspath(folder)))
    names = [n for n, _ in pairs]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ExportError(f"adapter name {dup!r} is given twice")
    return tuple(pairs)


def check_lora(options: "ExportOptions") -> None:
    """The adapter options' combinations (one line each); the adapters themselves are read and fitted at the
    resolve stage (:func:`qeff_kv.export.api.resolve`)."""
    if options.lora_targets is not None:
        if options.lora:
            raise ExportError("--lora-targets is for --max-lora-rank alone; with --lora the adapters' own modules "
                              "are adapted")
        if options.max_lora_rank is None:
            raise ExportError("--lora-targets needs --max-lora-rank R")
        names = [t.strip() for t in options.lora_targets.split(",")]
        if not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", t) for t in names):
            raise ExportError(f"--lora-targets takes module names separated by commas, got {options.lora_targets!r}")
    if options.adapts and options.mla_cache == "latent":
        raise ExportError("LoRA adapters are not supported with --mla-cache latent (its absorbed attention "
                          "replaces the projections the adapters change)")


MLA_CACHES = ("full", "latent")


def check_mla_cache(options: "ExportOptions") -> None:
    """``--mla-cache``: one of :data:`MLA_CACHES`; ``latent`` only where the target and the other options allow
    it (one line each). Whether the model has MLA is a family fact (:meth:`~qeff_kv.export.facts.family.ModelFacts.refusal`)."""
    if options.mla_cache not in (None, *MLA_CACHES):
        raise ExportError(f"mla_cache must be one of {', '.join(MLA_CACHES)}, got {options.mla_cache!r}")
    if options.mla_cache != "latent":
        return
    refuses = targets.info(options.target).refuses
    if "mla_latent" in refuses:
        raise ExportError(refuses["mla_latent"])
    for flag, value in (("--ccl", options.ccl), ("--weights", options.weights)):
        if value is not None:
            raise ExportError(f"--mla-cache latent does not support {flag} yet; export without it or with "
                              f"--mla-cache full")


def check_ccl(values, ctx_len: int, prefill_seq_len: int | None = None) -> tuple[int, ...]:
    """:func:`qeff_kv.contract.ccl.check_ccl` raising :class:`ExportError` (values below ``prefill_seq_len``
    are refused: their prefill specialization could not hold a chunk)."""
    return ccl_values.check_ccl(values, ctx_len, error=ExportError, prefill_seq_len=prefill_seq_len)


def parse_ccl(value, ctx_len: int, prefill_seq_len: int | None = None) -> tuple[int, ...] | None:
    """:func:`qeff_kv.contract.ccl.parse_ccl` raising :class:`ExportError` (``"auto"`` leaves out values below
    ``prefill_seq_len``)."""
    return ccl_values.parse_ccl(value, ctx_len, error=ExportError,
                                prefill_seq_len=prefill_seq_len if isinstance(prefill_seq_len, int) else None)


def hashed_params(config: dict, options: ExportOptions, weights_fingerprint: str | None) -> dict:
    """Everything that determines the exported graph; its hash names the export cache folder."""
    return {
        "exporter": "qeff-kv",
        "exporter_version": EXPORTER_VERSION,
        "opset": OPSET,
        "ir_version": IR_VERSION,
        "config": config,
        "options": options.to_json(),
        "weights": weights_fingerprint,
    }


def params_hash(params: dict) -> str:
    """16 hex digits of sha256 over the canonical JSON of the hashed parameters."""
    blob = json.dumps(params, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def home() -> Path:
    """``$QEFF_KV_HOME``, default ``~/.cache/qeff_kv``."""
    env = os.environ.get("QEFF_KV_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "qeff_kv"


def safe_name(name: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip(".-")
    return name or "model"


def cache_dir(architecture: str, model_name: str, digest: str) -> Path:
    return home() / safe_name(architecture) / f"{safe_name(model_name)}-{digest}"


def weights_fingerprint(model_dir: Path | None) -> str | None:
    """A cheap content fingerprint of the safetensors weights: each file's name, size, header, and the
    sha256 of its first and last MiB. ``None`` for the bundled default (weights come from a fixed seed)."""
    if model_dir is None:
        return None
    return files_fingerprint(sorted(model_dir.glob("*.safetensors")))


def files_fingerprint(files: list[Path]) -> str:
    """:func:`weights_fingerprint` of these files in this order (a folder's safetensors, or one GGUF file)."""
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            head = fh.read(1 << 20)
            h.update(head)
            if size > (2 << 20):
                fh.seek(size - (1 << 20))
                h.update(fh.read(1 << 20))
    return h.hexdigest()
