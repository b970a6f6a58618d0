"""The options of ``qeff-kv serve`` as one object made of sections, each living with the wing that reads it and
checking its own values:

=====================  ==================================================  ========================
attribute              section                                             present
=====================  ==================================================  ========================
``http``               :class:`~.http.http_config.HttpSection`              always
``engine``             :class:`~.engine.session_from_config.EngineSection`  always
``sampling``           :class:`~.engine.defaults.SamplingSection`           always
``lora``               :class:`~.engine.lora.LoraSection`                   always
``speculation``        :class:`~.engine.session_from_config.SpeculativeSection`  with ``--speculative``
``disaggregation``     :class:`~.cluster.disagg_config.DisaggregateSection`  with ``--disaggregate``
``events``             :class:`~.cluster.kv_events.KVEventsSection`         with ``--kv-events``
``pd``                 :class:`~.cluster.pd.PDSection`                      with ``--kv-role``
=====================  ==================================================  ========================

An optional section is ``None`` when its switch (its first field) is not given; the options of an absent section
given anyway are refused by :meth:`ServeConfig.check` in one line (each section says which:
``refuse_without``). The construction is flat: ``ServeConfig(export_dir, max_sequences=2, kv_role="both")`` (what
the CLI does with its options, which are named as the sections' fields) fills the sections; ``--ray-address``
belongs to both Ray sections (the disaggregated engine's and the P/D connector's). :meth:`ServeConfig.check`
refuses bad values and combinations once, before anything is loaded; :meth:`ServeConfig.served_model` resolves the
export once, for :func:`qeff_kv.serve.server.serve` to hand down.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from qeff_kv.errors import RuntimeInputError
from qeff_kv.serve.cluster.disagg_config import DisaggregateSection
from qeff_kv.serve.cluster.kv_events import KVEventsSection
from qeff_kv.serve.cluster.pd import PDSection
from qeff_kv.serve.engine.defaults import SamplingSection
from qeff_kv.serve.engine.lora import LoraSection
from qeff_kv.serve.engine.session_from_config import EngineSection, ServedModel, SpeculativeSection, served_model
from qeff_kv.serve.http.http_config import HttpSection

#: the sections in the order of ``qeff-kv serve -h``: (attribute, class, title of its option group, optional)
SECTIONS = (("http", HttpSection, "HTTP server", False),
            ("engine", EngineSection, "Engine", False),
            ("speculation", SpeculativeSection, "Speculative decoding", True),
            ("sampling", SamplingSection, "Sampling defaults (for fields a request leaves out)", False),
            ("lora", LoraSection, "LoRA adapters", False),
            ("disaggregation", DisaggregateSection, "Disaggregated serving (Ray)", True),
            ("events", KVEventsSection, "KV cache events", True),
            ("pd", PDSection, "P/D between servers (vLLM's protocol)", True))


def section_fields(cls) -> tuple[str, ...]:
    """The option names of a section: its fields."""
    return tuple(f.name for f in dataclasses.fields(cls))


#: every flat option (the fields of all sections; ``ray_address`` is in two)
OPTIONS = frozenset(name for _, cls, _, _ in SECTIONS for name in section_fields(cls))


@dataclass(init=False)
class ServeConfig:
    #: the export folder (or .onnx file) to serve; the decode engine's model when disaggregated
    export_dir: str
    http: HttpSection
    engine: EngineSection
    sampling: SamplingSection
    lora: LoraSection
    speculation: SpeculativeSection | None
    disaggregation: DisaggregateSection | None
    events: KVEventsSection | None
    pd: PDSection | None
    #: section attribute -> options of that absent section given anyway (refused by :meth:`check`)
    unread: dict

    def __init__(self, export_dir: str, **options) -> None:
        unknown = sorted(set(options) - OPTIONS)
        if unknown:
            raise TypeError(f"ServeConfig.__init__() got an unexpected keyword argument {unknown[0]!r}")
        self.export_dir = export_dir
        self.unread = {}
        present = {attr: not optional or options.get(cls.SWITCH) not in (None, False)
                   for attr, cls, _, optional in SECTIONS}
        held = {name for attr, cls, _, _ in SECTIONS if present[attr] for name in section_fields(cls)}
        for attr, cls, _, _ in SECTIONS:
            if present[attr]:
                setattr(self, attr, cls(**{k: options[k] for k in section_fields(cls) if k in options}))
                continue
            setattr(self, attr, None)
            defaults = {f.name: f.default for f in dataclasses.fields(cls)}
            given = [k for k in section_fields(cls) if k != cls.SWITCH and k in options and k not in held
                     and options[k] != defaults[k]]
            if given:
                self.unread[attr] = given

    @property
    def disaggregate(self) -> bool:
        """The disaggregated engine serves (``--disaggregate``)."""
        return self.disaggregation is not None

    def served_model(self) -> ServedModel:
        """The export resolved (a one-line error for a bad path), with the name it is served under."""
        names = self.engine.names()
        return served_model(self.export_dir, names[0] if names else None, names[1:],
                            self.engine.accept_any_model_name)

    def check(self) -> None:
        """Refuse bad options before anything is loaded (one line each): the options of absent sections, each
        section's values, and the combinations of sections that do not go together. Creates nothing."""
        self._refuse_unread("disaggregation")
        self.engine.check()
        if self.http.state_dir is not None and self.disaggregate:
            raise RuntimeInputError("--state-dir does not go with --disaggregate (slot actions need the local "
                                    "engine)")
        self.http.check()
        if self.speculation is not None and self.disaggregate:
            raise RuntimeInputError("--speculative does not go with --disaggregate (the decode replicas decode "
                                    "plainly)")
        for attr in ("speculation", "events", "pd"):
            self._refuse_unread(attr)
        self.lora.check()
        if self.lora.allow_runtime_lora_updating and self.disaggregate:
            raise RuntimeInputError("--allow-runtime-lora-updating does not go with --disaggregate (every replica "
                                    "loads the --lora-modules at start)")
        for section in (self.sampling, self.speculation, self.disaggregation, self.events, self.pd):
            if section is not None:
                section.check()
        if self.pd is not None and self.disaggregate:
            raise RuntimeInputError("--kv-role does not go with --disaggregate (a P/D server is one engine; its peer "
                                    "is another qeff-kv serve)")
        if self.pd is not None and self.speculation is not None:
            raise RuntimeInputError("--kv-role does not go with --speculative")
        self._refuse_with_deterministic()

    def _refuse_with_deterministic(self) -> None:
        """``--deterministic`` holds for one local engine decoding plainly: what it cannot guarantee is refused."""
        if not self.engine.deterministic:
            return
        for flag, on in (("--speculative", self.speculation is not None), ("--disaggregate", self.disaggregate),
                         ("--kv-role", self.pd is not None)):
            if on:
                raise RuntimeInputError(f"--deterministic does not go with {flag} (its steps are not the runs a "
                                        "request alone makes)")

    def _refuse_unread(self, attr: str) -> None:
        if attr in self.unread:
            cls = next(c for a, c, _, _ in SECTIONS if a == attr)
            cls.refuse_without(self.unread[attr])
