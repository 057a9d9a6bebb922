"""The KubeRay RayService manifest parses, and its app is `pagedkv serve` flags that `pagedkv serve` accepts."""

import importlib
from pathlib import Path

import pytest
import yaml

from pagedkv.deploy.cli import flags_to_argv, ray_config
from pagedkv.errors import InvalidArgumentError
from pagedkv.server.cli import build_parser, engine_config, server_config

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "kuberay" / "rayservice.yaml"


def _manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def _application() -> dict:
    serve_config = yaml.safe_load(_manifest()["spec"]["serveConfigV2"])
    (application,) = serve_config["applications"]
    return application


def test_the_manifest_is_a_rayservice_on_the_pinned_ray():
    manifest = _manifest()
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    pinned = next(line.split("==")[1] for line in (ROOT / "constraints.txt").read_text().splitlines()
                  if line.startswith("ray=="))
    assert manifest["spec"]["rayClusterConfig"]["rayVersion"] == pinned


def test_the_application_names_only_flags_pagedkv_serve_accepts():
    application = _application()
    module_name, _, attribute = application["import_path"].partition(":")
    assert callable(getattr(importlib.import_module(module_name), attribute))
    args = build_parser().parse_args(flags_to_argv(application["args"]))  # raises on an unknown flag or value
    engine_config(args), server_config(args)  # and the values make valid configs
    layout = ray_config(args)
    assert layout.max_replicas >= layout.min_replicas >= 1
    # A replica's GPUs (its TP group) fit in one worker pod: STRICT_PACK keeps them on one node.
    workers = _manifest()["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    gpus_per_pod = max(int(w["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
                       for w in workers)
    assert args.tensor_parallel_size <= gpus_per_pod


def test_a_flag_pagedkv_serve_does_not_know_is_caught():
    with pytest.raises(InvalidArgumentError, match="replica-count"):
        build_parser().parse_args(flags_to_argv({**_application()["args"], "replica-count": 4}))
