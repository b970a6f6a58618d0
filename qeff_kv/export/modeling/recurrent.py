"""The recurrent step of a traced graph: each recurrent layer's ``conv_state.{i}`` / ``recurrent_state.{i}``
(contract section 12) read, advanced over one chunk and written back, without a per-token Python loop.

The wrapper (:class:`~qeff_kv.export.wrapper.RetainedStateLM`) builds one :class:`RecurrentStep` per traced step
from the graph's recurrent inputs, and :func:`mixers_routed` routes every mixer module of the model to the traced
form of its kind (:data:`MIXER_STEPS`; ``"mamba2"``: :func:`mamba2_step`; ``"gated_delta"``: Qwen3-Next's and
Qwen3.5's gated delta net, :mod:`.gated_delta`; ``"kda"``: Kimi Linear's and Bailing-Hybrid's Kimi delta attention,
:mod:`.gated_delta`; ``"short_conv"``: LFM2's short convolution, :mod:`.short_conv`)
for the duration of the decoder call.

Invariants of every mixer step:

* **carried state**: a chunk of ``S`` tokens continues from the input state (a prefill chunk after another, a
  decode step after the prompt): the result equals running the whole sequence at once;
* **padding leaves the state untouched**: padded positions (``position_ids == -1``, at the end of a row) add
  nothing to the state and do not decay it, and the convolution state keeps the last ``conv_kernel`` *valid*
  inputs; a row that is all padding (a continuous-batching decode step's idle row) keeps its state bit for bit;
* **padding repeats**: a mixer's output at a padded position is its row's last valid output, as the targets
  make every padded row a copy of its row's last valid token;
* **in place**: each state input has one reader, a ``Gather`` of the step's rows (``batch_index`` under
  continuous batching, else every row), and one updater, a ``ScatterND`` of the new rows into the input that
  produces the retained output; everything the new rows are computed from depends on that Gather, so binding
  one buffer as input and output is safe (:mod:`qeff_kv.graph.inplace`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from qeff_kv.errors import ExportError
from qeff_kv.export.modeling import gated_delta, short_conv
from qeff_kv.export.modeling.graph_ops import ScatterRows


class RecurrentStep:
    """One traced step's recurrent states: ``states[layer] = (conv_state, recurrent_state)`` graph inputs (the
    full ``[kv_batch, ...]`` buffers), the step's rows and which of its positions are valid. After the decoder
    ran, :attr:`retained` holds each layer's retained outputs."""

    def __init__(self, states: dict, is_pad: torch.Tensor, batch_index: torch.Tensor | None, facts):
        self.states = states
        self.facts = facts
        self.valid = ~is_pad                                                     # [B, S]
        #: valid positions per row (they come first in a row: padding is at the end of the last chunk)
        self.n_valid = self.valid.to(torch.int64).sum(dim=1)                     # [B]
        bsz = is_pad.shape[0]
        self.rows = (batch_index.reshape(-1) if batch_index is not None
                     else torch.arange(bsz, dtype=torch.int64))                  # [B] rows of the state buffers
        self.retained: dict[int, tuple] = {}

    def read(self, layer: int) -> list[torch.Tensor]:
        """The step's rows of layer ``layer``'s states (one Gather per buffer: their only reader)."""
        if layer not in self.states:
            raise ExportError(f"layer {layer} runs a recurrent mixer but the state spec gives it no state")
        return [s.index_select(0, self.rows) for s in self.states[layer]]

    def write(self, layer: int, new: list[torch.Tensor]) -> None:
        """Scatter the step's new rows into the state inputs: the retained outputs."""
        idx = self.rows.unsqueeze(-1)
        self.retained[layer] = tuple(ScatterRows.apply(s, idx, n.to(s.dtype))
                                     for s, n in zip(self.states[layer], new))

    def repeat_last_valid(self, out: torch.Tensor) -> torch.Tensor:
        """``out [B, S, H]`` with each padded row replaced by its row's last valid one. The layers after a mixer
        then see padding as the targets make it (a copy of the last valid token), so an attention layer's padded
        rows write the same keys and values as the last valid one into its slot."""
        last = torch.clamp(self.n_valid - 1, min=0).reshape(-1, 1, 1).expand(out.shape[0], 1, out.shape[2])
        return torch.where(self.valid.unsqueeze(-1), out, torch.gather(out, 1, last))

    def outputs(self, layer: int) -> tuple:
        if layer not in self.retained:
            raise RuntimeError(f"layer {layer}'s recurrent mixer did not run")
        return self.retained[layer]


# ------------------------------------------------------------------------------------------------ Mamba2
def causal_conv(conv_old: torch.Tensor, x: torch.Tensor, weight, bias, n_valid: torch.Tensor):
    """The depthwise causal convolution of a chunk continuing from ``conv_old [B, C, K]`` (the last ``K`` inputs
    before it): returns ``(out [B, C, S], new state [B, C, K])``, the new state being the last ``K`` inputs up to
    each row's last valid one."""
    channels, kernel = int(conv_old.shape[1]), int(conv_old.shape[2])
    seq = torch.cat([conv_old.to(x.dtype), x], dim=2)                            # [B, C, K + S]
    out = F.conv1d(seq, weight, bias, groups=channels)[:, :, 1:]                  # [B, C, S]: output t sees K inputs
    start = n_valid.reshape(-1, 1, 1) + torch.arange(kernel, dtype=torch.int64).reshape(1, 1, kernel)
    new = torch.gather(seq, 2, start.expand(seq.shape[0], channels, kernel))
    return out, new


def ssd_chunk(x, dt, A, Bm, Cm, D, state):
    """The state-space dual form of Mamba2 over one chunk, from the carried ``state``.

    ``x [B, S, H, P]``, ``dt [B, S, H]`` (0 at padding), ``A [H]`` (negative), ``Bm``/``Cm [B, S, H, N]``, ``D [H]``,
    ``state [B, H, P, N]``; float32. Returns ``(y [B, S, H, P], new state [B, H, P, N])``: with ``a = dt * A`` and
    ``c_t`` its running sum, ``y_l = sum_{s<=l} (C_l . B_s) exp(c_l - c_s) dt_s x_s + exp(c_l) C_l . state + D x_l``
    and ``state' = exp(c_S) state + sum_s exp(c_S - c_s) dt_s x_s B_s^T``."""
    seq = x.shape[1]
    cum = torch.cumsum(dt * A, dim=1)                                            # [B, S, H]
    pos = torch.arange(seq, dtype=torch.int64)
    causal = (pos.reshape(-1, 1) >= pos.reshape(1, -1)).reshape(1, seq, seq, 1)  # [1, L, S, 1]
    diff = cum.unsqueeze(2) - cum.unsqueeze(1)                                   # [B, L, S, H]
    decay = torch.exp(torch.where(causal, diff, torch.full_like(diff, float("-inf"))))
    xdt = x * dt.unsqueeze(-1)                                                   # [B, S, H, P]
    scores = torch.einsum("blhn,bshn->blsh", Cm, Bm) * decay
    y = torch.einsum("blsh,bshp->blhp", scores, xdt)
    y = y + torch.einsum("blhn,bhpn->blhp", Cm, state) * torch.exp(cum).unsqueeze(-1)
    y = y + D.reshape(1, 1, -1, 1) * x
    last = cum[:, -1:, :]                                                        # [B, 1, H]
    weights = torch.exp(last - cum)                                              # [B, S, H]
    new = state * torch.exp(last).reshape(last.shape[0], -1, 1, 1)
    new = new + torch.einsum("bshp,bshn->bhpn", xdt * weights.unsqueeze(-1), Bm)
    return y, new


def _heads(t: torch.Tensor, groups: int, heads: int, width: int) -> torch.Tensor:
    """``[B, S, groups * width]`` -> ``[B, S, heads, width]`` (each group shared by ``heads / groups`` heads)."""
    b, s = t.shape[0], t.shape[1]
    t = t.reshape(b, s, groups, 1, width).expand(b, s, groups, heads // groups, width)
    return t.reshape(b, s, heads, width)


def mamba2_step(mixer: torch.nn.Module, hidden: torch.Tensor, step: RecurrentStep) -> torch.Tensor:
    """The traced Mamba2 mixer (Mamba2, Bamba, GraniteMoeHybrid, Falcon-H1): the model's own projections, gated
    norm and output projection around :func:`causal_conv` and :func:`ssd_chunk` over the layer's carried state."""
    f = step.facts
    conv_old, ssm_old = step.read(mixer.layer_idx)
    dtype = hidden.dtype
    bsz, seq = hidden.shape[0], hidden.shape[1]
    if f.in_multiplier is not None:
        hidden = hidden * f.in_multiplier
    proj = mixer.in_proj(hidden)
    if f.projection_multipliers:
        proj = proj * mixer.mup_vector
    gate, xbc, dt = proj.split([f.intermediate, f.conv_dim, f.heads], dim=-1)
    conv_out, conv_new = causal_conv(conv_old, xbc.transpose(1, 2), mixer.conv1d.weight, mixer.conv1d.bias,
                                     step.n_valid)
    xbc = mixer.act(conv_out).transpose(1, 2)                                     # [B, S, C]
    gn = f.n_groups * f.d_state
    x, Bm, Cm = xbc.split([f.intermediate, gn, gn], dim=-1)
    dt = F.softplus(dt.float() + mixer.dt_bias.float())
    lo, hi = f.time_step_limit
    if (lo, hi) != (0.0, float("inf")):
        dt = torch.clamp(dt, min=lo, max=hi)
    dt = torch.where(step.valid.unsqueeze(-1), dt, torch.zeros_like(dt))         # padding: no update, no decay
    A = -torch.exp(mixer.A_log.float())
    y, ssm_new = ssd_chunk(x.float().reshape(bsz, seq, f.heads, f.head_dim), dt, A,
                           _heads(Bm.float(), f.n_groups, f.heads, f.d_state),
                           _heads(Cm.float(), f.n_groups, f.heads, f.d_state), mixer.D.float(), ssm_old.float())
    y = y.reshape(bsz, seq, f.intermediate)
    y = mixer.norm(y, gate) if f.gated_norm else y * F.silu(gate)
    step.write(mixer.layer_idx, [conv_new, ssm_new])
    return step.repeat_last_valid(mixer.out_proj(y.to(dtype)))


# ------------------------------------------------------------------------- gated delta net, short conv
def gated_delta_layer(mixer: torch.nn.Module, hidden: torch.Tensor, step: RecurrentStep) -> torch.Tensor:
    """Qwen3-Next's / Qwen3.5's gated delta net over the layer's carried states (:mod:`.gated_delta`); the chunk
    the graph was traced with is the longest it takes (``--prefill-seq-len``)."""
    conv_old, rec_old = step.read(mixer.layer_idx)
    out, conv_new, rec_new = gated_delta.gated_delta_step(mixer, hidden, conv_old, rec_old, step.valid,
                                                          max_len=int(hidden.shape[1]))
    step.write(mixer.layer_idx, [conv_new, rec_new])
    return out


def kda_layer(mixer: torch.nn.Module, hidden: torch.Tensor, step: RecurrentStep) -> torch.Tensor:
    """Kimi Linear's delta attention (per-channel decay) over the layer's carried states (:mod:`.gated_delta`)."""
    conv_old, rec_old = step.read(mixer.layer_idx)
    out, conv_new, rec_new = gated_delta.kda_step(mixer, hidden, conv_old, rec_old, step.valid,
                                                  max_len=int(hidden.shape[1]))
    step.write(mixer.layer_idx, [conv_new, rec_new])
    return out


def short_conv_layer(mixer: torch.nn.Module, hidden: torch.Tensor, step: RecurrentStep) -> torch.Tensor:
    """LFM2's short convolution over the layer's carried ``conv_state`` (:mod:`.short_conv`)."""
    (conv_old,) = step.read(mixer.layer_idx)
    out, conv_new = short_conv.short_conv_step(mixer, hidden, conv_old, step.valid)
    step.write(mixer.layer_idx, [conv_new])
    return out


#: mixer kind (``RecurrentFacts.mixer``) -> the traced step of one layer
MIXER_STEPS = {"mamba2": mamba2_step, "gated_delta": gated_delta_layer, "short_conv": short_conv_layer,
               "kda": kda_layer}
#: mixer kind -> whether a module is the mixer of that kind
_MIXER_PARTS = {"mamba2": ("in_proj", "conv1d", "A_log", "dt_bias", "D", "out_proj", "norm")}
_IS_MIXER = {
    "mamba2": lambda m: all(hasattr(m, p) for p in _MIXER_PARTS["mamba2"]),
    "gated_delta": gated_delta.is_gated_delta_mixer,
    "short_conv": short_conv.is_short_conv_mixer,
    "kda": gated_delta.is_kda_mixer,
}
#: the geometry a mixer module must share with its facts (a module, or the facts), per kind
_MIXER_GEOMETRY = {
    "mamba2": lambda x: ((int(x.conv1d.weight.shape[0]), int(x.conv1d.weight.shape[-1]), int(x.A_log.shape[0]))
                         if isinstance(x, torch.nn.Module) else (x.conv_dim, x.conv_kernel, x.heads)),
    "gated_delta": lambda x: ((int(x.conv1d.weight.shape[0]), int(x.conv1d.weight.shape[-1]), int(x.A_log.shape[0]))
                              if isinstance(x, torch.nn.Module) else (x.conv_dim, x.conv_kernel, x.heads)),
    "short_conv": lambda x: ((int(x.conv.weight.shape[0]), int(x.conv.weight.shape[-1]))
                             if isinstance(x, torch.nn.Module) else (x.conv_dim, x.conv_kernel)),
    "kda": lambda x: (gated_delta.kda_geometry(x) if isinstance(x, torch.nn.Module)
                      else (x.conv_dim, x.conv_kernel, x.heads)),
}


def mixer_modules(model: torch.nn.Module, facts) -> dict[int, torch.nn.Module]:
    """Layer index -> the model's mixer module of ``facts.mixer``'s kind; its geometry must be the config's."""
    is_mixer = _IS_MIXER[facts.mixer]
    found = {}
    for module in model.modules():
        if hasattr(module, "layer_idx") and is_mixer(module):
            found[int(module.layer_idx)] = module
    if tuple(sorted(found)) != tuple(facts.mixer_layers):
        raise ExportError(f"{facts.architecture}: the config names mixer layers {list(facts.mixer_layers)}, the "
                          f"model has mixers in layers {sorted(found)}")
    geometry = _MIXER_GEOMETRY.get(facts.mixer)
    for i, m in found.items():
        if geometry is None:
            continue
        got, want = geometry(m), geometry(facts)
        if got != want:
            raise ExportError(f"{facts.architecture}: layer {i}'s mixer has (conv_dim, conv_kernel, heads) {got}, "
                              f"the config says {want}")
    return found


@contextlib.contextmanager
def _forward_replaced(modules: dict, make):
    for i, m in modules.items():
        m.forward = make(m)
    try:
        yield
    finally:
        for m in modules.values():
            del m.forward


def mixers_routed(model: torch.nn.Module, step: RecurrentStep):
    """Within the context, every mixer of the model runs its traced step over ``step``'s states."""
    run = MIXER_STEPS[step.facts.mixer]
    return _forward_replaced(mixer_modules(model, step.facts),
                             lambda m: (lambda hidden_states, *args, **kwargs: run(m, hidden_states, step)))


def mixers_bypassed(model: torch.nn.Module, facts):
    """Within the context, every mixer returns zeros (the shape probe records only what attention writes)."""
    return _forward_replaced(mixer_modules(model, facts),
                             lambda m: (lambda hidden_states, *args, **kwargs: torch.zeros_like(hidden_states)))


# ------------------------------------------------------------------------------------------ the trace stage
def state_shapes(facts) -> dict:
    """Layer -> the shapes after the batch axis of its recurrent stems (for :func:`~qeff_kv.contract.statespec.for_export`);
    empty without recurrent layers."""
    if facts is None:
        return {}
    return {i: facts.state_shapes for i in facts.mixer_layers}


def state_inputs(layer, kv_batch: int, kv_axis: str, dtype, io) -> list:
    """The zero example inputs of a recurrent layer's states, named and paired in ``io`` (only axis 0 dynamic)."""
    from qeff_kv.contract import naming

    past = []
    for stem, shape in zip(layer.stems, layer.shapes):
        past.append(torch.zeros((kv_batch, *shape), dtype=dtype))
        in_name = naming.kv_input_name(stem, layer.layer)
        out_name = naming.kv_retained_name(stem, layer.layer)
        io.in_names.append(in_name)
        io.out_names.append(out_name)
        io.dyn[in_name] = io.dyn[out_name] = {0: kv_axis}
    return past


def geometry(facts) -> dict:
    """The export's recurrent geometry (manifest ``recurrent``)."""
    return {"mixer": facts.mixer, "mixer_layers": list(facts.mixer_layers),
            "attention_layers": list(facts.attention_layers), "conv_kernel": facts.conv_kernel,
            "conv_dim": facts.conv_dim, "heads": facts.heads, "head_dim": facts.head_dim, "d_state": facts.d_state,
            "n_groups": facts.n_groups}
