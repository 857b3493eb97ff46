"""`vitserve serve`: flags, settings, logging, and uvicorn with a drain on SIGTERM.

On the first SIGTERM (or Ctrl-C) the server keeps listening: /ready turns 503 and new /encode calls
get 503 while admitted requests run to completion (at most --request-timeout-s); then uvicorn shuts
down gracefully and the process exits 0. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

import uvicorn

from graphs.budgets import BudgetError, BudgetPlan
from models.presets import DEFAULT_MODEL, PRESETS
from service.engine.core import Engine
from service.http.app import Service, create_app
from service.metrics import Metrics
from service.settings import ServeSettings, SettingsError

log = logging.getLogger("vitserve.server")

# (flag, argparse kwargs); the settings field is the flag in snake case, its variable VITSERVE_<FIELD>.
FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--model", dict(help=f"checkpoint folder or preset ({', '.join(PRESETS)}); default: the embedded "
                          f"{DEFAULT_MODEL} preset")),
    ("--host", dict(help="bind address (default 127.0.0.1)")),
    ("--port", dict(type=int, help="listen port (default 8000; 0 picks a free one)")),
    ("--device", dict(help="auto | cpu | cuda | cuda:N (default auto)")),
    ("--dtype", dict(help="auto | bfloat16 | float16 | float32 (default auto: bf16 on CUDA, fp32 on CPU)")),
    ("--served-model-name", dict(help="model name reported by the API (default: --model)")),
    ("--max-batch-tokens", dict(type=int, help="token budget of the largest batch/graph (default 16384)")),
    ("--budgets", dict(help="comma list of graph token budgets, or auto (default: powers of two)")),
    ("--t-capture", dict(type=int, help="temporal patches per video slot captured in graphs (default 8)")),
    ("--max-wait-ms", dict(type=float, help="how long a batch may wait to fill (default 2)")),
    ("--max-queued-tokens", dict(type=int, help="queue bound in tokens, 429 above (default 8x max batch tokens)")),
    ("--max-concurrent-requests", dict(type=int, help="requests in flight, 429 above (default 512)")),
    ("--max-payload-bytes", dict(type=int, help="request body limit, 413 above (default 64 MiB)")),
    ("--request-timeout-s", dict(type=float, help="per-request timeout, 504 after; also the drain deadline "
                                                  "(default 60)")),
    ("--api-key", dict(help="require 'Authorization: Bearer <key>' on /encode and /info (prefer the "
                            "VITSERVE_API_KEY variable: flags show in process lists)")),
    ("--log-level", dict(help="critical | error | warning | info | debug | trace (default info)")),
    ("--eager", dict(action=argparse.BooleanOptionalAction, help="no CUDA graphs: eager PyTorch only")),
    ("--max-batch-items", dict(type=int, help="items per batch (default: the smallest budget)")),
    ("--max-items-per-request", dict(type=int, help="items per request, 422 above (default 64)")),
    ("--preprocess-workers", dict(type=int, help="decode/preprocess threads (default min(8, cores))")),
    ("--allow-url", dict(action=argparse.BooleanOptionalAction,
                         help="fetch http(s) media URLs whose host is in --allowed-hosts (default off)")),
    ("--allowed-hosts", dict(help="comma list of hosts URLs may name (*.example.com allowed)")),
    ("--url-timeout-s", dict(type=float, help="timeout of one URL fetch (default 10)")),
    ("--ec-shared-storage", dict(help="folder shared with vLLM's encoder-cache connector: encoding_format vllm_ref "
                                      "writes every item (other formats: items with an id) to "
                                      "PATH/<uuid>/encoder_cache.safetensors")),
    ("--ec-max-bytes", dict(type=int, help="bound of the --ec-shared-storage folder; the oldest entries go first "
                                           "(default 8 GiB; 0: unbounded)")),
    ("--cache-bytes", dict(type=int, help="host memory of the encoder-output cache keyed by content id: a repeated "
                                          "item skips decoding and the GPU (default 1 GiB; 0: off)")),
    ("--video-chunking", dict(help="on | off (default off): serve videos longer than --t-capture as exact chunks "
                                   "of t_capture temporal patches through graphs instead of eagerly")),
    ("--data-parallel", dict(help="engines, one per GPU, each in its own process behind this server: a number, or "
                                  "auto for every visible GPU (default 1: one engine in this process)")),
    ("--batch-delay-ms", dict(type=float, help=argparse.SUPPRESS)),  # test hook: a slow engine
]


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, kwargs in FLAGS:
        parser.add_argument(flag, default=None, **kwargs)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """The `serve` subcommand for `vitserve`'s argparse subparsers; runs through `args.func(args)`."""
    parser = subparsers.add_parser(
        "serve", help="run the HTTP server",
        description="Serve POST /encode. Every flag can also be set with VITSERVE_<FLAG_IN_UPPER_SNAKE>; "
                    "the flag wins.")
    add_serve_arguments(parser)
    parser.set_defaults(func=run_from_args)
    return parser


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    flags = {name: getattr(args, name, None) for name in ServeSettings.model_fields}
    return ServeSettings.from_sources(flags)


def configure_logging(level: str) -> None:
    numeric = logging.DEBUG if level == "trace" else getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(level=numeric, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)


def check_plan(settings: ServeSettings) -> None:
    """Refuse bad budget settings before anything loads (the real plan also needs the model)."""
    BudgetPlan.create(max_batch_tokens=settings.max_batch_tokens, budgets=settings.budgets,
                      max_items=settings.max_batch_items, t_capture=settings.t_capture)


def run_from_args(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
        check_plan(settings)
    except (SettingsError, BudgetError) as exc:
        print(f"vitserve serve: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    return serve(settings)


class DrainingServer(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT starting a drain instead of an immediate shutdown."""

    def __init__(self, config: uvicorn.Config, service: Service, drain_timeout: float) -> None:
        super().__init__(config)
        self.service = service
        self.drain_timeout = drain_timeout
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or self._loop is None or not self.started:
            # A second signal, or one before the server is up: stop now.
            self.should_exit = True
            self.force_exit = self.force_exit or sig == signal.SIGINT and self._drain_task is not None
            return
        log.info("signal %s: draining (ready -> 503, in-flight requests finish)", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        await self.service.drain(self.drain_timeout)
        self.should_exit = True

    def fatal(self, reason: str) -> None:
        """Start-up failed (called from the loading thread): exit non-zero."""
        self.exit_code = 1
        self.should_exit = True


SWITCH_INTERVAL_S = 0.0005


def serve(settings: ServeSettings) -> int:
    if settings.model_defaulted:
        log.warning("no --model given: serving the embedded %s preset (random weights, for trying the API)",
                    DEFAULT_MODEL)
    metrics = Metrics()
    engine = Engine(settings, metrics)
    app = create_app(settings, engine=engine, metrics=metrics)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None,
                            log_level=settings.log_level, timeout_graceful_shutdown=10, server_header=False,
                            access_log=settings.log_level in ("debug", "trace"))
    server = DrainingServer(config, app.state.service, settings.request_timeout_s)
    engine.on_fatal = server.fatal
    # The engine thread and the event loop give the GIL up at every device call and must win it back
    # from the preprocessing threads; at the default 5 ms switch interval each such handover can
    # cost up to 5 ms, many times per batch.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    log.info("settings: %s", settings.public_dict())
    server.run()
    return server.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m service.http.server [serve flags]`: the serve subcommand on its own."""
    parser = argparse.ArgumentParser(prog="vitserve-serve", description="vitserve HTTP server")
    add_serve_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
