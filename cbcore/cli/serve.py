"""`cb serve`: the engine behind an OpenAI-compatible HTTP API (completions, chat, streaming).

The configured policy mix decides who runs; `priority`, `user` (the client id)
and the extension fields `deadline_s` and `attrs` in a request body reach the
policies. Needs the serve extra: pip install 'cbcore[serve]'.
"""

from __future__ import annotations

import argparse
import os
import sys

from cbcore.cli.main import CLIError
from cbcore.cli.options_util import add_engine_flags, build_config, load_model
from cbcore.scale.cli import add_flags as scale_flags

API_KEY_ENV = "CBCORE_API_KEY"
EPILOG = """\
examples:
  cb serve                                    # the default model on http://127.0.0.1:8000
  cb serve --policy priority+chunked --api-key secret --port 9000
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8}'
"""


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = sub.add_parser(
        "serve",
        parents=[common],
        help="serve the model over an OpenAI-compatible HTTP API",
        description=__doc__.splitlines()[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)"
    )
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV})",
    )
    parser.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model name clients send (default: SmolLM2-135M-Instruct, or --model as given)",
    )
    parser.add_argument(
        "--max-waiting", type=int, metavar="N", help="503 beyond N waiting requests (serve.max_waiting)"
    )
    parser.add_argument(
        "--shutdown-grace",
        type=float,
        metavar="S",
        help="seconds in-flight requests get on SIGTERM (serve.shutdown_grace_s)",
    )
    parser.add_argument(
        "--protect-metrics", action="store_true", help="require the API key on /health and /metrics too"
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        metavar="N",
        help="largest request body, refused with 413 while it is read "
        "(serve.max_body_bytes; default: 1 MiB or 32 bytes per context token if more)",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        metavar="S",
        help="close a connection whose request headers are not complete within S seconds "
        "(serve.header_timeout_s, default 10)",
    )
    parser.add_argument(
        "--max-header-bytes",
        type=int,
        metavar="N",
        help="431 when a request's line and headers pass N bytes, before the key is checked "
        "(serve.max_header_bytes, default 65536)",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        metavar="S",
        help="408 when a request body has not all arrived within S seconds (serve.body_timeout_s, default 30)",
    )
    parser.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (per replica with --replicas)")
    add_engine_flags(parser)
    scale_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise CLIError(
            f"cb serve needs the serve extra ({exc.name} is missing): pip install 'cbcore[serve]'"
        ) from None
    if not 0 <= args.port < 65536:
        raise CLIError(f"--port must be in 0..65535, got {args.port}")
    serve_flags = {
        "max_waiting": args.max_waiting,
        "shutdown_grace_s": args.shutdown_grace,
        "protect_metrics": args.protect_metrics or None,
        "max_body_bytes": args.max_body_bytes,
        "header_timeout_s": args.header_timeout,
        "max_header_bytes": args.max_header_bytes,
        "body_timeout_s": args.body_timeout,
    }
    extra = {"serve": {k: v for k, v in serve_flags.items() if v is not None}}
    config = build_config(args, extra)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if config.serve.protect_metrics and api_key is None:
        raise CLIError("--protect-metrics needs an API key (--api-key or $CBCORE_API_KEY)")
    if args.threads is not None and args.threads < 1:
        raise CLIError(f"--threads must be >= 1, got {args.threads}")

    from cbcore.models.default_model import MODEL_NAME
    from cbcore.scale import cli as scale

    name = args.served_model_name or config.model.path or MODEL_NAME
    if scale.wants_replicas(args):
        return scale.run(args, config, name, api_key)
    from cbcore.serve.listen import BindError, bind

    try:
        sockets = bind(args.host, args.port)  # before the model loads: a bad address fails in a moment
    except BindError as exc:
        raise CLIError(str(exc)) from None
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    from cbcore.engine import Engine
    from cbcore.serve.app import build_app
    from cbcore.serve.metrics import policy_label
    from cbcore.serve.server import serve

    try:
        model, tokenizer = load_model(config)
        if tokenizer is None:
            raise CLIError("cb serve needs a model with a tokenizer")
        engine = Engine(model, None, config)  # token ids in, token ids out: the server decodes
        app = build_app(engine, tokenizer, name, config.serve, api_key)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    banner = f"(model {name}, policy {policy_label(config)}, backend {config.backend.name})"
    if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        print(f"cb: warning: serving on {args.host} without an API key", file=sys.stderr)
    return serve(
        app,
        app.state.cb.loop,
        sockets,
        config.serve.shutdown_grace_s,
        args.log_level,
        banner,
        config.serve.header_timeout_s,
        config.serve.max_header_bytes,
    )
