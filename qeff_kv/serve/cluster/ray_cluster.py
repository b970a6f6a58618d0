"""The Ray cluster under qeff-kv's serving: joining one (``--ray-address``) or starting a local instance that listens
on 127.0.0.1 only, and the actor options of the replicas (CPUs, custom resources). Used by the disaggregated
engine (:mod:`.disagg`) and by the P/D connector of ``--kv-role`` (:mod:`.pd`)."""

from __future__ import annotations

import contextlib
import os
import time

from qeff_kv.errors import MissingDependencyError, RuntimeInputError

#: seconds --ray-address may take to answer a TCP connection before start-up gives up
RAY_CONNECT_TIMEOUT = 5.0
#: seconds start-up waits for the CPUs its replicas need to be free
RESOURCE_WAIT = 20.0
#: the address a local Ray instance started by the engine listens on (never another interface)
LOOPBACK = "127.0.0.1"
#: Ray's switch for a node address on the loopback interface (see :func:`loopback_node`)
_RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
#: Ray's switch for token authentication (``token`` / ``disabled``)
AUTH_MODE_ENV = "RAY_AUTH_MODE"


def ray_module():
    try:
        import ray
    except ImportError:
        raise MissingDependencyError("--disaggregate needs Ray: pip install 'qeff-kv[ray]'") from None
    return ray


def one_line(exc: BaseException) -> str:
    """A failure of a remote call as one line: the remote exception's own message where Ray carries it."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text[:300]}"


def replica_options(ray, section, threads: int | None = None) -> tuple[dict, int]:
    """The Ray actor options of each kind of replica of the disaggregation ``section`` (a
    :class:`~.disagg_config.DisaggregateSection`: CPUs, custom resources, restarts) and the onnxruntime threads of
    each (``threads``, else the cluster's CPUs split between the replicas), once the cluster has the CPUs free (it
    waits up to RESOURCE_WAIT seconds) and the custom resources."""
    n_actors = section.prefill_replicas + section.decode_replicas
    cluster = ray.cluster_resources()
    cpus = float(cluster.get("CPU", 1.0))
    share = min(1.0, cpus / n_actors)
    # onnxruntime threads: the cores split between the replicas, so that they do not oversubscribe them
    threads = threads or max(1, int(cpus // n_actors))
    opts = dict(num_cpus=share, max_restarts=-1, max_task_retries=0)   # restarts budgeted by ReplicaWatch
    out = {}
    for kind, wanted, n in (("prefill", section.prefill_resources, section.prefill_replicas),
                            ("decode", section.decode_resources, section.decode_replicas)):
        out[kind] = dict(opts, resources=checked_resources(kind, wanted, n, cluster)) if wanted else dict(opts)
    need = share * n_actors
    deadline = time.monotonic() + RESOURCE_WAIT   # CPUs of replicas just killed come back within moments
    while ray.available_resources().get("CPU", 0.0) + 1e-6 < need:
        if time.monotonic() > deadline:
            free = ray.available_resources().get("CPU", 0.0)
            raise RuntimeInputError(f"the Ray cluster has {free:g} of {cpus:g} CPUs free; {n_actors} replicas "
                                    f"need {need:g}")
        time.sleep(0.1)
    return out, threads


def checked_resources(kind: str, wanted: dict, replicas: int, cluster: dict) -> dict[str, float]:
    """``--{kind}-resources`` checked against the cluster's resources: one line naming what is missing (Ray would
    leave the replicas pending for ever)."""
    option = f"--{kind}-resources"
    out = {}
    for name, amount in wanted.items():
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0 < amount < float("inf"):
            raise RuntimeInputError(f"{option}: the amount of {name!r} must be a positive number, got {amount!r}")
        if name in ("CPU", "GPU", "memory", "object_store_memory"):
            raise RuntimeInputError(f"{option}: {name!r} is not a custom resource (the replicas' CPUs are set by "
                                    "the engine)")
        have = float(cluster.get(name, 0.0))
        if have + 1e-9 < amount * replicas:
            custom = sorted(k for k in cluster if k not in ("CPU", "GPU", "memory", "object_store_memory")
                            and not k.startswith("node:") and not k.startswith("accelerator_type:"))
            raise RuntimeInputError(f"{option}: {replicas} {kind} replica(s) need {amount * replicas:g} of "
                                    f"{name!r}; the Ray cluster has {have:g} (its custom resources: "
                                    f"{', '.join(custom) or 'none'})")
        out[str(name)] = float(amount)
    return out


#: addresses of a Ray cluster on this machine's loopback interface
LOOPBACK_HOSTS = (LOOPBACK, "localhost")


def on_loopback(address: str | None) -> bool:
    """``address`` (``host:port`` or ``ray://host:port``) names a cluster on the loopback interface."""
    rest = (address or "")[len("ray://"):] if (address or "").startswith("ray://") else (address or "")
    return rest.rpartition(":")[0].strip("[]") in LOOPBACK_HOSTS


def join_or_start(ray, address: str | None) -> bool:
    """Join the cluster at ``address``, or start a local instance (True: this process owns it); nothing when Ray
    already runs in this process. A cluster on 127.0.0.1 is joined as such (:func:`loopback_node`: Ray 2.60's
    driver would otherwise wait for ever for a raylet at the machine's own address)."""
    if ray.is_initialized():
        return False
    kw = dict(include_dashboard=False, logging_level="warning", log_to_driver=False)
    if not address:   # "local": a new instance, whatever a stale ray_current_cluster file or RAY_ADDRESS names
        try:
            with loopback_node(ray):
                ray.init(address="local", num_cpus=os.cpu_count() or 2, _node_ip_address=LOOPBACK, **kw)
        except Exception as exc:   # noqa: BLE001 - Ray's own errors, many lines: one line of ours
            raise RuntimeInputError(f"cannot start a local Ray instance ({one_line(exc)})") from None
        return True
    check_ray_address(address)
    token = use_cluster_token()
    try:
        with loopback_node(ray) if on_loopback(address) else contextlib.nullcontext():
            ray.init(address=address, **kw)
    except Exception as exc:   # noqa: BLE001 - Ray's own errors, many lines: one line of ours
        raise RuntimeInputError(f"--ray-address {address}: cannot join the cluster ({join_failure(exc, token)})") \
            from None
    return False


def use_cluster_token() -> bool:
    """Token authentication as Ray's own CLI uses it (``ray start``, ``ray status``: Ray 2.60's
    ``maybe_enable_token_auth_if_token_available``): with ``RAY_AUTH_MODE`` unset and a token found where Ray looks
    (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``), this process (and what it starts) uses it.
    ``ray start --head`` turns token authentication on when that token exists, but ``ray.init`` given an explicit
    address does not, so without this the join fails. True: token mode is on."""
    mode = os.environ.get(AUTH_MODE_ENV)
    if mode is not None:
        return mode.lower() == "token"
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available as enable)
    except ImportError:   # a Ray without token authentication
        return False
    return bool(enable(warn_if_disabled=False))


def join_failure(exc: BaseException, token: bool) -> str:
    """Why a join failed, in one line; naming token authentication (cause and fix) where it may be the cause."""
    line = one_line(exc)
    if not (isinstance(exc, ConnectionError) or any(w in line.lower() for w in ("auth", "connect"))):
        return line
    if token:
        return (f"{line[:200]}; the cluster may have refused this machine's Ray token: use the cluster's own (copy "
                "its ~/.ray/auth_token here, or set RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH)")
    return (f"{line[:200]}; if the cluster uses token authentication (Ray 2.60's ray start --head turns it on when "
            "~/.ray/auth_token exists), give this machine its token: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or "
            "~/.ray/auth_token")


@contextlib.contextmanager
def loopback_node(ray):
    """While a local Ray instance starts: its node address is 127.0.0.1, so that every process it starts listens
    on the loopback interface only.

    Facts of Ray 2.60: the GCS server, the raylet (node manager and object manager) and each worker's gRPC server
    listen on ``127.0.0.1`` when the node's IP address is ``127.0.0.1``, else on every interface; the runtime-env
    and dashboard agents listen on the node's IP address; ``include_dashboard=False`` starts no dashboard. But
    ``ray.init(_node_ip_address="127.0.0.1")`` replaces a loopback address by the machine's own (``services.
    resolve_ip_for_localhost``) unless ``ray_constants.ENABLE_RAY_CLUSTER`` is false, which the environment variable
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` sets for this process (read when Ray is imported: set here on the module
    too, then put back) and for the processes Ray starts (they inherit the environment while it is set: the GCS
    server, the raylet and the agents now; the raylet hands its environment to the workers it starts later)."""
    constants = ray._private.ray_constants
    before = os.environ.get(_RAY_LOOPBACK_ENV), constants.ENABLE_RAY_CLUSTER
    os.environ[_RAY_LOOPBACK_ENV] = "0"
    constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        constants.ENABLE_RAY_CLUSTER = before[1]
        if before[0] is None:
            os.environ.pop(_RAY_LOOPBACK_ENV, None)
        else:
            os.environ[_RAY_LOOPBACK_ENV] = before[0]


def check_ray_address(address: str) -> None:
    """A ``host:port`` or ``ray://host:port`` address answers a TCP connection within RAY_CONNECT_TIMEOUT seconds
    (Ray itself retries for minutes); ``auto`` and other forms are left to Ray."""
    import socket

    rest = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or not host:
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_CONNECT_TIMEOUT):
            pass
    except OSError as exc:
        raise RuntimeInputError(f"--ray-address {address}: nothing answers there ({exc.strerror or exc}); is the "
                                "Ray cluster running?") from None
