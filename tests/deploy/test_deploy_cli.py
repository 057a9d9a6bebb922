"""`pagedkv serve --ray`: dispatch, flags and their checks (nothing here starts Ray)."""

import pytest

from pagedkv.cli import _resolve
from pagedkv.deploy.cli import direct_ingress_env, flags_to_argv, ray_config
from pagedkv.deploy.ray_serve import SHARED_LOOP_ENV, RayServeConfig, replica_resources
from pagedkv.engine.config import EngineConfig
from pagedkv.errors import ConfigError
from pagedkv.server.cli import build_parser


def test_serve_with_ray_goes_to_the_ray_front_end_with_the_same_flags():
    argv = ["random:tiny-llama", "--ray", "--address", "auto", "--min-replicas", "2", "--max-replicas", "4"]
    module, prog, rest = _resolve(["serve", *argv])
    assert (module, prog, rest) == ("pagedkv.deploy.cli", "pagedkv serve", argv)
    assert _resolve(["serve", "random:tiny-llama"])[0] == "pagedkv.server.cli"
    layout = ray_config(build_parser().parse_args(argv + ["--routing", "least_loaded"]))
    assert (layout.min_replicas, layout.max_replicas, layout.autoscales, layout.routing.value) == \
        (2, 4, True, "least_loaded")
    assert not ray_config(build_parser().parse_args(["--ray", "--min-replicas", "3"])).autoscales
    # Where each replica runs its engine: the flag pagedkv serve takes, else serve's default (decided per replica).
    assert ray_config(build_parser().parse_args(["--ray", "--engine-process"])).engine_process is True
    assert ray_config(build_parser().parse_args(["--ray", "--in-process"])).engine_process is False
    assert ray_config(build_parser().parse_args(["--ray"])).engine_process is None


def test_the_handle_transport_is_grpc_unless_told_and_checked():
    assert RayServeConfig().handle_transport == "grpc" and RayServeConfig(handle_transport="ray").handle_transport == "ray"
    with pytest.raises(ConfigError, match="handle_transport.*'http'"):
        RayServeConfig(handle_transport="http")


@pytest.mark.parametrize("flags, match", [
    (["--data-parallel-size", "2"], "--min-replicas"),
    (["--min-replicas", "3", "--max-replicas", "2"], "min_replicas"),
    (["--address", "10.0.0.1:6379", "--direct-ingress"], "RAY_ADDRESS 10.0.0.1:6379.*RAY_SERVE_ENABLE_DIRECT_INGRESS"),
])
def test_flags_that_do_not_fit_ray_are_refused(flags, match):
    with pytest.raises(ConfigError, match=match):
        ray_config(build_parser().parse_args(["--ray", *flags]))


def test_a_tensor_parallel_replica_reserves_its_gpus_as_one_strict_pack_bundle():
    layout = RayServeConfig(cpus_per_replica=2)
    tp4 = replica_resources(EngineConfig(device="cuda", tensor_parallel_size=4), layout)
    assert tp4["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 4, "runtime_env": {"env_vars": SHARED_LOOP_ENV}}
    assert tp4["placement_group_bundles"] == [{"CPU": 2, "GPU": 4}]
    assert tp4["placement_group_strategy"] == "STRICT_PACK"
    one = replica_resources(EngineConfig(device="cuda"), RayServeConfig(cpus_per_replica=2, shared_loop=False))
    assert one == {"ray_actor_options": {"num_cpus": 2, "num_gpus": 1}}
    assert replica_resources(EngineConfig(device="cpu"), layout)["ray_actor_options"]["num_gpus"] == 0


def test_deployment_args_become_serve_flags():
    argv = flags_to_argv({"model": "m", "max-replicas": 4, "protect_metrics": True, "api-key": None,
                          "ignore-unknown-fields": False})
    assert argv == ["m", "--max-replicas", "4", "--protect-metrics"]


def test_replicas_run_serves_code_on_their_own_loop_unless_told():
    assert RayServeConfig().shared_loop and ray_config(build_parser().parse_args(["--ray"])).shared_loop
    assert not ray_config(build_parser().parse_args(["--ray", "--ray-separate-loops"])).shared_loop
    assert SHARED_LOOP_ENV == {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
                               "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
    with pytest.raises(ConfigError, match="shared_loop.*'yes'"):
        RayServeConfig(shared_loop="yes")
    assert RayServeConfig().ingress_engine_thread  # LoopAsyncEngine is opt-in
    with pytest.raises(ConfigError, match="ingress_engine_thread.*'no'"):
        RayServeConfig(ingress_engine_thread="no")
    assert ray_config(build_parser().parse_args(["--ray"])).replica_engine_thread  # the replica's loop is opt-in
    assert not ray_config(build_parser().parse_args(["--ray", "--ray-replica-on-loop"])).replica_engine_thread
    with pytest.raises(ConfigError, match="replica_engine_thread.*'off'"):
        RayServeConfig(replica_engine_thread="off")


def test_direct_ingress_puts_the_ingress_replica_beside_the_proxys_port():
    assert direct_ingress_env(8000) == {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
                                        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "8001"}


@pytest.mark.parametrize("flag", ["--direct-ingress", "--ray-separate-loops", "--ray-replica-on-loop"])
def test_ray_settings_without_ray_are_refused(flag):
    from pagedkv.server.cli import main

    with pytest.raises(ConfigError, match=f"{flag}.*--ray"):
        main(["random:tiny-llama", "--device", "cpu", flag])


@pytest.mark.parametrize("shared", [True, False])
def test_the_app_binds_both_deployments_with_its_loop_setting_and_a_frozen_engine_heap(shared):
    pytest.importorskip("ray")
    from pagedkv.deploy.ray_serve import build_app

    ingress = build_app(EngineConfig(model="random:tiny-llama", device="cpu"), RayServeConfig(shared_loop=shared))
    ingress = ingress._bound_deployment  # NOTE: Serve's Application keeps the bound deployment privately
    engine = ingress.init_args[0]._bound_deployment
    assert engine.init_kwargs == {"freeze_heap": True, "engine_thread": True}
    for deployment in (ingress, engine):
        assert deployment.ray_actor_options.get("runtime_env") == (
            {"env_vars": SHARED_LOOP_ENV} if shared else None)


def test_direct_ingress_refuses_a_cluster_named_by_ray_address(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    with pytest.raises(ConfigError, match="RAY_ADDRESS 10.0.0.2:6379"):
        ray_config(build_parser().parse_args(["--ray", "--direct-ingress"]))


def test_an_ingress_without_its_engine_thread_needs_the_shared_loop_and_is_bound_so():
    pytest.importorskip("ray")
    from pagedkv.deploy.ray_serve import build_app

    with pytest.raises(ConfigError, match="shared_loop=True"):
        RayServeConfig(shared_loop=False, ingress_engine_thread=False)
    for engine_thread in (True, False):
        app = build_app(EngineConfig(model="random:tiny-llama", device="cpu"),
                        RayServeConfig(ingress_engine_thread=engine_thread))
        assert app._bound_deployment.init_args[-1] is engine_thread  # Ingress(..., engine_thread)
