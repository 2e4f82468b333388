"""The applications' config: one file for the engine, the server and the replicas' router.

:class:`~cbcore.config.EngineConfig` holds what the engine reads. A config
file also holds what only the applications read: the ``serve:`` section
(``cb serve``'s admission limits, timeouts and shutdown) and the ``router:``
(which replica serves a request: ``cb serve --replicas`` on Ray Serve and
``cb simulate --replicas``). :class:`Settings` is the whole file; every ``cb``
command loads its config with it, and hands it to the engine as the
EngineConfig it is.
"""

from __future__ import annotations

from pydantic import Field, PositiveInt, model_validator

from cbcore.config import EngineConfig, PluginSpec, Strict, suggests_keys
from cbcore.plugins import get_registry

#: The longest a time limit of the server may be: one day. A longer one is a mistake, and one past what
#: the clocks hold (``1e300``) would only fail once the model has loaded.
MAX_SECONDS = 86_400.0


@suggests_keys
class ServeConfig(Strict):
    """`cb serve` only: admission limits and shutdown; the engine itself ignores this section."""

    max_waiting: PositiveInt | None = 1024  # queued, not running, beyond which new requests get 503; None: no limit
    retry_after_s: int = Field(1, gt=0, le=MAX_SECONDS)  # the Retry-After header of a 503
    shutdown_grace_s: float = Field(30.0, ge=0, le=MAX_SECONDS)  # on SIGTERM/SIGINT, how long requests may still run
    protect_metrics: bool = False  # require the API key on /health and /metrics too
    # The largest request body, enforced while it is read (413 beyond); None: max(1 MiB, 32 bytes per
    # token of the model's context).
    max_body_bytes: PositiveInt | None = None
    header_timeout_s: float = Field(10.0, gt=0, le=MAX_SECONDS)  # for each request's headers to arrive
    # Request line and headers together (431 beyond), counted as they arrive. At most 1 MiB: the HTTP parser
    # joins a header's pieces in time that grows with the square of its length.
    max_header_bytes: int = Field(64 * 1024, ge=1024, le=2**20)
    body_timeout_s: float = Field(30.0, gt=0, le=MAX_SECONDS)  # for a request's whole body to arrive
    # tokenise prompts and render chat templates off the HTTP event loop
    tokenizer_threads: int = Field(2, gt=0, le=256)
    # A step, or a plugin call in it, running longer than this stalls the server: the requests in flight end
    # with an error naming the plugin and method, /health answers 503 until the call returns.
    watchdog_s: float = Field(30.0, gt=0, le=MAX_SECONDS)


@suggests_keys
class Settings(EngineConfig):
    """A whole config file: the engine's sections plus ``serve`` and ``router``.

    It is an EngineConfig, so it goes wherever one does (``Engine(model, tokenizer, settings)``); the
    engine reads only its own sections. Load with ``Settings.from_file(path)``.
    """

    serve: ServeConfig = ServeConfig()
    # Which replica serves a request when several engines share the load (`cb serve --replicas`,
    # simulation with replicas); a single engine never reads it.
    router: PluginSpec = PluginSpec(name="least-loaded")

    @model_validator(mode="after")
    def _check_router(self) -> Settings:
        """The router's name and params, checked against the plugin registry like the engine's plugins."""
        get_registry(tuple(self.plugins)).params_for("router", self.router.name, self.router.params, "router")
        return self
