"""The application as `serve run` builds it from its arguments (strings from the command line, typed values
from YAML), the mistakes it refuses by name, and the flags a replica's engine gets. No cluster is started."""

from __future__ import annotations

import pytest

from aioengine.cli.commands import serve_configs
from aioengine.ray_serve.replica import replica_flags

serve = pytest.importorskip("ray.serve")


def _deployments(app) -> dict:
    ingress = app._bound_deployment
    return {"Ingress": ingress, "EngineReplica": ingress.init_args[0]._bound_deployment}


def test_command_line_strings_and_yaml_values_build_the_same_application():
    from aioengine.ray_serve import app_builder

    cli = app_builder(
        {"engine_args": "--max-model-len 2048 --model 'my model'", "num_replicas": "3", "replica_cpus": "2"}
        | {"router_kwargs": '{"min_match": 0.25}', "ingress_replicas": "2"}
    )
    yaml = app_builder(
        {
            "engine_args": ["--max-model-len", "2048", "--model", "my model"],
            "num_replicas": 3,
            "replica_cpus": 2,
        }
        | {"router_kwargs": {"min_match": 0.25}, "ingress_replicas": 2}
    )
    for app in (cli, yaml):
        d = _deployments(app)
        engine = d["EngineReplica"]
        assert engine.num_replicas == 3 and engine.ray_actor_options["num_cpus"] == 2.0
        assert engine.init_args[0] == [
            "--max-model-len",
            "2048",
            "--model",
            "my model",
        ]
        router = engine._deployment_config.request_router_config
        assert router.request_router_class == "aioengine.ray_serve.router.PrefixAwareRouter"
        assert router.request_router_kwargs == {"min_match": 0.25}
        assert d["Ingress"].ray_actor_options["num_cpus"] == 0 and d["Ingress"].num_replicas == 2


def test_pow2_keeps_serves_router_and_autoscaling_replaces_the_count():
    from aioengine.ray_serve import app_builder

    engine = _deployments(
        app_builder(
            {"routing": "pow2", "num_replicas": "auto"}
            | {"autoscaling_config": '{"min_replicas": 1, "max_replicas": 4}'}
        )
    )["EngineReplica"]
    assert "PrefixAwareRouter" not in str(
        engine._deployment_config.request_router_config.request_router_class
    )
    assert engine._deployment_config.autoscaling_config.max_replicas == 4


@pytest.mark.parametrize(
    "args, message",
    [
        ({"num_replica": 2}, "unknown aioengine.ray_serve arguments"),
        ({"routing": "random"}, "routing must be one of"),
        ({"num_replicas": "auto"}, "give num_replicas or autoscaling_config"),
        ({"num_replicas": 0}, "at least 1"),
        ({"router_kwargs": {"min_matches": 0.2}}, "unknown router_kwargs"),
        ({"stats_period_s": "0"}, "positive"),
        ({"ingress_replicas": 0}, "ingress_replicas must be at least 1"),
        ({"engine_args": "--no-such-flag"}, "not valid"),
        ({"engine_args": "--kv-events-config '{\"enable_kv_cache_events\": true}'"}, "own router"),
    ],
)
def test_mistakes_are_refused_by_name(args, message):
    from aioengine.ray_serve import app_builder

    with pytest.raises(ValueError, match=message):
        app_builder(args)


def test_a_replicas_threads_are_its_cpus_unless_its_flags_set_them():
    assert replica_flags(["--max-model-len", "64"], 2.0)[-2:] == ["--num-threads", "2"]
    assert replica_flags([], 0.5) == ["--num-threads", "1"]
    assert replica_flags([], None) == [] and replica_flags([], 0) == []
    assert replica_flags(["--num-threads", "3"], 2.0) == ["--num-threads", "3"]
    assert replica_flags(["--num-threads=3"], 2.0) == ["--num-threads=3"]


def test_serve_configs_are_serves_flags_for_one_model():
    engine_args, config = serve_configs(["--max-model-len", "512", "--api-key", "k", "--num-threads", "1"])
    assert engine_args.max_model_len == 512 and engine_args.num_threads == 1 and config.api_key == "k"
    with pytest.raises(ValueError, match="one model"):
        serve_configs(["--data-parallel-size", "2"])
    with pytest.raises(ValueError, match="not valid"):
        serve_configs(["--no-such-flag"])
    with pytest.raises(ValueError, match="NAME=PATH"):
        serve_configs(["--model", "a=/x"])
