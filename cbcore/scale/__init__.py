"""Replicas of the engine on Ray Serve, behind the OpenAI-compatible ingress, routed by a router plugin.

``cb serve --replicas N`` builds the application in :mod:`cbcore.scale.app`:
N :class:`~cbcore.scale.replica.EngineReplica` deployments (each its own
model, KV cache and policy mix, from one config) behind an ingress that runs
the single-process server's own routes (:mod:`cbcore.scale.ingress`); Ray
Serve's request router calls the configured cbcore router
(:mod:`cbcore.scale.routing`). Needs the ``ray`` extra; of this package the single-process server
imports only the router API (:mod:`cbcore.scale.router`: the load snapshot).
"""
