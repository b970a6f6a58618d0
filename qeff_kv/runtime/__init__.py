"""Run retained-state graphs in onnxruntime with a persistent, in-place KV cache.

Needs only numpy, onnx_ir and onnxruntime (no torch, no transformers); ``tokenizers`` is optional.

    from qeff_kv.runtime import Session
    s = Session("out/", ctx_len=256)
    [g] = s.generate([[5, 17, 42]], max_new_tokens=8)

See ``docs/runtime.md``.
"""

from .cache import KVCache, Sequence
from .sampling import GREEDY, SamplingParams, sample
from .model_files import ModelFiles, resolve_model
from .ring import RingSpec
from .session import Generation, Session, TokenEvent, Timings, open_session
from .state_file import KVState, export_state, import_state, load_state, read_state, save_state
from .media import Images, Prompt
from .vision import VisionLanguageModel, VisionStage
from .speculative import DraftModel, PromptLookup, SpeculativeDecoder

__all__ = [
    "DraftModel", "GREEDY", "Generation", "Images", "KVCache", "KVState", "Prompt", "VisionLanguageModel", "VisionStage", "ModelFiles", "RingSpec", "SamplingParams", "Sequence", "Session",
    "Timings", "TokenEvent", "export_state", "import_state", "load_state", "open_session", "PromptLookup", "read_state",
    "resolve_model", "SpeculativeDecoder", "sample", "save_state",
]
