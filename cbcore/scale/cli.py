"""The `cb serve` flags that spread the server over Ray Serve replicas, and what they run."""

from __future__ import annotations

import argparse

from cbcore.serve.config import Settings


def add_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("replicas on Ray Serve (the ray extra: pip install 'cbcore[ray]')")
    group.add_argument(
        "--replicas", type=int, metavar="N", help="N engine replicas behind one ingress, placed by the config's router"
    )
    group.add_argument(
        "--ray-address", metavar="ADDR", help="join this Ray cluster (e.g. 10.0.0.1:6379, or auto) instead of starting one"
    )
    group.add_argument(
        "--cpus-per-replica", type=float, default=1.0, metavar="X", help="Ray CPUs each replica reserves (default 1; fractions allowed)"
    )
    group.add_argument(
        "--ray-cpus", type=float, metavar="X", help="CPUs of the local Ray instance this starts (default: all of this machine)"
    )
    group.add_argument(
        "--route-prefix",
        metavar="PATH",
        help="URL path to serve the application under (default /); applications under different prefixes,"
        " e.g. two policy mixes, share one cluster",
    )
    group.add_argument(
        "--accept-ray-exposure",
        action="store_true",
        help="allow a non-loopback --host or a cluster's --ray-address: Ray's own listeners are then reachable"
        " beyond this machine (docs/scale-out.md, 'What listens where')",
    )
    group.add_argument(
        "--load-interval", type=float, default=0.5, metavar="S", help="seconds between load reports the router reads (default 0.5)"
    )


def wants_replicas(args: argparse.Namespace) -> bool:
    return any(getattr(args, name, None) is not None for name in ("replicas", "ray_address", "route_prefix"))


def run(args: argparse.Namespace, config: Settings, model_name: str, api_key: str | None) -> int:
    from cbcore.cli.main import CLIError
    from cbcore.scale.listeners import exposure

    exposed = exposure(args.host, args.ray_address)  # checked before importing Ray, which takes seconds
    if exposed and not args.accept_ray_exposure:
        raise CLIError(
            f"--replicas with these addresses listens beyond loopback: {exposed}. "
            "Pass --accept-ray-exposure once the network is protected (docs/scale-out.md, 'What listens where')"
        )
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        raise CLIError(f"--replicas needs the ray extra ({exc.name} is missing): pip install 'cbcore[ray]'") from None
    from cbcore.scale.app import ScaleOptions
    from cbcore.scale.app import run as run_app
    from cbcore.serve.server import READY

    try:
        options = ScaleOptions(
            replicas=args.replicas if args.replicas is not None else 1,
            num_cpus_per_replica=args.cpus_per_replica,
            threads=args.threads,
            load_interval_s=args.load_interval,
            route_prefix=args.route_prefix or "/",
        )
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    return run_app(
        config,
        options,
        model_name,
        ray_address=args.ray_address,
        num_cpus=args.ray_cpus,
        host=args.host,
        port=args.port,
        api_key=api_key,
        ready_line=READY,
    )
