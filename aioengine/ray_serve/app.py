"""The Serve application: an Ingress deployment (HTTP, no model) over an EngineReplica deployment (one engine
a replica) with the prefix-aware request router, built from Python (`build_app`) or from `serve run`'s
arguments and YAML configs (`app_builder`)."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field, fields
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from aioengine.cli.commands import serve_configs
from aioengine.ray_serve.ingress import Ingress
from aioengine.ray_serve.prefix_index import router_settings
from aioengine.ray_serve.replica import EngineReplica
from aioengine.ray_serve.router import PrefixAwareRouter

ROUTINGS = ("prefix", "pow2")


@dataclass(slots=True)
class RayServeConfig:
    engine_args: list[str] = field(default_factory=list)  # `aioengine serve`'s flags, for every replica
    num_replicas: int | None = 1  # None: autoscaling_config sets the count
    autoscaling_config: dict[str, Any] | None = None  # Serve's (min_replicas, max_replicas, ...)
    replica_cpus: float = 1.0  # each replica's CPUs in Ray (and its threads, unless engine_args set them)
    replica_gpus: float = 0.0
    max_ongoing_requests: int = 256  # a replica's share of requests at once (the engine batches them)
    routing: str = "prefix"  # "prefix": PrefixAwareRouter; "pow2": Serve's power of two choices alone
    stats_period_s: float = 1.0  # how often a replica reports its cached blocks to the router
    router_kwargs: dict[str, Any] = field(default_factory=dict)  # PrefixAwareRouter.initialize_state's
    ingress_replicas: int = 1  # HTTP ingresses: each hashes prompts and relays every streamed chunk

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if self.num_replicas is None and self.autoscaling_config is None:
            raise ValueError("give num_replicas or autoscaling_config")
        if self.num_replicas is not None and self.num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {self.num_replicas}")
        if self.ingress_replicas < 1:
            raise ValueError(f"ingress_replicas must be at least 1, got {self.ingress_replicas}")
        if self.stats_period_s <= 0:
            raise ValueError("stats_period_s must be positive")
        router_settings(self.router_kwargs)  # a misspelt setting fails here, not in each ingress
        # and a bad flag here, not in each replica as Serve starts it again and again
        args, _ = serve_configs(list(self.engine_args))
        if args.kv_events_config is not None:
            raise ValueError(
                "--kv-events-config: a replica's events would bind one port per node for every replica; "
                "a Ray Serve application routes with its own router"
            )


def build_app(config: RayServeConfig) -> serve.Application:
    """The application to `serve.run`: HTTP on the Ingress, generation on the EngineReplica replicas."""
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": config.replica_cpus, "num_gpus": config.replica_gpus},
        "max_ongoing_requests": config.max_ongoing_requests,
        # a replica loads its model before it serves: give slow loads room before Serve gives up on them
        "health_check_period_s": 5,
        "health_check_timeout_s": 30,
    }
    if config.num_replicas is not None and config.autoscaling_config is None:
        options["num_replicas"] = config.num_replicas
    else:
        options["num_replicas"] = "auto"
        options["autoscaling_config"] = config.autoscaling_config
    if config.routing == "prefix":
        router: dict[str, Any] = {
            # by import path: Serve imports it there and pickles its module by value to each handle's process
            "request_router_class": f"{PrefixAwareRouter.__module__}.{PrefixAwareRouter.__qualname__}",
            "request_router_kwargs": config.router_kwargs,
            "request_routing_stats_period_s": config.stats_period_s,
            "request_routing_stats_timeout_s": max(5.0, 2 * config.stats_period_s),
        }
        options["request_router_config"] = RequestRouterConfig(**router)
    engine = serve.deployment(name="EngineReplica", **options)(EngineReplica)
    ingress = serve.deployment(
        name="Ingress",
        num_replicas=config.ingress_replicas,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=4096,
    )(Ingress)
    return ingress.bind(engine.bind(list(config.engine_args)))


def app_builder(args: dict[str, Any]) -> serve.Application:
    """`serve run aioengine.ray_serve:app_builder engine_args="--model default" num_replicas=2`, or a YAML
    config's ``import_path`` with ``args:``: RayServeConfig's fields, as strings from the command line
    (engine_args split as a shell would; the dicts as JSON) or typed values from YAML."""
    known = {f.name for f in fields(RayServeConfig)}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown aioengine.ray_serve arguments {unknown}; known: {sorted(known)}")
    values = dict(args)
    if isinstance(values.get("engine_args"), str):
        values["engine_args"] = shlex.split(values["engine_args"])
    for key in ("autoscaling_config", "router_kwargs"):
        if isinstance(values.get(key), str):
            values[key] = json.loads(values[key])
    for key, kind in (("replica_cpus", float), ("replica_gpus", float), ("stats_period_s", float)):
        if isinstance(values.get(key), str):
            values[key] = kind(values[key])
    for key in ("num_replicas", "max_ongoing_requests", "ingress_replicas"):
        if isinstance(values.get(key), str):
            values[key] = None if values[key] in ("", "none", "auto") else int(values[key])
    return build_app(RayServeConfig(**values))
