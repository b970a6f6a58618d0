"""Issue 43, classes 6 and 7 below the HTTP layer: the P/D holder's take against the request (a refusal leaves the
state), its count and byte caps (oldest first; a state larger than the cap not held), the consumer's checks before
anything is taken (:func:`qeff_kv.serve.cluster.pd.prepare` with a recording connector), and a local Ray instance started
as such whatever a stale ``ray_current_cluster`` file names. No Ray needed: the holder's methods run in asyncio,
and Ray itself is a recording stand-in (the live P/D tests are in tests/serve/test_serve_pd.py)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from qeff_kv.errors import KVLoadError, RuntimeInputError
from qeff_kv.serve.cluster.kv_connector import KVConnector, KVHolder
from qeff_kv.serve.wire.openai_io import APIError, Params

TOKENS = json.dumps([1, 2, 3], separators=(",", ":"))


def _run(coro):
    return asyncio.run(coro)


def test_take_refuses_another_prompt_and_leaves_the_state():
    async def go():
        h = KVHolder()
        assert (await h.hold("t", ["ref"], 60, 100, "r", {"tokens": TOKENS})) == {"held": True, "evicted": 0}
        assert await h.take("t", json.dumps([1, 2, 4])) == ("refused", None)
        assert (await h.peek("t"))["tokens"] == TOKENS
        assert await h.take("t", TOKENS) == ("taken", ["ref"])
        assert await h.take("t", TOKENS) == ("missed", None)
        return await h.stats()
    stats = _run(go())
    assert (stats["take_refused"], stats["taken"], stats["missed"], stats["holding"]) == (1, 1, 1, 0)


def test_caps_evict_oldest_first_and_refuse_a_state_larger_than_the_byte_cap():
    async def go():
        h = KVHolder(max_states=2, max_bytes=1000)
        for i in range(3):
            await h.hold(f"t{i}", [i], 60, 100, "r")
        evicted = await h.hold("big", ["b"], 60, 900, "r")        # 2 held (the cap): t1 out, then 100 + 900 fits
        too_big = await h.hold("huge", ["h"], 60, 1001, "r")
        return h, evicted, too_big, await h.stats()
    h, evicted, too_big, stats = _run(go())
    assert evicted == {"held": True, "evicted": 1} and too_big == {"held": False, "evicted": 0}
    assert list(h._held) == ["t2", "big"]
    assert (stats["evicted"], stats["refused"], stats["holding"], stats["holding_bytes"]) == (2, 1, 2, 1000)
    assert _run(KVHolder(max_states=9, max_bytes=1000).hold("x", [], 60, 1000, "r"))["held"]


class _Recording(KVConnector):
    """A consumer whose held state is ``meta``: records what was taken."""

    def __init__(self, meta):
        self.meta, self.taken, self.refused = meta, [], 0

    def peek(self, params):
        if self.meta is None:
            raise KVLoadError("producer p holds no state t")
        return self.meta

    def note_take_refused(self):
        self.refused += 1

    def note_fallback(self):
        pass

    def save(self, request_id, transfer):
        raise AssertionError

    def start_load(self, params):
        self.taken.append(params)
        raise KVLoadError("taken here")

    def wait_load(self, pending, timeout=0):
        raise AssertionError


def _consumer(meta, ids, **kvp):
    from qeff_kv.serve.cluster.pd import prepare

    session = SimpleNamespace(kv_fingerprint="kv", checkpoint="", model_fingerprint="m", ctx_len=64, prefix="")
    engine = SimpleNamespace(connector=_Recording(meta), session=session)
    params = {"do_remote_prefill": True, "remote_engine_id": "p", "transfer_id": "t", **kvp}
    return engine, lambda: prepare(engine, Params(kv_transfer_params=params), ids)


META = {"kv_fingerprint": "kv", "model_identity": "sampled", "checkpoint": "", "model_fingerprint": "m",
        "valid_length": "3", "tokens": TOKENS, "prefix": ""}


@pytest.mark.parametrize("meta, ids, message", [
    (META, [1, 2, 4], "holds another prompt (3 tokens) than this request's (3 tokens)"),
    (dict(META, kv_fingerprint="other"), [1, 2, 3], "saved from a graph with another KV contract"),
    (dict(META, model_fingerprint="other"), [1, 2, 3], "saved from another model"),
    (dict(META, valid_length="99"), [1, 2, 3], "holds 99 positions; this session's capacity is ctx_len=64"),
    ({"tokens": TOKENS}, [1, 2, 3], "malformed state metadata"),
])
def test_the_consumer_checks_the_held_state_before_taking_it(meta, ids, message):
    engine, prepare = _consumer(meta, ids)
    with pytest.raises(APIError) as exc:
        prepare()
    assert exc.value.param == "kv_transfer_params" and message in exc.value.message, exc.value.message
    assert engine.connector.taken == [] and engine.connector.refused == 1


def test_the_request_it_was_made_for_goes_on_to_take_it():
    engine, prepare = _consumer(META, [1, 2, 3])
    assert prepare().answer == {"kv_load": "recomputed", "kv_load_error": "taken here"}
    assert len(engine.connector.taken) == 1 and engine.connector.refused == 0


class _FakeRay:
    """Records ``ray.init``'s arguments; as Ray 2.x, joins whatever a stale ray_current_cluster file names unless
    ``address="local"``."""

    def __init__(self, fail=False):
        self.calls, self.fail = [], fail
        self._private = SimpleNamespace(ray_constants=SimpleNamespace(ENABLE_RAY_CLUSTER=True))

    def is_initialized(self):
        return False

    def init(self, address=None, **kw):
        self.calls.append(dict(kw, address=address))
        if address != "local":
            raise ValueError("When connecting to an existing cluster, num_cpus and num_gpus must not be provided.")
        if self.fail:
            raise RuntimeError("raylet failed to start\nline two")


def test_a_local_ray_instance_is_started_as_such():
    from qeff_kv.serve.cluster.ray_cluster import join_or_start

    ray = _FakeRay()
    assert join_or_start(ray, None) is True
    assert ray.calls[0]["address"] == "local" and ray.calls[0]["_node_ip_address"] == "127.0.0.1"
    with pytest.raises(RuntimeInputError) as exc:
        join_or_start(_FakeRay(fail=True), None)
    assert str(exc.value) == "cannot start a local Ray instance (RuntimeError: raylet failed to start line two)"
