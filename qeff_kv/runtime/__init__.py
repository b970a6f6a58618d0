"""Run retained-state graphs in onnxruntime with a persistent, in-place KV cache.

Needs only numpy, onnx_ir and onnxruntime (no torch, no transformers); ``tokenizers`` is optional.

    from qeff_kv.runtime import Session
    s = Session("out/", ctx_len=256)
    [g] = s.generate([[5, 17, 42]], max_tokens=8)

See ``docs/runtime.md``.
"""

from qeff_kv.runtime.memory.hybrid import HybridMemory, Sequence
from qeff_kv.runtime.decoding.sampling import GREEDY, SamplingParams, sample
from qeff_kv.runtime.model_files import ModelFiles, resolve_model
from qeff_kv.runtime.memory.ring import RingSpec
from qeff_kv.runtime.session import Generation, Session, TokenEvent, Timings, open_session
from qeff_kv.runtime.memory.state_file import KVState, export_state, import_state, load_state, read_state, save_state
from qeff_kv.runtime.multimodal.media import Images, Prompt
from qeff_kv.runtime.multimodal.vision import VisionStage
from qeff_kv.runtime.vision_language import VisionLanguageModel
from qeff_kv.runtime.decoding.speculative import DraftModel, PromptLookup, SpeculativeDecoder

__all__ = [
    "DraftModel", "GREEDY", "Generation", "HybridMemory", "Images", "KVState", "Prompt", "VisionLanguageModel", "VisionStage", "ModelFiles", "RingSpec", "SamplingParams", "Sequence", "Session",
    "Timings", "TokenEvent", "export_state", "import_state", "load_state", "open_session", "PromptLookup", "read_state",
    "resolve_model", "SpeculativeDecoder", "sample", "save_state",
]
