"""The traceable recurrent mixers (``export/gated_delta.py``, ``export/short_conv.py``) at module level: a step
over chunks, carrying ``conv_state``/``recurrent_state`` from one chunk to the next, equals transformers' own
module run on the whole sequence; right padding (garbage rows after each row's valid tokens) leaves the state
untouched. Seeded random weights, no ONNX."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import Lfm2Config, Qwen3_5TextConfig, Qwen3NextConfig  # noqa: E402
from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet  # noqa: E402

from qeff_kv.export.modeling import gated_delta, short_conv

HIDDEN = 48
GDN = dict(hidden_size=HIDDEN, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
           linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=2,
           layer_types=["linear_attention", "full_attention"])


def _gdn(cls, config_cls, strong_decay: bool):
    torch.manual_seed(0)
    mixer = cls(config_cls(**GDN), 0).eval()
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_(0.0, 0.3)
        # transformers' own init draws A from U(0.01, 16) (decay that empties the state within a few tokens);
        # U(0.01, 1) keeps old tokens alive across chunks, so carrying the state matters
        high = 16.0 if strong_decay else 1.0
        mixer.A_log.copy_(torch.log(torch.empty_like(mixer.A_log).uniform_(0.01, high)))
    return mixer


def _lfm2():
    torch.manual_seed(0)
    mixer = Lfm2ShortConv(Lfm2Config(hidden_size=HIDDEN, conv_L_cache=3, num_hidden_layers=2, conv_bias=True), 0)
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_(0.0, 0.3)
    return mixer.eval()


def _run_chunks(step, states, x, lengths, chunk, seed=1):
    """Run ``x [B, S, H]`` through ``step`` in chunks; ``lengths[c][b]`` valid tokens of row ``b`` in chunk ``c``
    (rows advance independently), each chunk right-padded to ``chunk`` (1 for a decode step) with large random
    rows. Returns each row's outputs at its valid positions, concatenated: ``[B, S, H]``."""
    gen = torch.Generator().manual_seed(seed)
    bsz = x.shape[0]
    pos = [0] * bsz
    outs = [[] for _ in range(bsz)]
    for row_lengths in lengths:
        width = max(chunk if max(row_lengths) > 1 else 1, max(row_lengths))
        rows, valid = [], torch.zeros(bsz, width, dtype=torch.bool)
        for b, n in enumerate(row_lengths):
            pad = torch.randn(width - n, x.shape[-1], generator=gen) * 5.0
            rows.append(torch.cat([x[b, pos[b]:pos[b] + n], pad]))
            valid[b, :n] = True
        out, *states = step(torch.stack(rows), *states, valid)
        for b, n in enumerate(row_lengths):
            outs[b].append(out[b, :n])
            pos[b] += n
    assert all(p == x.shape[1] for p in pos)
    return torch.stack([torch.cat(o) for o in outs]), states


# per chunk, per row: valid tokens (two rows at different lengths; chunks of 16, then decode steps)
SPLITS = {
    "even": [[16, 16], [16, 16], [16, 16], [3, 3], [1, 1], [1, 1]],
    "ragged": [[5, 16], [16, 9], [16, 16], [14, 1], [1, 3], [1, 8]],
    "decode_first": [[1, 1], [1, 1], [16, 16], [16, 16], [16, 16], [3, 3]],
}


@pytest.mark.parametrize("cls, config_cls", [(Qwen3NextGatedDeltaNet, Qwen3NextConfig),
                                             (Qwen3_5GatedDeltaNet, Qwen3_5TextConfig)],
                         ids=["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("strong_decay", [False, True], ids=["slow_decay", "model_init_decay"])
def test_gated_delta_chunks_equal_whole_sequence(cls, config_cls, split, strong_decay):
    mixer = _gdn(cls, config_cls, strong_decay)
    lengths = SPLITS[split]
    total = sum(r[0] for r in lengths)
    x = torch.randn(2, total, HIDDEN, generator=torch.Generator().manual_seed(2))
    shapes = gated_delta.state_shapes(mixer, batch=2)
    assert shapes == {"conv_state": (2, 16 * 2 * 2 + 4 * 8, 4), "recurrent_state": (2, 4, 16, 8)}
    states = [torch.zeros(shapes["conv_state"]), torch.zeros(shapes["recurrent_state"])]

    def step(h, conv, rec, valid):
        return gated_delta.gated_delta_step(mixer, h, conv, rec, valid, max_len=16)

    with torch.no_grad():
        want = mixer(x)
        got, _ = _run_chunks(step, states, x, lengths, chunk=16)
    tol = 1e-4 * max(1.0, want.abs().max().item())
    assert (got - want).abs().max().item() <= tol


def test_gated_delta_final_state_equals_transformers_cache():
    """The state leaving the last chunk is the state transformers' cache holds after the whole sequence."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    mixer = _gdn(Qwen3NextGatedDeltaNet, Qwen3NextConfig, strong_decay=False)
    x = torch.randn(1, 21, HIDDEN, generator=torch.Generator().manual_seed(3))
    shapes = gated_delta.state_shapes(mixer)
    with torch.no_grad():
        conv, rec = torch.zeros(shapes["conv_state"]), torch.zeros(shapes["recurrent_state"])
        for a, b in ((0, 16), (16, 21)):
            n = b - a
            h = torch.cat([x[:, a:b], torch.ones(1, 16 - n, HIDDEN)], 1)
            valid = torch.arange(16).unsqueeze(0) < n
            _, conv, rec = gated_delta.gated_delta_step(mixer, h, conv, rec, valid, max_len=16)
        # transformers' per-token recurrence on the same q, k, v, g, beta gives the reference final state
        conv_in, _, b_, a_ = gated_delta._project(mixer, x)
        mixed = torch.nn.functional.silu(torch.nn.functional.conv1d(
            conv_in, mixer.conv1d.weight, padding=3, groups=mixer.conv_dim)[..., :21]).transpose(1, 2)
        q, k, v = torch.split(mixed, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
        q, k = (t.reshape(1, 21, -1, mixer.head_k_dim) for t in (q, k))
        v = v.reshape(1, 21, -1, mixer.head_v_dim)
        g = -mixer.A_log.float().exp() * torch.nn.functional.softplus(a_.float() + mixer.dt_bias)
        _, want = torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=b_.sigmoid(), output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
    assert (rec - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())
    assert torch.equal(conv, conv_in[..., -4:])   # the convolution's last four inputs, padding ignored


def test_gated_delta_long_chunks_of_slowly_decaying_state_stay_exact():
    """Chunks of 200 tokens (four sub-chunks, the last partial) whose state barely decays: the sub-chunks keep the
    quadratic form's series in float32 range (over one 200-token block it lost the first digits)."""
    mixer = _gdn(Qwen3NextGatedDeltaNet, Qwen3NextConfig, strong_decay=False)
    with torch.no_grad():
        mixer.dt_bias.fill_(-4.0)     # softplus(a - 4): per-token decay close to 1, as in trained checkpoints
        x = torch.randn(1, 400, HIDDEN, generator=torch.Generator().manual_seed(6))
        want = mixer(x)
        shapes = gated_delta.state_shapes(mixer)
        conv, rec, got = torch.zeros(shapes["conv_state"]), torch.zeros(shapes["recurrent_state"]), []
        for start in (0, 200):
            out, conv, rec = gated_delta.gated_delta_step(mixer, x[:, start:start + 200], conv, rec,
                                                          torch.ones(1, 200, dtype=torch.bool), max_len=200)
            got.append(out)
    assert (torch.cat(got, 1) - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())


def test_unit_lower_inverse_is_exact_up_to_max_len():
    gen = torch.Generator().manual_seed(4)
    for size in (1, 2, 5, 16):
        a = torch.randn(3, size, size, generator=gen, dtype=torch.float64).tril(-1) * 0.5
        inv = gated_delta.unit_lower_inverse(a, max_len=16)
        eye = torch.eye(size, dtype=torch.float64)
        assert torch.allclose(inv @ (eye + a), eye.expand(3, -1, -1), atol=1e-9)


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_short_conv_chunks_equal_whole_sequence(split):
    mixer = _lfm2()
    lengths = SPLITS[split]
    total = sum(r[0] for r in lengths)
    x = torch.randn(2, total, HIDDEN, generator=torch.Generator().manual_seed(5))
    assert short_conv.state_shapes(mixer, 2) == {"conv_state": (2, HIDDEN, 3)}

    def step(h, conv, valid):
        return short_conv.short_conv_step(mixer, h, conv, valid)

    with torch.no_grad():
        want = mixer(x)
        got, (conv,) = _run_chunks(step, [torch.zeros(2, HIDDEN, 3)], x, lengths, chunk=16)
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def test_conv_state_keeps_last_valid_inputs():
    """The new conv state is the last ``K`` valid inputs of each row (old state first when fewer were valid);
    a row with no valid token keeps its state."""
    state = torch.arange(2 * 1 * 3, dtype=torch.float32).reshape(2, 1, 3)          # rows [0,1,2] and [3,4,5]
    x = torch.tensor([[[10.0, 11.0, 12.0, 13.0]], [[20.0, 21.0, 22.0, 23.0]]])
    valid = torch.tensor([[True, True, False, False], [False, False, False, False]])
    _, new = short_conv.causal_conv_step(x, state, torch.ones(1, 3), None, valid)
    assert new.tolist() == [[[2.0, 10.0, 11.0]], [[3.0, 4.0, 5.0]]]


def test_mixers_are_recognised():
    assert gated_delta.is_gated_delta_mixer(_gdn(Qwen3NextGatedDeltaNet, Qwen3NextConfig, False))
    assert gated_delta.is_gated_delta_mixer(_gdn(Qwen3_5GatedDeltaNet, Qwen3_5TextConfig, False))
    assert not gated_delta.is_gated_delta_mixer(_lfm2())
    assert short_conv.is_short_conv_mixer(_lfm2())
    assert not short_conv.is_short_conv_mixer(_gdn(Qwen3NextGatedDeltaNet, Qwen3NextConfig, False))


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "lfm2", "lfm2_moe",
                                  "lfm3"])
def test_whole_model_with_routed_mixers_equals_transformers(name):
    """The whole tiny model, its recurrent mixers routed to qeff-kv's steps as the exporter traces them
    (``recurrent.mixers_routed`` over a ``RecurrentStep`` built from the config's facts) and its attention layers
    on transformers' own cache, run in prefill chunks then decode steps: the logits at every position equal
    transformers' forward pass over the whole sequence."""
    from families import RECURRENT_FAMILIES
    from transformers import DynamicCache

    from qeff_kv.export.modeling import recurrent
    from qeff_kv.export.facts.family import ModelFacts

    fam = RECURRENT_FAMILIES[name]
    cfg = getattr(transformers, fam.config_class)(**fam.config_kwargs())
    cfg.architectures = [fam.model_class]
    torch.manual_seed(0)
    model = getattr(transformers, fam.model_class)(cfg).eval()
    facts = ModelFacts.from_config(cfg.to_dict()).recurrent
    assert facts.mixer == ("short_conv" if name.startswith("lfm") else "gated_delta")
    types = fam.config_kwargs()["layer_types"]
    assert facts.mixer_layers == tuple(i for i, t in enumerate(types) if t in ("conv", "linear_attention"))
    assert facts.attention_layers == tuple(i for i, t in enumerate(types) if t in ("full_attention",
                                                                                    "sliding_attention"))
    shapes = recurrent.state_shapes(facts)
    assert len(shapes[0]) == (1 if name.startswith("lfm") else 2)
    states = {i: tuple(torch.zeros((1, *s)) for s in layer) for i, layer in shapes.items()}
    ids = torch.randint(3, 128, (1, 29), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        from qeff_kv.export import transformers_adapter as hf

        cache, got, pos = DynamicCache(config=cfg), [], 0
        for n in (8, 8, 8, 3, 1, 1):
            step = recurrent.RecurrentStep(states, torch.zeros(1, n, dtype=torch.bool), None, facts)
            with recurrent.mixers_routed(model, step):
                got.append(model(ids[:, pos:pos + n], position_ids=torch.arange(pos, pos + n).unsqueeze(0),
                                 use_cache=True, **hf.with_cache(model, cache)).logits)
            states = {i: step.outputs(i) for i in states}
            pos += n
        assert "forward" not in vars(recurrent.mixer_modules(model, facts)[0])      # the model's own is back
    got = torch.cat(got, 1)
    assert (got - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())
    assert len(set(want[0].argmax(-1).tolist())) > 3   # the tokens vary: the comparison proves something


@pytest.mark.parametrize("kind", ["gated_delta", "short_conv"])
def test_padded_rows_repeat_the_last_valid_output(kind):
    """A padded row's output is its row's last valid one (the exporter's padding contract: the attention layer
    after it then writes the same key and value into the same slot)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 6, HIDDEN, generator=gen)
    valid = torch.tensor([[True] * 4 + [False] * 2, [True] * 6])
    with torch.no_grad():
        if kind == "gated_delta":
            mixer = _gdn(Qwen3NextGatedDeltaNet, Qwen3NextConfig, strong_decay=False)
            shapes = gated_delta.state_shapes(mixer, 2)
            out, *_ = gated_delta.gated_delta_step(mixer, x, torch.zeros(shapes["conv_state"]),
                                                   torch.zeros(shapes["recurrent_state"]), valid, max_len=6)
        else:
            mixer = _lfm2()
            out, _ = short_conv.short_conv_step(mixer, x, torch.zeros(2, HIDDEN, 3), valid)
        want = mixer(x[:1, :4])
    assert torch.equal(out[0, 4], out[0, 3]) and torch.equal(out[0, 5], out[0, 3])
    assert (out[0, :4] - want[0]).abs().max().item() <= 1e-5
    assert not torch.equal(out[1, 5], out[1, 3])
