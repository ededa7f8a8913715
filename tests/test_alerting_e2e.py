"""From a node to a page, with the real servers: simulated gpuwatchd nodes, a Prometheus
loaded with the shipped alert and recording rules, an Alertmanager with the shipped
route, and a webhook standing in for the pager and the ticket system.

Four nodes run at once in real time: one whose GPU 3 link trains down to Gen3 under load,
one whose job hangs in an NCCL collective and then resumes, and the healthy and idle
built-in nodes. The scenarios are the built-in ones with their phases shortened, and the
`for` of every daemon rule and every alert is cut to a few seconds (the promtool unit tests
in tests/prometheus/ check the shipped `for`); everything else is as shipped.
"""

from __future__ import annotations

import re
import time
import urllib.parse
from contextlib import ExitStack
from pathlib import Path

import pytest
import yaml
from daemon_process import running_daemon, shorten
from servers import Webhook, running_alertmanager, running_prometheus, wait_until

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SHORT_FOR = 5.0  # seconds: the `for` of daemon rules and alerts in this test

# onset and end of each fault in the shortened scenarios, in seconds from the start (the
# stall outlasts the 13-21 s from its onset to the page on a loaded machine twice over)
PCIE_ONSET, NCCL_ONSET, NCCL_END = 10, 10, 55



def _seconds(value: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return float(value[:-1]) * units[value[-1]] if value[-1] in units else float(value)


def short_rules(tmp_path: Path) -> Path:
    """The default rules with every `for` and `keep_firing_for` cut to SHORT_FOR."""
    rules = yaml.safe_load((ROOT / "gpuwatchd" / "rules" / "default.yaml").read_text())
    for rule in rules["rules"]:
        for key in ("for", "keep_firing_for"):
            if key in rule and _seconds(str(rule[key])) > SHORT_FOR:
                rule[key] = f"{SHORT_FOR:g}s"
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    return path


def short_alerts(tmp_path: Path) -> Path:
    alerts = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    for group in alerts["groups"]:
        for rule in group["rules"]:
            # not an absent() alert: absent until Prometheus's first scrape lands, it would
            # fire within seconds of the start on a loaded machine
            if "absent(" not in rule["expr"]:
                rule["for"] = f"{SHORT_FOR:g}s"
    path = tmp_path / "alerts.yaml"
    path.write_text(yaml.safe_dump(alerts, sort_keys=False))
    return path


def alertmanager_config(webhook: Webhook) -> dict:
    """The shipped route, delivering to the webhook, with timers in seconds: group_interval
    2 s, group_wait 1 s, or 2 s where the route waits 30 s for a second rule evaluation
    (Prometheus evaluates every second here, every 15 s as shipped)."""
    config = yaml.safe_load((DEPLOY / "alertmanager" / "alertmanager.yaml").read_text())
    routes = [config["route"]]
    for route in routes:
        routes += route.get("routes", [])
        if "group_wait" in route or route is config["route"]:
            route["group_wait"] = "2s" if _seconds(route["group_wait"]) >= 30 else "1s"
        if "group_interval" in route or route is config["route"]:
            route["group_interval"] = "2s"
    for receiver in config["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = f"{webhook.url}/{receiver['name']}"
    return config


# ~60 s of real time: run in a child pytest from collection (tests/ahead.py)
pytestmark = pytest.mark.ahead


def test_alerts_page_with_evidence_and_resolve(tmp_path: Path):
    rules = short_rules(tmp_path)
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text(yaml.safe_dump({"rules_file": str(rules)}))
    scenarios = {
        "pcie-node": shorten(
            "pcie-gen3-under-load",
            {"training": "10s", "gpu3-link-at-gen3": "10m", "gpu3-link-retrained": "10m"},
            tmp_path,
        ),
        "nccl-node": shorten(
            "nccl-stall",
            {"training": "10s", "collective-hung": "45s", "training-resumed": "10m"},
            tmp_path,
        ),
        "healthy-node": "healthy-8gpu",
        "idle-node": "idle-8gpu",
    }
    with ExitStack() as stack:
        webhook = stack.enter_context(Webhook())
        alertmanager = stack.enter_context(
            running_alertmanager(tmp_path, alertmanager_config(webhook))
        )
        nodes, started = {}, {}
        for node, scenario in scenarios.items():
            url = stack.enter_context(running_daemon(str(scenario), "--config", str(config)))
            nodes[urllib.parse.urlparse(url).netloc] = node
            started[node] = time.monotonic()
        prometheus = stack.enter_context(
            running_prometheus(
                tmp_path,
                {"gpuwatchd": list(nodes)},
                rule_files=[DEPLOY / "prometheus" / "recording.yaml", short_alerts(tmp_path)],
                alertmanager=alertmanager,
                nodes=nodes,
            )
        )

        def arrived(alertname: str, node: str, status: str = "firing") -> list[dict]:
            return [
                alert
                for _, alert in webhook.alerts()
                if alert["labels"]["alertname"] == alertname
                and alert["labels"].get("node") == node
                and alert["status"] == status
            ]

        def gpus(alertname: str, node: str, status: str = "firing") -> set[str]:
            return {alert["labels"]["gpu"] for alert in arrived(alertname, node, status)}

        pcie = wait_until(
            "GpuPcieLinkDegraded at the pager",
            lambda: arrived("GpuPcieLinkDegraded", "pcie-node"),
            90,
        )
        pcie_latency = time.monotonic() - started["pcie-node"] - PCIE_ONSET
        nccl = wait_until(
            "GpuNcclStall at the pager for all 4 GPUs",
            lambda: (
                len(gpus("GpuNcclStall", "nccl-node")) == 4 and arrived("GpuNcclStall", "nccl-node")
            ),
            90,
        )
        nccl_latency = time.monotonic() - started["nccl-node"] - NCCL_ONSET

        # the page carries what routes it and what the person on call needs
        (alert,) = pcie
        assert {k: alert["labels"][k] for k in ("gpu", "cause", "severity", "dimension")} == {
            "gpu": "3",
            "cause": "pcie_link_degraded",
            "severity": "critical",
            "dimension": "pcie",
        }
        summary = alert["annotations"]["summary"]  # short, and where: PCI address, process
        assert re.fullmatch(r"pcie_link_degraded on pcie-node GPU 3 \(\S+:\S+\), pid \d+", summary)
        description = alert["annotations"]["description"]
        assert description.startswith("GPU in P0"), description
        assert "its own link Gen3 x16 of Gen4 x16" in description, description
        assert "BIOS" in alert["annotations"]["remedy"]
        assert alert["annotations"]["runbook_url"].endswith("docs/alerting.md#gpupcielinkdegraded")
        for alert in nccl:
            assert alert["labels"]["severity"] == "critical"
            assert "SM activity" in alert["annotations"]["description"]
            assert "NCCL_DEBUG=INFO" in alert["annotations"]["remedy"]
        paged = {(n["receiver"], a["labels"]["alertname"]) for n, a in webhook.alerts()}
        assert ("pager", "GpuPcieLinkDegraded") in paged and ("pager", "GpuNcclStall") in paged

        # the job resumes: the stall resolves at the pager
        wait_until(
            "GpuNcclStall resolved",
            lambda: len(gpus("GpuNcclStall", "nccl-node", "resolved")) == 4,
            90,
        )
        resolve_latency = time.monotonic() - started["nccl-node"] - NCCL_END

        # nothing, not even pending, on the healthy and idle nodes in all that time
        quiet = {"healthy-node", "idle-node"}
        noise = [a["labels"] for _, a in webhook.alerts() if a["labels"].get("node") in quiet]
        assert noise == []
        assert [a for a in prometheus.alerts() if a["labels"].get("node") in quiet] == []
        # and only the faults: no other alert from the faulty nodes either
        others = {
            a["labels"]["alertname"]
            for _, a in webhook.alerts()
            if a["labels"]["alertname"] not in ("GpuPcieLinkDegraded", "GpuNcclStall")
        }
        assert others == set()
    print(
        f"\nonset -> page: PCIe {pcie_latency:.0f} s, NCCL {nccl_latency:.0f} s; "
        f"fault end -> resolved: NCCL {resolve_latency:.0f} s"
    )
