"""The Ray Serve application: N engine replicas behind the ingress, and running it (`cb serve --replicas`).

Ray places each replica on a node with ``num_cpus`` free (fractions allowed:
two replicas of 0.5 CPU share one core), restarts a replica whose actor
dies or whose health check fails, and keeps the request router fed with
each replica's load every ``load_interval_s``. Joining an existing cluster
(``--ray-address``) runs the same application across its nodes.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from typing import Any

from cbcore.log import get_logger
from cbcore.serve.config import Settings

log = get_logger(__name__)
APP_NAME = "cbcore"


@dataclass(frozen=True)
class ScaleOptions:
    """How the replicas are laid out; everything about one engine stays in the config (``Settings``)."""

    replicas: int = 2
    num_cpus_per_replica: float = 1.0
    num_cpus_ingress: float = 0.0  # the ingress mostly waits on replicas; give it a share on a busy node
    threads: int | None = None  # torch threads per replica (None: torch's default)
    load_interval_s: float = 0.5  # how often each replica's engine_load() reaches the router
    max_ongoing_requests: int = 1024  # per replica; the engine's own queue (serve.max_waiting) is the limit
    health_check_period_s: float = 2.0
    health_check_timeout_s: float = 30.0
    max_attempts: int = 3  # a request that lost its replica before its first token is sent again
    route_timeout_s: float = 60.0
    route_prefix: str = "/"  # one Serve application per prefix: several can share a cluster

    def __post_init__(self) -> None:
        if not re.fullmatch(r"/|(/[A-Za-z0-9_.-]+)+", self.route_prefix):
            raise ValueError(f"route_prefix must be / or a path like /name, got {self.route_prefix!r}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        if self.num_cpus_per_replica <= 0:
            raise ValueError(f"num_cpus_per_replica must be > 0, got {self.num_cpus_per_replica}")
        if self.load_interval_s <= 0:
            raise ValueError(f"load_interval_s must be > 0, got {self.load_interval_s}")


def build_application(
    config: Settings, options: ScaleOptions, model_name: str, api_key: str | None = None
) -> Any:
    """The bound application (deploy it with ``serve.run``)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from cbcore.scale.ingress import Ingress
    from cbcore.scale.replica import EngineReplica
    from cbcore.scale.routing import PluginRequestRouter

    data = config.model_dump(mode="json")
    engines = serve.deployment(
        EngineReplica,
        name="engine",
        num_replicas=options.replicas,
        ray_actor_options={"num_cpus": options.num_cpus_per_replica},
        max_ongoing_requests=options.max_ongoing_requests,
        health_check_period_s=options.health_check_period_s,
        health_check_timeout_s=options.health_check_timeout_s,
        request_router_config=RequestRouterConfig(
            request_router_class=PluginRequestRouter,
            request_router_kwargs={"router": config.router.model_dump(mode="json"), "plugins": list(config.plugins)},
            request_routing_stats_period_s=options.load_interval_s,
            request_routing_stats_timeout_s=max(options.load_interval_s * 4, 5.0),
        ),
    )
    ingress = serve.deployment(
        serve.ingress()(Ingress),
        name="ingress",
        ray_actor_options={"num_cpus": options.num_cpus_ingress},
        max_ongoing_requests=options.max_ongoing_requests * options.replicas,
    )
    return ingress.bind(
        engines.bind(data, options.threads),
        data,
        model_name,
        api_key,
        options.max_attempts,
        options.route_timeout_s,
    )


def start(
    config: Settings,
    options: ScaleOptions,
    model_name: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
) -> str:
    """Deploy on the Ray instance this process is connected to; returns the URL once every replica is up.

    Where Serve already runs on the cluster, its HTTP proxy keeps the host
    and port it was started with, and the URL returned says which.
    Applications under other route prefixes keep running beside this one.
    """
    from ray import serve
    from ray.serve.context import _get_global_client

    if port == 0:
        port = free_port(host)
    serve.start(http_options={"host": host, "port": port})
    app = build_application(config, options, model_name, api_key)
    serve.run(app, name=app_name(options), route_prefix=options.route_prefix)
    http = _get_global_client().http_config  # the proxy's actual options (no public accessor)
    return f"http://{http.host}:{http.port}{options.route_prefix.rstrip('/')}"


def app_name(options: ScaleOptions) -> str:
    """``cbcore`` at ``/``, ``cbcore-one`` at ``/one``."""
    return APP_NAME + options.route_prefix.rstrip("/").replace("/", "-")


def run(
    config: Settings,
    options: ScaleOptions,
    model_name: str,
    *,
    ray_address: str | None = None,
    num_cpus: float | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    ready_line: str = "",
) -> int:
    """`cb serve --replicas N`: start or join Ray, deploy, serve until SIGTERM/SIGINT, then tear down."""
    if not ray_address:
        # A local instance keeps Ray's own services on loopback, not the machine's outward
        # address; Ray reads this when first imported.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from ray import serve

    if config.model.path is None:  # convert the embedded model once here, not in every replica at once
        from cbcore.models.default_model import default_model_dir

        default_model_dir()
    if ray_address:
        ray.init(address=ray_address, log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        url = start(config, options, model_name, host=host, port=port, api_key=api_key)
        print(f"{ready_line}{url} (replicas {options.replicas}, router {config.router.name})", file=sys.stderr, flush=True)
        stop.wait()
        log.warning("shutting down the application")
        serve.delete(app_name(options))
    finally:
        if not ray_address:
            serve.shutdown()
        ray.shutdown()
    return 0


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
