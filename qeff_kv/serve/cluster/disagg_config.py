"""The disaggregation section of the serve options (a section of :class:`qeff_kv.serve.config.ServeConfig`; present
with ``--disaggregate``): prefill replicas hand KV states to decode replicas over Ray (:mod:`.disagg`)."""

from __future__ import annotations

from dataclasses import dataclass

from qeff_kv.errors import RuntimeInputError


@dataclass
class DisaggregateSection:
    #: True: the section is present (the ``--disaggregate`` flag)
    disaggregate: bool = True
    prefill_replicas: int = 1
    decode_replicas: int = 1
    #: the prefill replicas' export (default: export_dir); must share the decode export's KV contract/checkpoint
    prefill_export: str | None = None
    #: an existing Ray cluster ("auto", "ray://host:10001"); None: start a local one (listening on 127.0.0.1 only)
    ray_address: str | None = None
    #: how a request's prefill replica is chosen: "prefix" (the one holding the longest prefix of its prompt, else
    #: the least loaded) or "load" (the least loaded); see qeff_kv.serve.cluster.routing
    route: str = "prefix"
    #: Ray custom resources each prefill / decode replica asks for ({"qeffkv_prefill": 1}): with nodes started with
    #: ``ray start --resources``, this places the replicas on chosen nodes (e.g. prefill and decode on two hosts)
    prefill_resources: dict[str, float] | None = None
    decode_resources: dict[str, float] | None = None

    #: the field whose value turns the section on
    SWITCH = "disaggregate"

    @staticmethod
    def refuse_without(given: list[str]) -> None:
        """Options of the section given while it is absent (``--ray-address`` also goes with ``--kv-role``: given
        with it, it is the P/D section's): refused in one line."""
        if given:
            raise RuntimeInputError("--prefill-replicas, --decode-replicas, --prefill-export, --ray-address, "
                                    "--route, --prefill-resources and --decode-resources go with --disaggregate "
                                    "(--ray-address also with --kv-role)")

    def check(self) -> None:
        """Nothing to refuse before Ray is reached: the replica counts, the exports and the resources are checked
        at start-up (:func:`~.disagg.start_disaggregated`)."""

    def prefill_path(self, decode_path: str) -> str:
        """The prefill replicas' export: ``prefill_export``, else the decode replicas' ``decode_path``."""
        return self.prefill_export or decode_path
