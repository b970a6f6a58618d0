"""Weight schemes of ``--weights int4|int8``: names, defaults and the one-line refusals, checked before anything
is loaded. No torch, no onnxruntime: :mod:`qeff_kv.export.options` validates with it, and
:mod:`qeff_kv.export.weights.quantize` quantizes with it."""

from __future__ import annotations

from dataclasses import dataclass

from qeff_kv.errors import ExportError

SCHEMES = {"int4": 4, "int8": 8}
#: measured on SmolLM2-135M (docs/performance.md): decode speed and NLL of block 32 vs 64 vs 128
DEFAULT_BLOCK_SIZE = 32
#: 4: MatMulNBits quantizes its input to int8 per block and uses integer dot products (fastest on CPU)
DEFAULT_ACCURACY_LEVEL = 4
ACCURACY_LEVELS = (0, 1, 2, 3, 4)
#: zero points by default (asymmetric blocks)? No for both, measured on the README's SmolLM2 (docs/export.md,
#: "Zero points"): asymmetric int4 read the Gettysburg text at +27.5% NLL over fp32 against +24.8% symmetric,
#: and the natural-text check at 1.43x against 1.38x; both answer " Paris". ``--zero-points`` asks for them.
DEFAULT_ZERO_POINTS = {"int4": False, "int8": False}


@dataclass(frozen=True)
class WeightScheme:
    scheme: str
    block_size: int = DEFAULT_BLOCK_SIZE
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL
    #: symmetric blocks (no zero points); the vocabulary tables are always symmetric (shared by two ops)
    symmetric: bool = True
    #: "rtn" (round to nearest, onnxruntime's default quantizer) or "hqq" (onnxruntime's HQQ quantizer: float
    #: zero points, optimised per block; needs torch)
    algorithm: str = "rtn"

    @property
    def bits(self) -> int:
        return SCHEMES[self.scheme]

    def to_json(self) -> dict:
        import onnxruntime

        return {"scheme": self.scheme, "bits": self.bits, "block_size": self.block_size,
                "accuracy_level": self.accuracy_level, "symmetric": self.symmetric,
                "zero_points": not self.symmetric,
                "quantizer": f"onnxruntime {onnxruntime.__version__} MatMulNBitsQuantizer (RTN)"}

    @classmethod
    def of(cls, options) -> "WeightScheme":
        """The scheme of resolved :class:`~qeff_kv.export.options.ExportOptions` (``weights`` set)."""
        zp = DEFAULT_ZERO_POINTS[options.weights] if options.zero_points is None else options.zero_points
        return cls(options.weights, options.block_size, options.accuracy_level, symmetric=not zp)


def check_scheme(weights: str | None, block_size: int | None, accuracy_level: int | None, target: str,
                 error=ExportError, zero_points: bool | None = None) -> None:
    """Refuse, in one line, what cannot be quantized (before anything is loaded)."""
    if weights is None:
        if block_size is not None or accuracy_level is not None:
            raise error("--block-size and --accuracy-level need --weights int4|int8")
        if zero_points is not None:
            raise error("--zero-points/--no-zero-points need --weights int4|int8")
        return
    if weights not in SCHEMES:
        raise error(f"weights must be one of {', '.join(SCHEMES)}, got {weights!r}")
    if target == "portable":
        raise error(f"--weights {weights} needs --target onnxruntime or onnxruntime-fused (accelerator compilers "
                    "quantize the portable graph at compile time)")
    if block_size is not None and (block_size < 16 or block_size & (block_size - 1)):
        raise error(f"--block-size must be a power of two >= 16, got {block_size}")
    if accuracy_level is not None and accuracy_level not in ACCURACY_LEVELS:
        raise error(f"--accuracy-level must be one of 0-4, got {accuracy_level}")


def resolve_options(weights: str | None, block_size: int | None, accuracy_level: int | None,
                    zero_points: bool | None = None) -> dict:
    """ExportOptions fields: with ``weights``, the block size, accuracy level and zero points resolved to their
    defaults (so the options hash and the manifest name the values used)."""
    if weights is not None:
        block_size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
        accuracy_level = DEFAULT_ACCURACY_LEVEL if accuracy_level is None else accuracy_level
        zero_points = DEFAULT_ZERO_POINTS[weights] if zero_points is None else bool(zero_points)
    return {"weights": weights, "block_size": block_size, "accuracy_level": accuracy_level,
            "zero_points": zero_points}


def min_k(block_size: int) -> int:
    """MatMul weights with fewer input features than this stay float (one block at least)."""
    return block_size
