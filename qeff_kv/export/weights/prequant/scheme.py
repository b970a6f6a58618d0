"""What a pre-quantized checkpoint is (:class:`PrequantScheme`), and the checks every layout's config shares:
whole MatMulNBits blocks per group, 4 bits. The bottom room of :mod:`qeff_kv.export.weights.prequant` (no torch,
no onnxruntime)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from qeff_kv.errors import ExportError

#: the formats read, and what each of their configs must say
FORMATS = ("awq", "gptq", "compressed-tensors")
#: the largest MatMulNBits block taken from a group (a group of 256 is two blocks with the same scale and zero)
MAX_BLOCK = 128


@dataclass(frozen=True)
class PrequantScheme:
    """One checkpoint's int4 scheme: ``format`` (:data:`FORMATS`), ``group_size`` (``-1``: one group per output
    row), ``symmetric``, ``act_order`` (GPTQ ``desc_act``; compressed-tensors ``actorder: group``: the groups are
    scattered over K by ``g_idx``), ``zeros_minus_one`` (GPTQ v1 stores each zero point minus one) and ``layout``
    (the on-disk variant named in the config: AWQ ``version``, GPTQ ``checkpoint_format``, compressed-tensors
    ``format``)."""

    format: str
    group_size: int
    symmetric: bool
    act_order: bool
    zeros_minus_one: bool
    layout: str
    bits: int = 4

    @property
    def block_size(self) -> int | None:
        """MatMulNBits' block for this group size (``None`` for one group per row: chosen per weight from K)."""
        return None if self.group_size == -1 else block_for_group(self.group_size)

    def describe(self) -> str:
        group = "per output channel" if self.group_size == -1 else f"groups of {self.group_size}"
        return (f"{self.format} ({self.layout}) int{self.bits}, {group}, "
                f"{'symmetric' if self.symmetric else 'asymmetric'}{', act-order (g_idx)' if self.act_order else ''}")

    def to_json(self) -> dict:
        return asdict(self)

    def resolve_flags(self, *, weights, block_size, accuracy_level, target: str, dtype: str, name: str):
        """``(weights, block_size, accuracy_level)`` for the export: the checkpoint says int4 and its group size;
        flags that contradict it, and targets or dtypes that cannot hold it exactly, are refused in one line."""
        what = f"{name} is a pre-quantized {self.describe()} checkpoint"
        if target == "portable":
            raise ExportError(f"{what}: its weights become onnxruntime's MatMulNBits, which the portable target "
                              "cannot hold; use --target onnxruntime or onnxruntime-fused")
        if weights not in (None, "int4"):
            raise ExportError(f"{what}: --weights {weights} would requantize it; export it without --weights")
        if block_size is not None and block_size != self.block_size:
            raise ExportError(f"{what}: its blocks are its own ({self.block_size or 'per channel'}); "
                              f"--block-size {block_size} cannot change them")
        if dtype != "float32":
            raise ExportError(f"{what}: its dequantized weights scale * (q - zero) need float32 (up to 15 "
                              f"significant bits; {dtype} would round them); use --dtype float32")
        return "int4", self.block_size, accuracy_level


def block_for_group(group: int) -> int:
    """The MatMulNBits block (a power of two, 16 to :data:`MAX_BLOCK`) that tiles a group of ``group`` values:
    each block lies inside one group and takes its scale and zero point. Refused when none divides it."""
    block = MAX_BLOCK
    while block >= 16 and group % block:
        block //= 2
    if block < 16:
        raise ExportError(f"a group of {group} values is not a whole number of MatMulNBits blocks (a power of two "
                          f">= 16 must divide it)")
    return block


def group_size_of(value, method: str) -> int:
    """A config's group size (-1: one group per output row), refused unless whole MatMulNBits blocks tile it."""
    if isinstance(value, bool) or not isinstance(value, int) or (value != -1 and value < 1):
        raise ExportError(f"quantization_config: {method} group_size must be -1 or a positive integer, got {value!r}")
    if value != -1:
        block_for_group(value)
    return value


def require_bits(bits, method: str) -> None:
    """Refuse, in one line, a bit width other than 4."""
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise ExportError(f"quantization_config: {method} bits must be an integer, got {bits!r}")
    if bits != 4:
        raise ExportError(f"a {bits}-bit {method} checkpoint is not read: the exporter takes 4-bit checkpoints' "
                          "own blocks into MatMulNBits (bits 4)")
