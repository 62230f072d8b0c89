"""The `aioengine` command line: `serve` (engine + HTTP server in one uvloop loop), `bench`, `chat`."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
from typing import TYPE_CHECKING, Any

from aioengine import env
from aioengine.cli.common import (
    add_engine_args,
    engine_args_from,
    named_models,
    parse_bytes,
    run_in_loop,
)

if TYPE_CHECKING:
    from aioengine.config import EngineArgs

logger = logging.getLogger("aioengine.serve")


def parse_origin_list(text: str) -> list[str]:
    """vLLM's form, a JSON list of strings, or a comma-separated list."""
    import json

    text = text.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return items
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_request_limit(text: str) -> tuple[str, int]:
    """'max_n=16' -> ("max_n", 16): one field of aioengine.http.parsing.RequestLimits."""
    from aioengine.http.schema import RequestLimits

    name, _, value = text.partition("=")
    names = [f.name for f in dataclasses.fields(RequestLimits)]
    if name not in names or not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected NAME=N with N >= 1 and NAME one of {', '.join(names)}")
    return name, int(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aioengine", description="An LLM inference engine in one event loop."
    )
    sub = parser.add_subparsers(dest="command", metavar="{serve,bench,chat}")
    serve = sub.add_parser(
        "serve",
        help="serve the OpenAI-compatible API, websocket and chat page",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument("model_tag", nargs="?", metavar="MODEL", help="same as --model")
    srv = serve.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    srv.add_argument(
        "--api-key",
        default=None,  # read from the env later: --help must not print it
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: env AIOENGINE_API_KEY)",
    )
    srv.add_argument(
        "--max-num-queued-reqs",
        type=int,
        default=None,
        help="answer 503 + Retry-After while this many requests wait in the engine",
    )
    srv.add_argument(
        "--max-request-bytes",
        type=parse_bytes,
        default=4 << 20,
        help="largest request body or websocket message (413 beyond)",
    )
    srv.add_argument(
        "--request-limit",
        type=parse_request_limit,
        action="append",
        default=[],
        metavar="NAME=N",
        help="override one per-request cap (docs/api.md), e.g. max_n=16; repeatable",
    )
    for flag, default, what in (
        (
            "--allowed-origins",
            "[]",
            "origins whose pages may call the API (CORS), e.g. '[\"http://localhost:3000\"]'",
        ),
        ("--allowed-methods", '["*"]', "CORS: the methods those pages may use"),
        ("--allowed-headers", '["*"]', "CORS: the request headers those pages may send"),
    ):
        srv.add_argument(
            flag, type=parse_origin_list, default=parse_origin_list(default), help=f"{what} (JSON list)"
        )
    srv.add_argument(
        "--reasoning-parser",
        choices=["qwen3", "deepseek_r1", "openai_gptoss"],
        default=None,
        help="split the reasoning out of the answer (<think> blocks; openai_gptoss: gpt-oss's harmony "
        "analysis channel): reasoning_content in chat, thinking blocks in messages",
    )
    srv.add_argument(
        "--structured-outputs-in-reasoning",
        action="store_true",
        help="with --reasoning-parser: structured outputs constrain the think block too (by default only the "
        "answer after it, as vLLM)",
    )
    srv.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="serve N engine processes (replicas) on this node behind this one port; the cores (or GPUs) are "
        "split between them",
    )
    srv.add_argument(
        "--data-parallel-routing",
        choices=["prefix", "round_robin"],
        default="prefix",
        help="with --data-parallel-size: send a request to the replica holding its longest prefix (unless "
        "loads differ too much), or in turn",
    )
    many = serve.add_argument_group("several models (as Ollama and llama.cpp's router serve them)")
    many.add_argument(
        "--models-dir",
        default=None,
        help="serve every model in this folder: each .gguf file by its name, each Hugging Face folder by its "
        "name (with --model NAME=PATH entries too); each loads on its first request",
    )
    many.add_argument(
        "--max-loaded-models",
        type=int,
        default=None,
        help="models resident at once; the least recently used idle one is unloaded first (default: no cap)",
    )
    many.add_argument(
        "--max-loaded-memory",
        type=parse_bytes,
        default=None,
        help="resident bytes of the loaded models at once, e.g. 8G (each model's own load measured)",
    )
    many.add_argument(
        "--keep-alive",
        default="5m",
        help="how long an idle model stays loaded (a duration or seconds; 0: unload after each reply; "
        "-1: never); a request's keep_alive overrides it",
    )
    srv.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies and credentials")
    srv.add_argument("--log-requests", action="store_true", help="log every request and the access log")
    srv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    srv.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line")
    srv.add_argument("--stats-interval", type=float, default=10.0, help="seconds between stats lines")
    srv.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="on SIGINT/SIGTERM, seconds in-flight requests may take to finish before abort",
    )
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)
    sub.add_parser("bench", help="benchmarks (aioengine bench --help)", add_help=False)
    chat = sub.add_parser("chat", help="chat with a running server in the terminal (over its websocket)")
    chat.add_argument("--url", default="http://127.0.0.1:8000")
    chat.add_argument("--api-key", default=None, help="default: env AIOENGINE_API_KEY")
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--max-tokens", type=int, default=512)
    chat.add_argument("--system", default=None, help="a system prompt")
    chat.set_defaults(func=cmd_chat)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "bench":  # bench owns its own flags
        return cmd_bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv  # the replicas of --data-parallel-size run the same command line
    if args.command is None:
        parser.print_help()
        return 2
    return args.func(args)


def cmd_bench(argv: list[str]) -> int:
    try:
        from aioengine.cli.bench import main as bench_main
    except ImportError as e:
        print(f"aioengine bench is not available in this installation ({e}).", file=sys.stderr)
        return 2
    rc = bench_main(argv)
    return rc if isinstance(rc, int) else 0


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        stream=sys.stderr,
        format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
        datefmt="%m-%d %H:%M:%S",
    )


def cmd_serve(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    try:
        engine_args = engine_args_from(args, named_ok=True)
        engine_args.validate()
        pool = _pool_config(args)
    except ValueError as e:
        print(f"aioengine serve: {e}", file=sys.stderr)
        return 2
    if args.data_parallel_size < 1:
        print("aioengine serve: --data-parallel-size must be at least 1", file=sys.stderr)
        return 2
    if args.data_parallel_size > 1:
        return run_in_loop(_front_main(args))
    config = server_config_from(args)
    if pool is not None:
        return run_in_loop(_serve_pool_main(args, engine_args, config, pool))
    return run_in_loop(_serve_main(args, engine_args, config))


def server_config_from(args: argparse.Namespace) -> Any:
    """The ServerConfig that serve's flags give."""
    from aioengine.http.app import ServerConfig
    from aioengine.http.cors import CorsConfig
    from aioengine.http.schema import RequestLimits

    return ServerConfig(
        api_key=args.api_key or env.api_key(),
        max_num_queued_reqs=args.max_num_queued_reqs,
        client_max_size=args.max_request_bytes,
        served_model_names=args.served_model_name or [],
        log_requests=args.log_requests,
        limits=dataclasses.replace(RequestLimits(), **dict(args.request_limit)),
        reasoning_parser=args.reasoning_parser,
        structured_outputs_in_reasoning=args.structured_outputs_in_reasoning,
        cors=CorsConfig(
            tuple(args.allowed_origins),
            tuple(args.allowed_methods),
            tuple(args.allowed_headers),
            args.allow_credentials,
        ),
    )


def serve_configs(argv: list[str]) -> tuple[EngineArgs, Any]:
    """The EngineArgs and ServerConfig that ``aioengine serve ARGV`` runs one model with (what a Ray Serve
    replica runs); ValueError names a bad flag, or one that only serve's own process can act on."""
    try:
        args = build_parser().parse_args(["serve", *argv])
        engine_args = engine_args_from(args)
    except SystemExit as e:  # argparse has printed why; engine_args_from's says it
        why = e.code if isinstance(e.code, str) else f"not valid `aioengine serve` flags: {' '.join(argv)}"
        raise ValueError(why) from None
    engine_args.validate()
    if args.models_dir is not None or args.data_parallel_size != 1:
        raise ValueError("a replica serves one model: no --models-dir or --data-parallel-size")
    return engine_args, server_config_from(args)


def _pool_config(args: argparse.Namespace) -> Any:
    """The several models to serve (``--models-dir``, ``--model NAME=PATH``), or None for one model."""
    from aioengine.engine.pool import PoolConfig, parse_keep_alive
    from aioengine.model.catalog import scan_models_dir

    named = named_models(args)
    if args.models_dir is None and not named:
        return None
    models = scan_models_dir(args.models_dir) if args.models_dir is not None else {}
    models.update(named)  # an alias, or a model outside the folder
    if not models:
        raise ValueError(f"--models-dir {args.models_dir}: no .gguf file or Hugging Face folder in it")
    if args.data_parallel_size > 1:
        raise ValueError(
            "several models (--models-dir, --model NAME=PATH) run in one process: no --data-parallel-size"
        )
    if args.served_model_name or args.enable_lora:
        raise ValueError(
            "several models are named by their files or NAME=PATH: no --served-model-name or LoRA"
        )
    if args.max_loaded_models is not None and args.max_loaded_models < 1:
        raise ValueError("--max-loaded-models must be at least 1")
    keep = parse_keep_alive(args.keep_alive)
    assert keep is not None
    return PoolConfig(args.max_loaded_models, args.max_loaded_memory, keep, models)


async def _serve_main(args: argparse.Namespace, engine_args: Any, config: Any) -> int:
    from aioengine.engine.async_engine import AsyncEngine
    from aioengine.http.run import install_signal_handlers, serve_engine

    stop = asyncio.Event()
    install_signal_handlers(stop)
    engine = AsyncEngine(engine_args)
    start = asyncio.create_task(engine.start())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait((start, stopped), return_when=asyncio.FIRST_COMPLETED)
    if not start.done():  # a signal while the model loads
        start.cancel()
        await asyncio.gather(start, return_exceptions=True)
        await engine.shutdown()
        return 0
    stopped.cancel()
    error = start.exception()
    if error is not None:
        if isinstance(error, ValueError):  # a bad model path or file, a bad config: its message says it
            print(f"aioengine serve: {error}", file=sys.stderr)
        else:
            logger.error("the engine failed to start", exc_info=error)
        await engine.shutdown()
        return 1
    return await serve_engine(
        engine,
        config,
        args.host,
        args.port,
        stop,
        stats_interval=None if args.disable_log_stats else args.stats_interval,
        shutdown_timeout=args.shutdown_timeout,
        access_log=args.log_requests,
    )


async def _serve_pool_main(args: argparse.Namespace, engine_args: Any, config: Any, pool_config: Any) -> int:
    from aioengine.engine.pool import ModelPool, model_engine_args
    from aioengine.http.run import install_signal_handlers, serve_pool

    stop = asyncio.Event()
    install_signal_handlers(stop)
    pool = ModelPool(pool_config, model_engine_args(engine_args))
    stats = None if args.disable_log_stats else args.stats_interval
    return await serve_pool(
        pool,
        config,
        args.host,
        args.port,
        stop,
        shutdown_timeout=args.shutdown_timeout,
        stats_interval=stats,
        access_log=args.log_requests,
    )


async def _front_main(args: argparse.Namespace) -> int:
    """--data-parallel-size N: N replicas (this command line each) behind a routing front on host:port."""
    from aioengine.http.app import bound_port, start_server
    from aioengine.http.front.proxy import build_front
    from aioengine.http.front.replicas import ReplicaSet, replica_argv
    from aioengine.http.front.router import PrefixRouter
    from aioengine.http.run import install_signal_handlers

    stop = asyncio.Event()
    install_signal_handlers(stop)
    n = args.data_parallel_size
    router = PrefixRouter(n, policy=args.data_parallel_routing)
    replicas = ReplicaSet(
        replica_argv(args.argv), n, on_restart=router.forget, gpus_per_replica=args.tensor_parallel_size
    )
    try:  # whatever ends the front (a second signal included) stops the replicas
        starting = asyncio.create_task(replicas.start())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait((starting, stopped), return_when=asyncio.FIRST_COMPLETED)
        if not starting.done() or starting.exception() is not None:
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            error = None if starting.cancelled() else starting.exception()
            if error is not None:
                print(f"aioengine serve: {error}", file=sys.stderr)
            return 1 if error is not None else 0
        try:
            app = build_front(replicas, router, args.max_request_bytes)
            runner = await start_server(app, args.host, args.port)
        except OSError as e:
            logger.error("cannot listen on %s:%d: %s", args.host, args.port, e)
            return 1
        logger.info(
            "Serving %d replicas on http://%s:%d (%s routing)",
            n,
            args.host,
            bound_port(runner),
            router.policy,
        )
        await stop.wait()
        await runner.cleanup()
        return 0
    finally:
        await replicas.stop()


def cmd_chat(args: argparse.Namespace) -> int:
    from aioengine.cli.chat import chat_repl

    api_key = args.api_key or env.api_key()
    return run_in_loop(chat_repl(args.url, api_key, args.temperature, args.max_tokens, args.system))
