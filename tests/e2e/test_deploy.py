"""deploy/: the Kubernetes manifests render, validate against the Kubernetes schemas, pass
a security scan, and agree with the server they run (routes, ports, flags, drain timing).

All offline: `kubectl kustomize`, kubernetes-validate's bundled schemas, and checkov from
its own venv (.tools/checkov, made by `tools/setup_env.py --tools-only`: its pins clash
with vLLM's). The CRDs (ServiceMonitor, ScaledObject) are not in the core schemas, and
their projects' schemas are not vendored here: their required fields and references are
checked explicitly. The LeaderWorkerSet of overlays/trn2-multinode is validated against
its CRD's schema, vendored in deploy/crds/.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from unittest.mock import MagicMock

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, latest_version

from tests.conftest import REPO

DEPLOY = REPO / "deploy"
CHECKOV = REPO / ".tools" / "checkov" / "bin" / "checkov"
# The oldest Kubernetes the manifests claim (preStop `sleep` is on by default from 1.30;
# kubectl here is 1.32) and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.32", latest_version())
CRD_KINDS = {"ServiceMonitor", "ScaledObject"}
# What each rendering is: an overlay, or a component no overlay lists, on top of one.
COMPOSITIONS = {
    "trn2": ("trn2", None),
    "emulated": ("emulated", None),
    "trn2+autoscaling": ("trn2", "autoscaling"),
    "trn2+neuron-scheduler": ("trn2", "neuron-scheduler"),
    "trn2+precompile-init": ("trn2", "precompile-init"),
}
LOGICAL_CORES_PER_TRN2_DEVICE = 4  # 8 physical NeuronCores, paired (NEURON_LOGICAL_NC_CONFIG=2)


def _kustomize(path: Path) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(path)], check=True, text=True,
                         capture_output=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    if shutil.which("kubectl") is None:
        pytest.fail("kubectl is needed to render deploy/ (`kubectl kustomize`)")
    out = {}
    for name, (overlay, component) in COMPOSITIONS.items():
        if component is None:
            out[name] = _kustomize(DEPLOY / "overlays" / overlay)
            continue
        # kustomize takes relative paths only.
        root = tmp_path_factory.mktemp(name)
        (root / "kustomization.yaml").write_text(yaml.safe_dump({
            "namespace": "neuron-serve",
            "resources": [os.path.relpath(DEPLOY / "overlays" / overlay, root)],
            "components": [os.path.relpath(DEPLOY / "components" / component, root)]}))
        out[name] = _kustomize(root)
    return out


def _one(objs: list[dict], kind: str) -> dict:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def _pod_specs(objs: list[dict]) -> list[tuple[str, dict]]:
    return [(f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]["spec"])
            for o in objs if o["kind"] in ("Deployment", "Job")]


def _neuron_serve_containers(objs: list[dict]) -> list[tuple[str, dict, dict]]:
    """(where, container, pod spec) of every container running `neuron-serve`."""
    return [(f"{where}/{c['name']}", c, spec) for where, spec in _pod_specs(objs)
            for c in spec.get("initContainers", []) + spec["containers"]
            if c.get("command", [None])[0] == "neuron-serve"]


def _server(objs: list[dict]) -> dict:
    return _one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def test_every_composition_renders(rendered):
    for name, objs in rendered.items():
        kinds = {o["kind"] for o in objs}
        assert {"Namespace", "ServiceAccount", "ConfigMap", "PersistentVolumeClaim", "Deployment",
                "Service", "PodDisruptionBudget", "NetworkPolicy"} <= kinds, name
        assert all(o["metadata"].get("namespace") == "neuron-serve"
                   for o in objs if o["kind"] != "Namespace"), name
        assert any(c["name"] == "precompile" for c in
                   _one(objs, "Deployment")["spec"]["template"]["spec"].get("initContainers", [])
                   ) or "Job" in kinds, f"{name}: nothing precompiles the graphs"
    assert {"ScaledObject", "ServiceMonitor"} <= {o["kind"] for o in rendered["trn2+autoscaling"]}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_objects_validate_against_kubernetes_schemas(rendered, version):
    for name, objs in rendered.items():
        for obj in objs:
            try:
                # strict: unknown fields (a typo, a field of a newer version) fail too
                kubernetes_validate.validate(obj, version, strict=True)
            except SchemaNotFoundError:
                assert obj["kind"] in CRD_KINDS, f"{name}: no schema for {obj['kind']}"
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']} is invalid for "
                            f"Kubernetes {version} at {'.'.join(map(str, exc.path))}: {exc.message}")


def test_custom_resources_have_required_fields_and_point_at_the_server(rendered):
    objs = rendered["trn2+autoscaling"]
    service, deployment = _one(objs, "Service"), _one(objs, "Deployment")
    monitor = _one(objs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    labels = monitor["spec"]["selector"]["matchLabels"]  # required by the CRD
    assert labels.items() <= service["metadata"]["labels"].items()
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in service_ports and endpoint["path"] == "/metrics"

    scaled = _one(objs, "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    (trigger,) = scaled["spec"]["triggers"]  # each: type and metadata required
    assert trigger["type"] == "prometheus"
    meta = trigger["metadata"]
    assert {"serverAddress", "query", "threshold"} <= meta.keys()
    assert float(meta["threshold"]) > 0
    assert f'namespace="{deployment["metadata"]["namespace"]}"' in meta["query"]
    assert f'service="{service["metadata"]["name"]}"' in meta["query"]
    # The metric is one the server exports (vLLM's stat logger registers it).
    metric = re.search(r"(vllm:\w+)", meta["query"]).group(1)
    import vllm.v1.metrics.loggers as loggers
    assert f'"{metric}"' in Path(loggers.__file__).read_text()


def test_security_scan_passes_or_skips_with_a_reason(rendered, multinode, tmp_path):
    if not CHECKOV.exists():
        pytest.fail(f"{CHECKOV} is missing: run `make tools` (tools/setup_env.py --tools-only)")
    for name, objs in {**rendered, "trn2-multinode": multinode}.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump_all(objs))
    proc = subprocess.run([str(CHECKOV), "--directory", str(tmp_path), "--framework", "kubernetes",
                           "--skip-download", "--compact", "--output", "json"],
                          capture_output=True, text=True)
    report = json.loads(proc.stdout)
    summary, results = report["summary"], report["results"]
    failed = [f"{f['check_id']} {f['check_name']}: {f['resource']} ({f['file_path']})"
              for f in results["failed_checks"]]
    assert not failed, "\n".join(failed)
    assert summary["parsing_errors"] == 0 and summary["passed"] > 0
    for skip in results["skipped_checks"]:
        reason = skip["check_result"].get("suppress_comment") or ""
        assert len(reason) > 20, f"{skip['check_id']} on {skip['resource']} is skipped without a reason"
    print(f"checkov: {summary['passed']} passed, {summary['failed']} failed, "
          f"{summary['skipped']} skipped")


def _routes() -> dict[str, set[str]]:
    import asyncio

    from neuron_serve.server.app import build_app

    async def no_serving(*_) -> None:  # the routes exist without vLLM's serving objects
        pass
    app = asyncio.run(build_app(MagicMock(), MagicMock(), init=no_serving))
    return {r.path: r.methods for r in app.routes if hasattr(r, "methods")}


def _flag(args: list[str], name: str) -> str:
    """The value of `--name=V` or `--name V` in a container's args."""
    for i, arg in enumerate(args):
        if arg == name:
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} not in {shlex.join(args)}")


@pytest.mark.parametrize("composition", list(COMPOSITIONS))
def test_probes_ports_and_drain_match_the_server(rendered, composition):
    objs, routes = rendered[composition], _routes()
    deployment = _one(objs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    server = _server(objs)
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert ports == {"http": int(_flag(server["args"], "--port"))}
    for probe, path in (("startupProbe", "/ready"), ("readinessProbe", "/ready"),
                        ("livenessProbe", "/health")):
        get = server[probe]["httpGet"]
        assert get["path"] == path and "GET" in routes[path], probe
        assert get["port"] in ports or get["port"] in ports.values(), probe
    assert "/metrics" in routes
    service = _one(objs, "Service")
    assert all(p["targetPort"] in ports for p in service["spec"]["ports"])
    assert service["spec"]["selector"].items() <= pod_labels(deployment).items()

    # kubelet: preStop, then SIGTERM, then SIGKILL at the grace period. The drain must fit.
    pre_stop = server["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = float(_flag(server["args"], "--drain-timeout"))
    assert pod["terminationGracePeriodSeconds"] == pre_stop + drain
    startup = server["startupProbe"]
    # The budget covers the demo model's cold start on 2 cores with margin: ~90 s for an
    # older 10-graph grid on an AVX512 EPYC, 350 s for 13 and 335 s for today's 17 on an
    # AVX2-only one.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1.5 * 350


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


@pytest.fixture(scope="module")
def cli_parser():
    from neuron_serve.cli import build_parser
    return build_parser()


def _parse(parser, container: dict, pod: dict, objs: list[dict], tmp_path: Path):
    """The container's command line as `neuron-serve` parses it, with the --config file
    read from the rendered ConfigMap it mounts (kubelet's view of the volume)."""
    from neuron_serve.cli import _with_default_model
    from neuron_serve.cli.engine import resolve_model_path
    assert container["command"] == ["neuron-serve"]
    args = list(container["args"])
    config_path = _flag(args, "--config")
    mount = next(m for m in container["volumeMounts"] if config_path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    configmap = next(o for o in objs if o["kind"] == "ConfigMap"
                     and o["metadata"]["name"] == volume["configMap"]["name"])
    local = tmp_path / Path(config_path).name
    local.write_text(configmap["data"][Path(config_path).name])
    args[args.index(config_path)] = str(local)
    parsed = parser.parse_args(_with_default_model(args))
    parsed.model_path = resolve_model_path(parsed)
    return parsed


def _mounted(path: str, container: dict) -> bool:
    return any(path.startswith(m["mountPath"] + "/") for m in container["volumeMounts"])


# Settings that shape the compiled graphs: the precompiling containers must agree with the server.
GRAPH_SETTINGS = ("model_path", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "dtype",
                  "kv_cache_memory_bytes", "tensor_parallel_size", "data_parallel_size",
                  "block_size", "token_buckets",
                  "request_buckets", "block_buckets")


@pytest.mark.parametrize("composition", list(COMPOSITIONS))
def test_commands_parse_and_precompile_the_servers_graphs(rendered, composition, cli_parser,
                                                          tmp_path):
    from neuron_serve.models import DEMO_MODEL_DIR
    objs = rendered[composition]
    runs = [(where, c, _parse(cli_parser, c, pod, objs, tmp_path))
            for where, c, pod in _neuron_serve_containers(objs)]
    (server,) = [r for r in runs if r[2].command == "serve"]
    compilers = [r for r in runs if r[2].command == "compile"]
    assert compilers, "nothing runs `neuron-serve compile`"
    where, container, args = server
    assert args.model_path == str(DEMO_MODEL_DIR) or _mounted(args.model_path, container)
    for key in ("NEURON_SERVE_CACHE_DIR",):
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert _mounted(env[key], container), f"{key} is not on a volume"
    for c_where, c_container, c_args in compilers:
        for key in GRAPH_SETTINGS:
            assert getattr(c_args, key) == getattr(args, key), f"{c_where}: {key} differs"
        # The thread count (from the CPU limit), env and mounts are part of the graphs' world too.
        for field in ("image", "env", "resources", "volumeMounts", "securityContext"):
            assert c_container[field] == container[field], f"{c_where}: {field} differs"

    limits = container["resources"]["limits"]
    cores = (int(limits.get("aws.amazon.com/neuron", 0)) * LOGICAL_CORES_PER_TRN2_DEVICE
             + int(limits.get("aws.amazon.com/neuroncore", 0)))
    if cores:
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["NEURON_LOGICAL_NC_CONFIG"] == "2"
        assert args.tensor_parallel_size * args.data_parallel_size == cores, \
            "one rank per logical NeuronCore"


def test_dockerfile_matches_the_project_and_the_manifests(rendered):
    text = (DEPLOY / "Dockerfile").read_text()
    for line in re.findall(r"^COPY (.+)$", text, re.M):
        for source in line.split()[:-1]:
            assert (REPO / source).exists(), f"COPY {source}: missing"
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1))
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert entrypoint == ["neuron-serve"] and "neuron-serve" in scripts
    user = re.findall(r"^USER (\S+)$", text, re.M)[-1]
    for name, objs in rendered.items():
        for where, spec in _pod_specs(objs):
            assert spec["securityContext"]["runAsUser"] == int(user) != 0, f"{name}: {where}"
    assert "tools/setup_env.py --runtime-only" in text
    assert "--runtime-only" in (REPO / "tools" / "setup_env.py").read_text()
    # The demo model ships in the package the image copies.
    assert (REPO / "neuron_serve" / "models" / "demo" / "config.json").exists()
    ignored = (REPO / ".dockerignore").read_text().split()
    assert all(f"!{src.rstrip('/')}" in [i.rstrip("/") for i in ignored]
               for src in ("pyproject.toml", "tools/setup_env.py", "neuron_serve"))


def test_a_config_file_may_name_the_model(tmp_path):
    """trn2's engine.yaml names the model; `serve --config` without one means the demo."""
    from neuron_serve.cli import _with_default_model
    from neuron_serve.models import DEMO_MODEL_DIR
    named, unnamed = tmp_path / "named.yaml", tmp_path / "unnamed.yaml"
    named.write_text("model: /models/model\n")
    unnamed.write_text("dtype: float32\n")
    assert _with_default_model(["serve", "--config", str(named)]) == ["serve", "--config", str(named)]
    assert _with_default_model(["serve", "--config", str(unnamed)])[1] == str(DEMO_MODEL_DIR)


# ---- overlays/trn2-multinode: a LeaderWorkerSet in place of the Deployment ---------------

LWS_CRD = DEPLOY / "crds" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"


@pytest.fixture(scope="module")
def multinode(rendered) -> list[dict]:
    return _kustomize(DEPLOY / "overlays" / "trn2-multinode")


def _strict(schema: dict) -> dict:
    """The CRD's schema refusing unknown fields, as `kubectl apply` would fail to (the API
    server prunes them without a word): a typo is caught here."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [_strict(v) for v in schema]
    return schema


def _roles(lws: dict) -> dict[str, dict]:
    template = lws["spec"]["leaderWorkerTemplate"]
    return {"leader": template["leaderTemplate"], "worker": template["workerTemplate"]}


def test_multinode_validates_against_the_schemas(multinode):
    import jsonschema

    kinds = [o["kind"] for o in multinode]
    assert "LeaderWorkerSet" in kinds and "Deployment" not in kinds and "Job" not in kinds
    crd = yaml.safe_load(LWS_CRD.read_text())
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    validator = jsonschema.Draft7Validator(_strict(served["schema"]["openAPIV3Schema"]))
    for obj in multinode:
        if obj["kind"] == "LeaderWorkerSet":
            assert obj["apiVersion"] == f"{crd['spec']['group']}/v1"
            errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(obj)]
            assert not errors, "\n".join(errors[:10])
            typo = json.loads(json.dumps(obj))
            typo["spec"]["leaderWorkerTemplate"]["sise"] = 2
            assert any("sise" in e.message for e in validator.iter_errors(typo))
            for role, template in _roles(obj).items():  # the pods, against Kubernetes' own
                pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": role},
                       "spec": template["spec"]}
                kubernetes_validate.validate(pod, K8S_VERSIONS[0], strict=True)
        else:
            kubernetes_validate.validate(obj, K8S_VERSIONS[0], strict=True)


def test_multinode_group_runs_ray_and_the_server_on_the_leader(multinode, cli_parser, tmp_path):
    lws, routes = _one(multinode, "LeaderWorkerSet"), _routes()
    spec = lws["spec"]
    assert spec["startupPolicy"] == "LeaderCreated"  # LeaderReady: the leader waits forever
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    roles = _roles(lws)
    leader, worker = (roles[r]["spec"]["containers"][0] for r in ("leader", "worker"))

    # The leader: Ray's head, then `neuron-serve serve` on Ray over the group's NeuronCores.
    script = leader["args"][0]
    assert "ray start --head --port=6379" in script
    line = " ".join(script.split("exec ", 1)[1].replace("\\\n", " ").split())
    server = {**leader, "command": ["neuron-serve"], "args": shlex.split(line)[1:]}
    args = _parse(cli_parser, server, roles["leader"]["spec"], multinode, tmp_path)
    assert args.command == "serve" and args.distributed_executor_backend == "ray"
    cores = int(leader["resources"]["limits"]["aws.amazon.com/neuroncore"])
    assert args.tensor_parallel_size * args.data_parallel_size == \
        spec["leaderWorkerTemplate"]["size"] * cores, "one rank per NeuronCore of the group"
    assert not args.require_precompiled  # no single-node Job can compile a multi-node world
    assert worker["resources"] == leader["resources"] and worker["image"] == leader["image"]
    assert all("vpc.amazonaws.com/efa" in c["resources"]["limits"] for c in (leader, worker))

    # Workers join the leader's head; probes and clients reach the leader only.
    ports = {p["name"]: p["containerPort"] for p in leader["ports"]}
    assert f'"$LWS_LEADER_ADDRESS:{ports["ray-gcs"]}"' in worker["args"][0]
    assert ports["http"] == int(_flag(args_list := shlex.split(line), "--port")), args_list
    for probe, path in (("startupProbe", "/ready"), ("readinessProbe", "/ready"),
                        ("livenessProbe", "/health")):
        assert leader[probe]["httpGet"]["path"] == path and "GET" in routes[path]
        assert probe not in worker
    selector = _one(multinode, "Service")["spec"]["selector"]
    assert selector.items() <= roles["leader"]["metadata"]["labels"].items()
    assert not selector.items() <= roles["worker"]["metadata"]["labels"].items()
    # The group's pods reach each other on every port (Ray, the collectives).
    ingress = _one(multinode, "NetworkPolicy")["spec"]["ingress"]
    assert {"from": [{"podSelector": {"matchLabels": {
        "leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"]}}}]} in ingress
    # The same engine ConfigMap as the server mounts (hash-suffixed name kept in step).
    names = {o["metadata"]["name"] for o in multinode if o["kind"] == "ConfigMap"}
    for template in roles.values():
        assert {v["configMap"]["name"] for v in template["spec"]["volumes"]
                if "configMap" in v} <= names
