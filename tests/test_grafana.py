"""The Grafana dashboards (grafana/): the committed JSON is the generator's, every panel is
complete, every query parses, and every query returns data from a real Prometheus
scraping a simulated node with the shipped recording rules.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import grpc
import pytest
import yaml
from daemon_process import require_tool, running_daemon
from dashboards import DASHBOARDS, REGENERATE, generator, panel_queries, panels, substitute
from servers import Prometheus, Webhook, running_prometheus, serving_pod_resources
from victoria import (
    agent_config,
    running_prometheus_agent,
    running_victoria_metrics,
    running_vmalert,
)

from gpuwatchd.sim.fake_nvml import gpu_uuid
from gpuwatchd.sources.owner import LABELS as OWNER_LABELS
from gpuwatchd.sources.owner.podresources_v1 import api_pb2, api_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
SCENARIO = Path(__file__).resolve().parent / "fixtures" / "scenarios" / "dashboard-evidence.yaml"
RECORDING_RULES = REPO / "deploy" / "prometheus" / "recording.yaml"
JOB_RULES = REPO / "deploy" / "prometheus" / "jobs.yaml"
ALERT_RULES = REPO / "deploy" / "prometheus" / "alerts.yaml"
SCRAPE_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
FLEET, NODE = DASHBOARDS
SIM_NODE, GPUS = "sim-dashboards", 4  # SCENARIO's hostname and GPU count
# the owner the e2e test gives SCENARIO's process (owned_scenario, running_kubelet): a
# torchrun job (its run ID is the job_id) in a Kubernetes pod the kubelet names
JOB_ID = "vit-train-7f3a"
POD_UID = "0b5d7c1e-3f2a-4e8b-9c6d-1a2b3c4d5e6f"
POD = {"namespace": "ml-team", "pod": "train-0", "container": "trainer"}

VARIABLES = {
    FLEET.name: {"datasource", "cluster", "job", "node", "job_id"},
    NODE.name: {"datasource", "job", "node", "gpu"},
}


def sdk_generator():
    """grafana/dashboards.py; it needs grafana-foundation-sdk (Python >= 3.11, [test] extras)."""
    try:
        import grafana_foundation_sdk  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("grafana-foundation-sdk is not installed; .ci/run should install it")
        pytest.skip("grafana-foundation-sdk not installed (Python >= 3.11, the [test] extras)")
    return generator()


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def example_values(node: str = "gpu-node-01:9766") -> dict[str, str]:
    """Values for every dashboard variable: one job, node and job id, All for cluster and
    gpu."""
    return {"cluster": ".*", "job": "gpuwatchd", "node": node, "gpu": ".*", "job_id": JOB_ID}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_committed_json_is_what_the_generator_writes(path: Path):
    assert path.read_text(encoding="utf-8") == sdk_generator().render(path.name), (
        f"{path.relative_to(REPO)} is out of date: run `{REGENERATE}` and commit the result"
    )


def test_the_command_line_checks_the_files_in_another_process():
    """`python -m grafana.dashboards --check`: same bytes under another hash seed."""
    sdk_generator()
    check = subprocess.run(
        [sys.executable, "-m", "grafana.dashboards", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONHASHSEED="12345"),
    )
    assert check.returncode == 0, check.stderr


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_panel_has_targets_a_datasource_variable_and_a_description(path: Path):
    dashboard = load(path)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert set(variables) == VARIABLES[path.name]
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    problems = []
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(dashboard):
        title = panel.get("title") or f"panel {panel['id']}"
        if panel.get("datasource") != {"type": "prometheus", "uid": "${datasource}"}:
            problems.append(f"{title}: datasource is not the $datasource variable")
        if len((panel.get("description") or "").split()) < 8:
            problems.append(f"{title}: no description saying what it shows and how to read it")
        targets = panel.get("targets") or []
        if not targets or not all(t.get("expr") for t in targets):
            problems.append(f"{title}: a panel without a query")
        if len({t.get("refId") for t in targets}) != len(targets):
            problems.append(f"{title}: refIds are not unique")
        plotted = panel["type"] in ("timeseries", "stat", "bargauge")
        if plotted and not panel["fieldConfig"]["defaults"].get("unit"):
            problems.append(f"{title}: no unit")
        for target in targets:
            try:
                substitute(target["expr"], example_values())
            except KeyError as e:
                problems.append(f"{title}: {e}")
    assert not problems, "\n".join(problems)


def test_docs_name_every_panel():
    docs = (REPO / "docs" / "dashboards.md").read_text(encoding="utf-8")
    missing = [
        f"{path.name}: {panel['title']}"
        for path in DASHBOARDS
        for panel in panels(load(path))
        if f"| {panel['title']} |" not in docs
    ]
    assert not missing, "docs/dashboards.md lacks a row for:\n" + "\n".join(missing)


def test_panel_queries_substitutes_grafana_variables(tmp_path: Path):
    assert (
        substitute(
            'rate(x{job=~"$job", node=~"${node}", gpu=~"${gpu:regex}"}[$__rate_interval])',
            {"job": "gpuwatchd", "node": "n1:9766", "gpu": ".*"},
        )
        == 'rate(x{job=~"gpuwatchd", node=~"n1:9766", gpu=~".*"}[1m])'
    )
    assert substitute("increase(x[$__range]) / $__interval", {"__range": "5m"}) == (
        "increase(x[5m]) / 15s"
    )
    assert substitute('label_replace(x, "a", "$1", "b", "(.+)")', {}) == (
        'label_replace(x, "a", "$1", "b", "(.+)")'
    )
    with pytest.raises(KeyError, match=r"\$nodes"):
        substitute('x{node="$nodes"}', {"node": "n1"})
    collapsed = {
        "panels": [
            {
                "type": "row",
                "title": "r",
                "panels": [
                    {
                        "type": "timeseries",
                        "title": "inside",
                        "targets": [{"expr": 'up{job=~"$job"}'}],
                    },
                ],
            },
            {
                "type": "stat",
                "title": "outside",
                "targets": [{"expr": "vector(1)"}, {"refId": "B"}],
            },
        ]
    }
    path = tmp_path / "collapsed.json"
    path.write_text(json.dumps(collapsed))
    assert panel_queries(path, {"job": "j"}) == [
        ("inside", 'up{job=~"j"}'),
        ("outside", "vector(1)"),
    ]
    queries = panel_queries(NODE, example_values())
    assert queries and all("$" not in expr.replace('"$1"', "") for _, expr in queries)
    titles = {title for title, _ in queries}
    assert "Causes on GPU $gpu" in titles  # the repeated panel: one query, all GPUs


def test_every_query_parses_with_promtool(tmp_path: Path):
    """promtool parses each query, variables substituted, as a recording rule's expr."""
    promtool = require_tool("promtool")
    queries = [
        (f"{path.name}: {title}", expr)
        for path in DASHBOARDS
        for title, expr in panel_queries(path, example_values())
    ]
    rules = {
        "groups": [
            {
                "name": "dashboards",
                "rules": [
                    {"record": f"dashboard_query_{i}", "expr": expr}
                    for i, (_, expr) in enumerate(queries)
                ],
            }
        ]
    }
    rule_file = tmp_path / "queries.yaml"
    rule_file.write_text(yaml.safe_dump(rules, width=1000))
    check = subprocess.run(
        [promtool, "check", "rules", str(rule_file)], capture_output=True, text=True
    )
    if check.returncode != 0:  # name the panels: the output only numbers the rules
        index = "\n".join(f"dashboard_query_{i}: {name}" for i, (name, _) in enumerate(queries))
        pytest.fail(f"promtool check rules:\n{check.stdout}{check.stderr}\n{index}")


def test_the_scenario_shows_what_it_says():
    """The e2e test's scenario: its faults fire where and when its `expect` says."""
    check = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "simulate", str(SCENARIO), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-2000:]


def owned_scenario(tmp_path: Path) -> Path:
    """SCENARIO with its training process (pid 7100, on all four GPUs) run by torchrun in
    a Kubernetes pod: POD_UID's container cgroup, in place of the fixture's ad hoc one, and
    torchrun's variables in its environment. From these (and the kubelet's names,
    `running_kubelet`) the daemon's processes source exports each GPU's owner."""
    scenario = yaml.safe_load(SCENARIO.read_text(encoding="utf-8"))
    (process,) = [p for p in scenario["node"]["host"]["processes"] if p["pid"] == 7100]
    del process["cgroup"]  # the pod's replaces it
    process["owner"] = {"pod": {"uid": POD_UID, "qos": "guaranteed"}}
    process["environment"] = {
        "TORCHELASTIC_RUN_ID": JOB_ID,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }
    path = tmp_path / SCENARIO.name
    path.write_text(yaml.safe_dump(scenario, sort_keys=False), encoding="utf-8")
    return path


@contextmanager
def running_kubelet(socket: Path, gpus: list[str]) -> Iterator[None]:
    """A gRPC server implementing the kubelet's pod-resources API on the unix socket
    `socket`: POD's container holds the GPUs `gpus` (UUIDs)."""

    class Kubelet(api_pb2_grpc.PodResourcesListerServicer):
        def List(self, request: object, context: grpc.ServicerContext) -> object:  # noqa: N802
            devices = api_pb2.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=gpus)
            container = api_pb2.ContainerResources(name=POD["container"], devices=[devices])
            pod = api_pb2.PodResources(
                name=POD["pod"], namespace=POD["namespace"], containers=[container]
            )
            return api_pb2.ListPodResourcesResponse(pod_resources=[pod])

    with serving_pod_resources(Kubelet(), socket):
        yield


@pytest.mark.ahead  # waits on real time (tests/ahead.py)
def test_every_panel_query_returns_data(tmp_path: Path):
    """Every target of both dashboards, variables substituted, returns a non-empty result
    from a real Prometheus scraping `gpuwatchd run --simulate` with the recording rules
    and the job rules (deploy/prometheus/jobs.yaml); and from the scale-out path beside it
    (docs/fleet.md): Prometheus in agent mode with the shipped scrape config
    (deploy/prometheus/prometheus.yml as an agent's) remote-writing the same node to
    VictoriaMetrics, where vmalert evaluates the same rules. Every rule's expression
    (recording.yaml, jobs.yaml, alerts.yaml) gives the same series on both.

    The job view joins on gpuwatchd_gpu_owner_info as the daemon exports it: the node
    runs SCENARIO with its process made a torchrun job in a Kubernetes pod
    (owned_scenario), and a real gRPC kubelet names the pod (running_kubelet), so each
    GPU has one owner with a job_id, a namespace and a user (docs/fleet.md). GPU 1's
    Xid (five seconds in) is a cause firing on a GPU of the job.
    """
    scenario = owned_scenario(tmp_path)
    gpus = [gpu_uuid(SIM_NODE, gpu) for gpu in range(GPUS)]
    socket = tmp_path / "kubelet.sock"
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text(
        yaml.safe_dump({"sources": {"processes": {"pod_resources_socket": str(socket)}}})
    )
    vm_path = tmp_path / "victoria-metrics"
    vm_path.mkdir()
    with (
        running_kubelet(socket, gpus),
        running_daemon(str(scenario), "--config", str(config)) as metrics_url,
        ExitStack() as stack,
    ):
        target = urllib.parse.urlparse(metrics_url).netloc
        prometheus = stack.enter_context(running_prometheus(
            tmp_path, {"gpuwatchd": [target]}, rule_files=[RECORDING_RULES, JOB_RULES]))
        store = stack.enter_context(running_victoria_metrics(vm_path))
        stack.enter_context(
            running_prometheus_agent(vm_path, agent_config(SCRAPE_CONFIG, [target], store.base)))
        webhook = stack.enter_context(Webhook())  # jobs.yaml's alerts go somewhere
        stack.enter_context(running_vmalert(
            vm_path, [RECORDING_RULES, JOB_RULES], store.base, webhook.url.rsplit("/", 1)[0]))
        # servers.py labels each target node=host:port; the shipped relabelling, the host
        engines = {"Prometheus": (prometheus, target), "VictoriaMetrics": (store, "127.0.0.1")}
        queries = {
            engine: [
                (f"{path.stem}: {title}", expr)
                for path in DASHBOARDS
                for title, expr in panel_queries(path, example_values(node=node))
            ]
            for engine, (_, node) in engines.items()
        }
        # a rule passes once both give it the same series, and some (the scenario's causes
        # start and stop: the two paths see each change a second or so apart); one that
        # gives none on Prometheus must give none on VictoriaMetrics either
        empty, rules = dict(queries), rule_expressions()
        differ: list[tuple[str, str]] = []
        deadline = time.monotonic() + 45
        while True:
            for engine, (server, _) in engines.items():
                empty[engine] = [(t, e) for t, e in empty[engine] if not server.query(e)]
            found = {name: (same_series(prometheus, expr), same_series(store, expr))
                     for name, expr in rules}
            rules = [(name, expr) for name, expr in rules if not found[name][0]
                     or found[name][0] != found[name][1]]
            differ = [(name, expr) for name, expr in rules if found[name][0] != found[name][1]]
            if not (any(empty.values()) or differ) or time.monotonic() > deadline:
                break
            time.sleep(1)
        owners = {
            s["metric"]["gpu"]: {k: s["metric"].get(k, "") for k in ("uuid", *OWNER_LABELS)}
            for s in prometheus.query(f'gpuwatchd_gpu_owner_info{{instance="{target}"}}')
        }
        shown = {name: {engine: same_series(server, expr)
                        for engine, (server, _) in engines.items()}
                 for name, expr in differ}
    for engine, left in empty.items():
        assert not left, f"{engine}: {len(left)} of {len(queries[engine])} queries returned " \
            "no data:\n" + "\n".join(f"  {title}: {expr}" for title, expr in left)
    assert not differ, "rules whose expression gives other series on VictoriaMetrics:\n" + \
        "\n".join(f"  {name}: {shown[name]}" for name, _ in differ)
    owner = {
        "scheduler": "kubernetes",
        "job_id": JOB_ID,
        "step": "",
        "rank": "0",
        "user": "1000",  # the simulated process's uid: the scenario's user database names none
        **POD,
    }
    assert owners == {str(gpu): {"uuid": uuid, **owner} for gpu, uuid in enumerate(gpus)}


def rule_expressions() -> list[tuple[str, str]]:
    """(name, expr) of every rule of recording.yaml, jobs.yaml and alerts.yaml."""
    return [
        (rule.get("record") or rule["alert"], rule["expr"])
        for path in (RECORDING_RULES, JOB_RULES, ALERT_RULES)
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
    ]


def same_series(server: Prometheus, expr: str) -> list[str]:
    """The series `expr` gives now, as sorted label sets without `node` and `cluster` (the
    two paths label the node differently: servers.py its host:port, the shipped
    relabelling its host and cluster) and without the metric name (MetricsQL drops it
    from `x unless x offset 15m`, PromQL keeps it; a recorded series is renamed and an
    alert's labels have none)."""
    return sorted(
        ",".join(f"{k}={v}" for k, v in sorted(s["metric"].items())
                 if k not in ("node", "cluster", "__name__"))
        for s in server.query(expr)
    )


# The node dashboard's MIG panels (row "GPUs and MIG GPU instances"): on a non-MIG node
# they show the whole GPUs (test_every_panel_query_returns_data); on a MIG node each GPU
# instance as device "<gpu>/<gi>".
MIG_SCENARIO = "mig-dataloader-one-instance-h100"  # 2 GPUs, each a 4g (GI 1) and a 3g (GI 2)
MIG_PANELS = {
    "GPUs and GPU instances: utilization, memory, main process",
    "Owners of GPUs and GPU instances",
    "Utilization per GPU and GPU instance",
    "Memory used vs total per GPU and GPU instance",
}


@pytest.mark.ahead  # waits on real time (tests/ahead.py)
def test_mig_panels_show_each_gpu_instance(tmp_path: Path):
    """On a MIG node (MIG_SCENARIO served by `gpuwatchd run --simulate`, DCGM simulated)
    every target of the MIG panels returns the GPU instances, named "0/1" ... as the
    status page names them, and no whole MIG GPU beside them; the cause matrix gives a
    cause judged on an instance its own row ("(instance N)")."""
    # a rule that fires at once on the instance whose main thread is saturated (GI 2's
    # num_workers=0 rank; the default rule waits out its grace and `for`)
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "rules:\n  - {name: busy_thread, dimension: input, severity: info, for: 0s,\n"
        "     expr: 'gpu_process_busiest_thread_cpu_ratio >= 0.9', summary: busy,\n"
        "     remedy: none}\n"
    )
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text(f"rules_file: {rules}\n")
    with running_daemon(MIG_SCENARIO, "--config", str(config)) as metrics_url:
        target = urllib.parse.urlparse(metrics_url).netloc
        queries = [
            (title, expr)
            for title, expr in panel_queries(NODE, example_values(node=target))
            if title in MIG_PANELS
        ]
        assert {title for title, _ in queries} == MIG_PANELS
        (matrix,) = [
            expr
            for title, expr in panel_queries(NODE, example_values(node=target))
            if title == "Causes on GPU $gpu"
        ]
        with running_prometheus(tmp_path, {"gpuwatchd": [target]}) as prometheus:
            deadline = time.monotonic() + 45
            while True:
                results = {expr: prometheus.query(expr) for _, expr in queries}
                rows = prometheus.query(matrix)
                devices = {
                    expr: {s["metric"].get("device") for s in result}
                    for expr, result in results.items()
                }
                wheres = {s["metric"].get("where") for s in rows}
                done = (
                    all(found >= {"0/1", "0/2", "1/1"} for found in devices.values())
                    and " (instance 2)" in wheres
                )
                if done or time.monotonic() > deadline:
                    break
                time.sleep(1)
    for title, expr in queries:
        found = devices[expr]
        assert {"0/1", "0/2", "1/1"} <= found, f"{title}: {sorted(map(str, found))}: {expr}"
        assert not found & {"0", "1"}, f"{title}: a whole MIG GPU beside its instances"
        for series in results[expr]:
            metric = series["metric"]
            assert metric["device"] == f"{metric['gpu']}/{metric['gpu_instance']}"
            assert metric["profile"] in ("4g.40gb", "3g.40gb")
    assert " (instance 2)" in wheres, sorted(map(str, wheres))
