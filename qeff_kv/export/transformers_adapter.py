"""Everything the exporter relies on in transformers' internal interfaces, in one room.

transformers moves fast: 5.24 renamed the cache argument of every decoder (``past_key_values`` and Mamba's
``cache_params`` became ``cache``, the old names kept behind a FutureWarning until 5.40), renamed the output field
the same way, and started passing ``kwargs=`` to ``Cache.update``. The rest of the exporter talks to transformers
through this module only, so that the next such change is one edit here and one test.

What qeff-kv relies on, and since which version (every line is exercised by the family matrix of the test suite):

============================================  =====================================================  ==========
interface                                     what this module does with it                          since
============================================  =====================================================  ==========
``Cache`` protocol: ``update(key, value,      :class:`CacheProtocol`, the base of every cache the    5.23
layer_idx, cache_kwargs | kwargs=)``,         exporter traces with; ``update`` takes any extra
``get_seq_length``, ``layers``,               positional or keyword arguments (``cache_kwargs`` in
``is_sliding``, ``is_compileable``            5.23, ``kwargs=`` in 5.24)
the forward's cache keyword                   :func:`cache_keyword` reads the signature (through     5.23-5.24
(``past_key_values`` / ``cache_params``       decorators): ``cache`` where the forward takes it
in 5.23, ``cache`` in 5.24)                   (5.24), else the old names, never a deprecated alias
the output's cache field (``past_key_values`` :func:`returned_cache`                                 5.23-5.24
/ ``cache_params``, ``cache`` in 5.24)
an attention module's cache keyword           :func:`attention_cache` (patched forwards, MLA)        5.23-5.24
``ALL_ATTENTION_FUNCTIONS.get_interface``     :func:`attention_function` (patched forwards, DSA)     5.24
``PreTrainedModel.get_decoder``,              :func:`decoder`, :func:`find_decoder` (Llama4's        5.23
``get_output_embeddings``                     ``get_decoder`` returns the LM itself)
``AttentionInterface.register``,              :func:`use_attention`                                  5.23
``set_attn_implementation``,
``config._attn_implementation``
``integrations.moe.ALL_EXPERTS_FUNCTIONS``    :func:`experts_implementation_available`              5.23
``modeling_rope_utils.dynamic_rope_update``,  :func:`dynamic_rope_decorator_code`,                   5.23
``ROPE_INIT_FUNCTIONS``                       :func:`rope_init_functions`
``activations.ACT2FN``                        :func:`activation`                                     5.23
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``         :func:`causal_lm_architectures`,                       5.23
                                              :func:`causal_lm_loader` (its own ``*ForCausalLM``
                                              class where the mapping lacks the type: Mistral4)
module-level helpers of a modeling file       :func:`modeling_module` (``rotate_half``,             5.23
(``rotate_half``, ``apply_rotary_pos_emb``)   ``apply_rotary_pos_emb`` patched while tracing)
``logging.set_verbosity_error``,              :func:`import_transformers` (quiet, version-checked)   5.23
``utils.logging.disable_progress_bar``
============================================  =====================================================  ==========

The supported range is :data:`SUPPORTED` (the versions the suite passed on, :data:`TESTED`); an installed
transformers outside it is refused in one line before anything is loaded (``QEFF_KV_UNTESTED_TRANSFORMERS=1``
lets ``.ci/latest --unbounded`` try a newer release on purpose).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import sys
import types
import warnings

from qeff_kv.errors import MissingDependencyError, UnsupportedVersionError

#: the transformers releases the test suite passed on (the family matrix exact on each)
TESTED = ("5.23.0", "5.24.0")
#: the supported range: from the oldest tested minor release, below the first untested one
SUPPORTED = ((5, 23), (5, 25))
#: set to 1 to export with a transformers outside :data:`SUPPORTED` (the check against the newest releases)
UNTESTED_ENV = "QEFF_KV_UNTESTED_TRANSFORMERS"
#: the cache keywords of a decoder's forward, newest first
CACHE_KEYWORDS = ("cache", "past_key_values", "cache_params")


def supported_range() -> str:
    """The range as pip writes it, e.g. ``>=5.23,<5.25``."""
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED
    return f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"


def version_refusal(version: str) -> str | None:
    """``None`` when ``version`` is inside :data:`SUPPORTED`, else the one-line reason."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    if m is None:
        return f"transformers {version!r} is not a version this exporter can read"
    got = (int(m.group(1)), int(m.group(2)))
    lo, hi = SUPPORTED
    if lo <= got < hi:
        return None
    return (f"transformers {version} is not supported: qeff-kv export is tested on transformers "
            f"{', '.join(TESTED)} (pip install 'transformers{supported_range()}', or install with "
            f"-c constraints.txt)")


def check_version(version: str) -> None:
    """Raise :class:`UnsupportedVersionError` (one line) for a transformers outside :data:`SUPPORTED`, unless
    ``QEFF_KV_UNTESTED_TRANSFORMERS=1``."""
    reason = version_refusal(version)
    if reason is not None and os.environ.get(UNTESTED_ENV, "") in ("", "0"):
        raise UnsupportedVersionError(reason)


def import_transformers():
    """``(torch, transformers)``, version-checked and quiet (no progress bars, no log lines, no warnings)."""
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise MissingDependencyError(
            f"export needs torch and transformers ({exc.name} is not installed): pip install 'qeff-kv[export]'"
        ) from None
    check_version(transformers.__version__)
    warnings.filterwarnings("ignore", module="transformers")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return torch, transformers


# ------------------------------------------------------------------------------------------ the cache protocol
class CacheProtocol:
    """The part of transformers' ``Cache`` that decoders call, for the exporter's own cache objects.

    A subclass implements :meth:`write` (one layer's new keys and values in, what attention reads out);
    :meth:`update` accepts every signature transformers 5.23-5.24 call it with (``cache_kwargs`` positionally
    or by name, ``kwargs=``) and ignores the extras: everything a layer needs is in the cache's own step."""

    is_compileable = False

    def __init__(self, num_layers: int):
        self.num_layers = int(num_layers)
        self.layers: list = []     # some helpers inspect cache.layers; we hold no transformers layers
        # attention is limited by the ready-made mask, never by a sliding cache layer
        self.is_sliding = [False] * self.num_layers

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def __len__(self) -> int:
        return self.num_layers

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.write(key_states, value_states, int(layer_idx))

    def write(self, key_states, value_states, layer_idx: int):
        raise NotImplementedError


def _parameters(fn) -> dict:
    try:
        return dict(inspect.signature(fn).parameters)   # follows functools.wraps to the undecorated forward
    except (TypeError, ValueError):
        return {}


def cache_keyword(fn) -> str:
    """The keyword ``fn`` (a decoder's or a causal LM's ``forward``) takes its cache by: ``cache`` (5.24), else
    ``past_key_values`` or ``cache_params`` (5.23); ``past_key_values`` when the signature does not say."""
    params = _parameters(fn)
    return next((k for k in CACHE_KEYWORDS if k in params), "past_key_values")


def with_cache(module, cache) -> dict:
    """``{keyword: cache}`` for calling ``module`` (its forward's own cache keyword)."""
    return {cache_keyword(module.forward): cache}


def returned_cache(out):
    """The cache a transformers forward returned (``cache``, ``past_key_values`` or ``cache_params``)."""
    for name in CACHE_KEYWORDS:
        value = getattr(out, name, None)
        if value is not None:
            return value
    return None


def attention_cache(kwargs: dict):
    """The cache an attention module's forward was given, under either keyword; both are removed from
    ``kwargs``."""
    found = None
    for name in ("cache", "past_key_values"):
        value = kwargs.pop(name, None)
        if found is None:
            found = value
    return found


# ------------------------------------------------------------------------------------- model structure
def decoder(model):
    """The model's decoder (the module the exporter calls; it applies the output head itself)."""
    return model.get_decoder()


def find_decoder(model) -> None:
    """Give the loaded model its decoder where transformers' ``get_decoder`` returns the causal LM itself: it looks
    the decoder up by ``base_model_prefix``, which for Llama4ForCausalLM names ``language_model`` while the decoder
    is ``model``."""
    import torch

    inner = getattr(model, "model", None)
    if model.get_decoder() is model and isinstance(inner, torch.nn.Module) and inner is not model and \
            model.get_output_embeddings() is not None:
        model.get_decoder = lambda: inner


def use_attention(module, name: str, fn) -> None:
    """Register ``fn`` as attention implementation ``name`` and route ``module``'s attention through it."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, fn)
    module.set_attn_implementation(name)


@contextlib.contextmanager
def patched_forwards(modules, forward):
    """Inside: each of ``modules`` runs ``forward`` (bound to it) instead of its class's ``forward``; restored on
    the way out."""
    try:
        for m in modules:
            m.forward = types.MethodType(forward, m)
        yield
    finally:
        for m in modules:
            m.__dict__.pop("forward", None)


def use_config_attention(model, implementation: str) -> None:
    """Set the attention implementation on the loaded copy's config (models whose own attention code branches on
    it and refuse ``set_attn_implementation``)."""
    model.config._attn_implementation = implementation


def modeling_module(obj):
    """The Python module (``modeling_<family>.py``) that defines ``obj``'s class; its module-level helpers
    (``rotate_half``, ``apply_rotary_pos_emb``) are what the decoder calls through its globals."""
    cls = obj if isinstance(obj, type) else type(obj)
    return sys.modules.get(cls.__module__)


def attention_function(module):
    """The attention function ``module``'s forward calls: transformers' ``ALL_ATTENTION_FUNCTIONS`` entry for its
    config's implementation, else its modeling file's ``eager_attention_forward`` (patched forwards, DSA)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation,
                                                 modeling_module(module).eager_attention_forward)


def experts_implementation_available(implementation: str) -> bool:
    """transformers' own validity rule for an experts implementation: ``eager`` or a registered one."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return implementation == "eager" or implementation in ALL_EXPERTS_FUNCTIONS


def dynamic_rope_decorator_code():
    """The code object of the function ``dynamic_rope_update`` wraps a rotary ``forward`` in."""
    from transformers.modeling_rope_utils import dynamic_rope_update

    return dynamic_rope_update(lambda self, x, position_ids: None).__code__


def rope_init_functions() -> dict:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS


def activation(name: str):
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def causal_lm_architectures() -> dict:
    """``model_type -> architecture class name`` of transformers' causal-LM auto mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def checkpoint_renamer(model):
    """transformers' checkpoint conversion for ``model`` (5.x ``conversion_mapping``, as loading applies it):
    ``(rename, sort_key)`` where ``rename(key) -> (model name, WeightConverter or None, matched source pattern)``
    renames a checkpoint key (all renamings, then at most one converter: its ``source_patterns`` and
    ``operations`` say how the keys it collects become the parameter) and ``sort_key`` orders keys as loading
    collects them (experts in numeric order); ``None`` where this transformers has no conversion mapping (5.x
    always has its legacy renamings: ``LayerNorm.gamma``...)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, \
            rename_source_key
    except ImportError:
        return None
    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    if not renamings and not converters:
        return None
    names = dict(model.state_dict(keep_vars=True))

    def rename(key: str):
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, names)
        if target not in names and key in names:   # as loading does: the key was the model's own name
            return key, None, None
        converter = None if pattern is None else next(c for c in converters if pattern in c.source_patterns)
        return target, converter, pattern

    return rename, dot_natural_key


def gguf_tensor_helpers(arch: str):
    """What transformers' (legacy, dequantizing) GGUF loader does to each tensor of a GGUF of architecture ``arch``
    (:mod:`.weights.gguf_store`): ``(processor_for(config), names(model, processor), gguf_config(path))`` (the
    architecture's tensor processor, ``get_gguf_hf_weights_map`` and the metadata-only config the processors
    read), or None when transformers converts ``arch`` with its newer conversion ops instead."""
    from transformers import modeling_gguf_pytorch_utils as tg

    try:
        from transformers.integrations.gguf.utils import is_gguf_arch_supported
    except ImportError:   # a transformers without the newer GGUF loader: every architecture is legacy
        is_gguf_arch_supported = None
    if is_gguf_arch_supported is not None and is_gguf_arch_supported(arch):
        return None
    processor_class = tg.TENSOR_PROCESSORS.get(arch, tg.TensorProcessor)
    return (lambda config: processor_class(config=config), tg.get_gguf_hf_weights_map,
            lambda path: tg.load_gguf_checkpoint(str(path), return_tensors=False)["config"])


def causal_lm_loader(transformers, config):
    """The auto class that loads the text decoder of ``config`` (``config.json`` as a dict, or a transformers
    config): ``AutoModelForCausalLM``, where transformers maps its ``model_type`` to a causal LM. Where it does not,
    the ``*ForCausalLM`` class that ``architectures`` names, when transformers ships it for that very
    ``model_type`` (Mistral4: ``Mistral4ForCausalLM`` exists, but 5.24 maps ``mistral4`` only for pretraining and
    image-text-to-text), is registered for its config class first (``AutoModelForCausalLM.register``, transformers'
    public way to map a config to a model class). Otherwise the Auto class's own error names the config class."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    model_type = str(get("model_type") or "")
    auto = transformers.AutoModelForCausalLM
    if not model_type or model_type in causal_lm_architectures():
        return auto
    for name in get("architectures") or ():
        cls = getattr(transformers, str(name), None) if str(name).endswith("ForCausalLM") else None
        config_class = getattr(cls, "config_class", None)
        if cls is not None and getattr(config_class, "model_type", None) == model_type:
            auto.register(config_class, cls, exist_ok=True)
            break
    return auto


@contextlib.contextmanager
def cache_writes_through(transform):
    """While active, every transformers cache write hands its layer's new keys and values through ``transform(
    layer_idx, keys, values) -> (keys, values)`` first (the reference of an int8 cache: :mod:`.modeling.kv_quant`)."""
    from transformers import cache_utils

    original = cache_utils.Cache.update

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        key_states, value_states = transform(layer_idx, key_states, value_states)
        return original(self, key_states, value_states, layer_idx, *args, **kwargs)

    cache_utils.Cache.update = update
    try:
        yield
    finally:
        cache_utils.Cache.update = original
