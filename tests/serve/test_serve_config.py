"""Issue 48: the serve options in sections that live with their wing. ``ServeConfig`` is the composition of the
sections, built flat from the command line's options; an absent optional section is ``None`` (its options given
anyway: one line at ``check``); the export is resolved once into a ``ServedModel`` handed down (the serve wing's room
order is tests/house/test_architecture.py's)."""

from __future__ import annotations


import pytest

from qeff_kv.errors import RuntimeInputError
from qeff_kv.serve.cluster.disagg_config import DisaggregateSection
from qeff_kv.serve.cluster.kv_events import KVEventsSection
from qeff_kv.serve.cluster.pd import PDSection
from qeff_kv.serve.config import SECTIONS, ServeConfig
from qeff_kv.serve.engine.session_from_config import EngineSection, ServedModel, SpeculativeSection
from qeff_kv.serve.http.http_config import HttpSection


def test_flat_options_fill_the_sections():
    c = ServeConfig("x", max_sequences=2, port=9000, top_k=5, kv_role="both", ray_address="auto")
    assert c.engine == EngineSection(max_sequences=2)
    assert c.http == HttpSection(port=9000)
    assert c.sampling.top_k == 5 and c.sampling.flags()["top_k"] == 5
    assert c.pd == PDSection(kv_role="both", ray_address="auto")   # --ray-address goes to the present Ray section
    assert (c.speculation, c.disaggregation, c.events) == (None, None, None) and not c.disaggregate
    d = ServeConfig("x", disaggregate=True, prefill_replicas=2, ray_address="auto", speculative="lookup")
    assert d.disaggregation == DisaggregateSection(prefill_replicas=2, ray_address="auto") and d.disaggregate
    assert d.speculation == SpeculativeSection("lookup") and d.pd is None
    assert ServeConfig("x", kv_events="tcp://127.0.0.1:5557").events == KVEventsSection("tcp://127.0.0.1:5557")
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_sequence'"):
        ServeConfig("x", max_sequence=2)


def test_options_of_an_absent_section_are_refused_at_check():
    for kw, msg in [({"route": "load"}, "^--prefill-replicas, .* go with --disaggregate"),
                    ({"speculative_k": 2}, "^--speculative-k goes with --speculative$"),
                    ({"kv_events_replay": "tcp://127.0.0.1:1"}, "^--kv-events-replay goes with --kv-events$")]:
        c = ServeConfig("x", **kw)   # made: refused by check, before anything is read
        with pytest.raises(RuntimeInputError, match=msg):
            c.check()
    # given at their defaults (what the command line passes), or left unread as before: no refusal
    ServeConfig("x", prefill_replicas=1, route="prefix", kv_hold_seconds=30.0, kv_events_block_size=32).check()


def test_each_section_checks_its_own_values(tmp_path):
    with pytest.raises(RuntimeInputError, match=r"^--port must be in \[0, 65535\]"):
        HttpSection(port=70000).check()
    with pytest.raises(RuntimeInputError, match="^--model-name must be"):
        EngineSection(model_name=" ").check()
    with pytest.raises(RuntimeInputError, match="^--kv-role must be one of"):
        PDSection(kv_role="middle").check()
    with pytest.raises(RuntimeInputError, match=r"^--kv-hold-seconds must be in \(0, 3600\]"):
        PDSection(kv_role="both", kv_hold_seconds=0).check()
    with pytest.raises(RuntimeInputError, match="^--kv-events"):
        KVEventsSection("nowhere").check()
    with pytest.raises(RuntimeInputError, match="^--state-dir does not go with --disaggregate"):
        ServeConfig("x", disaggregate=True, state_dir=str(tmp_path)).check()
    with pytest.raises(RuntimeInputError, match="^--kv-role does not go with --speculative$"):
        ServeConfig("x", kv_role="both", speculative="lookup").check()
    for _, cls, _, optional in SECTIONS:
        assert callable(cls.check) and (not optional or callable(cls.refuse_without))


def test_the_served_model_is_resolved_once_and_handed_down(tmp_path, monkeypatch):
    """The builders take the ServedModel their caller resolved: given it, they do not resolve the export again."""
    import qeff_kv.runtime.model_files as model_files
    from qeff_kv.serve.server import sampling_defaults

    (tmp_path / "generation_config.json").write_text('{"temperature": 0.3}')
    model = ServedModel(path=str(tmp_path), folder=tmp_path, manifest=None, name="m")

    def no_second_resolution(*a, **k):
        raise AssertionError("the export was resolved again")

    monkeypatch.setattr(model_files, "resolve_model", no_second_resolution)
    defaults = sampling_defaults(ServeConfig(str(tmp_path), top_p=0.5), model)
    assert (defaults.temperature, defaults.top_p) == (0.3, 0.5)
