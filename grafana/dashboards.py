"""gpuwatchd's Grafana dashboards as code (grafana-foundation-sdk), written as JSON.

    python -m grafana.dashboards          # or: python grafana/dashboards.py
    python -m grafana.dashboards --check  # exit 1 if a committed file is out of date

writes grafana/fleet.json, grafana/node.json and grafana/job.json (sorted keys, stable
panel ids), so a regenerated file differs from the committed one only where the code
changed. tests/test_grafana.py (test_report_grafana.py for job.json) keeps them equal and
runs every query against a real Prometheus.

Queries follow two rules: every target returns data on a healthy node (zeros rather
than nothing), except those over the cause families, which exist only for a GPU and
cause in that state (issue 24: a healthy node exports none): counts per GPU add zeros
from gpuwatchd_gpu_starved (`count_per_gpu`), lists of causes are empty while none
fires; and every
series is selected by the scrape's `job` and the `node` label a relabelling gives each
target (docs/dashboards.md). The recording rules of deploy/prometheus/recording.yaml
keep `cluster`, `job` and `instance` only, so the fleet view joins them to
`gpuwatchd_build_info` on those to filter by node and show its name. The fleet's job
view joins per-GPU series to `gpuwatchd_gpu_owner_info` (and a MIG GPU instance's
series to `gpuwatchd_gpu_instance_owner_info`) on (job, instance, uuid, gpu_instance), as
deploy/prometheus/jobs.yaml does, and is empty until a GPU has an owner with a job id.
A cause judged on a MIG GPU instance carries `gpu_instance` (docs/mig.md): the panels that
list causes show it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import bargauge, stat, statetimeline, table, timeseries
from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus as prom
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models import prometheus as prom_model

HERE = Path(__file__).resolve().parent
DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
FLEET_UID = "gpuwatchd-fleet"
NODE_UID = "gpuwatchd-node"
TAGS = ["gpuwatchd", "gpu"]

# Units (Grafana's unit ids)
RATIO = "percentunit"  # 0-1 shown as percent
BYTES_PER_S = "Bps"
BITS_PER_S = "bps"
SECONDS = "s"
PER_S = "cps"  # counts per second
COUNT = "short"
HERTZ = "hertz"
GPU_HOURS = "suffix:GPU-h"
GPU_HOURS_PER_H = "suffix:GPU-h/h"

# Label selectors. The fleet's recording rules have no `node`: see by_node().
FLEET = 'cluster=~"$cluster", job=~"$job", node=~"$node"'
FLEET_RULES = 'cluster=~"$cluster", job=~"$job"'
NODE = 'job=~"$job", node=~"$node"'
GPU = 'job=~"$job", node=~"$node", gpu=~"$gpu"'


# --- building blocks -------------------------------------------------------------------


def query(expr: str, legend: str = "", *, instant: bool = False) -> prom.Dataquery:
    q = prom.Dataquery().expr(" ".join(expr.split())).datasource(DATASOURCE)
    if legend:
        q = q.legend_format(legend)
    if instant:
        q = q.instant().format(prom_model.PromQueryFormat.TABLE)
    return q


def _common(panel: Any, title: str, description: str, queries: list[prom.Dataquery],
            unit: str, width: int, height: int) -> Any:
    panel = panel.title(title).description(" ".join(description.split()))
    panel = panel.datasource(DATASOURCE).unit(unit).span(width).height(height)
    for ref, q in zip("ABCDEFGH", queries, strict=False):
        panel = panel.with_target(q.ref_id(ref))
    return panel


def _legend() -> common_b.VizLegendOptions:
    return (
        common_b.VizLegendOptions()
        .display_mode(common.LegendDisplayMode.TABLE)
        .placement(common.LegendPlacement.BOTTOM)
        .show_legend(True)
        .calcs(["lastNotNull", "max"])
    )


def graph(title: str, description: str, queries: list[prom.Dataquery], unit: str, *,
          width: int = 12, height: int = 8, stack: bool = False, max_val: float | None = None,
          ) -> timeseries.Panel:
    panel = _common(timeseries.Panel(), title, description, queries, unit, width, height)
    panel = panel.min(0).fill_opacity(10).line_width(1).legend(_legend()).tooltip(
        common_b.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
        .sort(common.SortOrder.DESCENDING)
    )
    if max_val is not None:
        panel = panel.max(max_val)
    if stack:
        panel = panel.fill_opacity(60).stacking(
            common_b.StackingConfig().mode(common.StackingMode.NORMAL)
        )
    return panel


def big_number(title: str, description: str, q: prom.Dataquery, unit: str, *,
               width: int = 6, red_from: float | None = None) -> stat.Panel:
    panel = _common(stat.Panel(), title, description, [q], unit, width, 4)
    panel = panel.graph_mode(common.BigValueGraphMode.AREA).color_mode(
        common.BigValueColorMode.VALUE
    ).reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]))
    steps = [model.Threshold(value=None, color="green")]
    if red_from is not None:
        steps.append(model.Threshold(value=red_from, color="red"))
    return panel.thresholds(
        dash.ThresholdsConfig().mode(model.ThresholdsMode.ABSOLUTE).steps(steps)
    )


def bars(title: str, description: str, q: prom.Dataquery | list[prom.Dataquery], unit: str,
         *, width: int = 12, height: int = 10) -> bargauge.Panel:
    queries = q if isinstance(q, list) else [q]
    panel = _common(bargauge.Panel(), title, description, queries, unit, width, height)
    return (
        panel.orientation(common.VizOrientation.HORIZONTAL)
        .display_mode(common.BarGaugeDisplayMode.BASIC)
        .show_unfilled(True)
        .min(0)
        .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]))
    )


def timeline(title: str, description: str, queries: list[prom.Dataquery],
             mappings: dict[int, tuple[str, str]], *, width: int = 12, height: int = 8,
             ) -> statetimeline.Panel:
    """A state timeline whose values are named and coloured by `mappings`."""
    panel = _common(statetimeline.Panel(), title, description, queries, "none", width, height)
    options = {
        str(value): model.ValueMappingResult(text=text, color=color, index=i)
        for i, (value, (text, color)) in enumerate(sorted(mappings.items()))
    }
    return (
        panel.mappings([model.ValueMap(options=options)])
        .show_value(common.VisibilityMode.NEVER)
        .merge_values(True)
        .row_height(0.9)
        .fill_opacity(80)
        .legend(common_b.VizLegendOptions().show_legend(False))
        .color_scheme(dash.FieldColor().mode(model.FieldColorModeId.THRESHOLDS))
    )


def heatmap(title: str, description: str, q: prom.Dataquery, *, width: int = 24,
            height: int = 10) -> statetimeline.Panel:
    """One row per series, coloured by its 0-1 value (red low, green high): a state
    timeline as a heat map, which keeps the rows' names (a heatmap panel buckets them)."""
    panel = _common(statetimeline.Panel(), title, description, [q], RATIO, width, height)
    return (
        panel.min(0).max(1)
        .show_value(common.VisibilityMode.NEVER)
        .merge_values(False)
        .row_height(0.95)
        .fill_opacity(90)
        .legend(common_b.VizLegendOptions().show_legend(False))
        .color_scheme(dash.FieldColor().mode(model.FieldColorModeId.CONTINUOUS_RD_YL_GR))
    )


def grid(title: str, description: str, queries: list[prom.Dataquery], *,
         columns: list[str], display: dict[str, tuple[str, str]] | None = None,
         width: int = 24, height: int = 8, link: dict[str, str] | None = None,
         sort: str | None = None) -> table.Panel:
    """A table of instant queries: one row per label set, `columns` first, Time hidden.

    `display` maps a value field ("Value #A") to (column title, unit); several queries
    are merged on their labels. Rows are sorted by `sort` (a column title, ascending),
    else by the first column.
    """
    panel = _common(table.Panel(), title, description, queries, "none", width, height)
    if len(queries) > 1:
        panel = panel.with_transformation(model.DataTransformerConfig(id_val="merge", options={}))
    hidden = {"Time": True, "__name__": True}
    if not display:
        hidden["Value"] = True
    order = {name: i for i, name in enumerate(columns)}
    panel = panel.with_transformation(model.DataTransformerConfig(
        id_val="organize", options={"excludeByName": hidden, "indexByName": order},
    ))
    for field, (name, unit) in (display or {}).items():
        panel = panel.override_by_name(field, [
            model.DynamicConfigValue(id_val="displayName", value=name),
            model.DynamicConfigValue(id_val="unit", value=unit),
        ])
    for long_text in ("summary", "remedy"):
        if long_text in columns:
            panel = panel.override_by_name(long_text, [
                model.DynamicConfigValue(id_val="custom.inspect", value=True),
                model.DynamicConfigValue(id_val="custom.minWidth", value=300),
            ])
    if link is not None:
        panel = panel.override_by_name(columns[0], [
            model.DynamicConfigValue(id_val="links", value=[link]),
        ])
    return panel.sort_by([common_b.TableSortByFieldState().display_name(sort or columns[0])])


def row(title: str, panels: list[Any]) -> dash.Row:
    r = dash.Row(title).collapsed(False)
    for p in panels:
        r = r.with_panel(p)
    return r


def datasource_variable() -> dash.DatasourceVariable:
    return dash.DatasourceVariable("datasource").label("Data source").type("prometheus")


def label_variable(name: str, label: str, source: str, *, multi: bool,
                   sort: model.VariableSort = model.VariableSort.ALPHABETICAL_ASC,
                   ) -> dash.QueryVariable:
    v = (
        dash.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(f"label_values({source}, {name})")
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(sort)
    )
    if multi:
        v = v.multi(True).include_all(True).all_value(".*")
    return v


def new_dashboard(title: str, uid: str, description: str) -> dash.Dashboard:
    return (
        dash.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(TAGS)
        .editable()
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
        .time("now-3h", "now")
        .refresh("1m")
        .link(
            dash.DashboardLink("gpuwatchd")
            .type(model.DashboardLinkType.DASHBOARDS)
            .tags(["gpuwatchd"])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
    )


# --- the fleet -------------------------------------------------------------------------


def by_node(expr: str) -> str:
    """`expr` (a recording rule: cluster, job, instance) restricted to $node, with `node`."""
    return (
        f"({expr}) * on (cluster, job, instance) group_left (node)"
        f" max by (cluster, job, instance, node) (gpuwatchd_build_info{{{FLEET}}})"
    )


def fleet_now() -> dash.Row:
    gpus = f"instance:gpuwatchd_gpus:count{{{FLEET_RULES}}}"
    share = f"instance:gpuwatchd_gpu_starved:ratio_avg5m{{{FLEET_RULES}}}"
    return row("Now", [
        big_number(
            "Nodes", """Nodes whose gpuwatchd reports (one per scrape target), for the
            cluster, job and node selection.""",
            query(f"count(max by (cluster, job, instance) (gpuwatchd_build_info{{{FLEET}}}))"),
            COUNT),
        big_number(
            "GPUs", """GPUs on the selected nodes, as their gpuwatchd sees them
            (instance:gpuwatchd_gpus:count). Fewer than the nodes should have means GPUs
            NVML no longer lists.""",
            query(f"sum({by_node(gpus)})"), COUNT),
        big_number(
            "Starved GPUs now", """GPUs on which at least one starvation cause fires now
            (instance:gpuwatchd_gpus_starved:sum). Anything above 0 is a GPU waiting on
            something: the table below says on what.""",
            query(f"sum({by_node(f'instance:gpuwatchd_gpus_starved:sum{{{FLEET_RULES}}}')})"),
            COUNT, red_from=1),
        big_number(
            "GPU time starved (5m)", """Share of the selected GPUs' time over the last 5
            minutes during which any cause fired (instance:gpuwatchd_gpu_starved:ratio_avg5m,
            weighted by GPUs). 0 % is a fleet where no GPU waits.""",
            query(f"sum({by_node(f'{share} * {gpus}')}) / sum({by_node(gpus)})"),
            RATIO, red_from=0.05),
        bars(
            "Starved GPUs now, by cause", """Per starvation cause, how many of the selected
            GPUs it fires on now (sum of gpuwatchd_starvation_active), largest first. Only
            causes that fire somewhere are listed: none, a fed fleet.""",
            query(f"sort_desc(sum by (cause) (gpuwatchd_starvation_active{{{FLEET}}}))",
                  "{{cause}}", instant=True), COUNT, width=8, height=12),
        grid(
            "Firing causes", """One row per GPU and cause firing now
            (gpuwatchd_starvation_info): the node, the GPU (and MIG GPU instance, where the
            cause is an instance's), the cause with its dimension and severity, the
            evidence the daemon recorded when the cause started firing
            (summary) and what to do about it (remedy). Empty while nothing fires; click a
            node to open its dashboard.""",
            [query(
                "max by (node, gpu, gpu_instance, cause, dimension, severity, summary, remedy,"
                f" job, cluster) (gpuwatchd_starvation_info{{{FLEET}}})", instant=True)],
            columns=["node", "gpu", "gpu_instance", "cause", "severity", "dimension",
                     "summary", "remedy", "job", "cluster"],
            width=16, height=12, link=node_link("${__data.fields.job}")),
    ])


def node_link(job: str) -> dict[str, str]:
    """A data link from a `node` cell to that node's dashboard."""
    return {
        "title": "Node dashboard",
        "url": f"/d/{NODE_UID}/gpuwatchd-node?${{datasource:queryparam}}&var-job={job}"
        "&var-node=${__value.raw}&${__url_time_range}",
    }


def fleet_lost() -> dash.Row:
    return row("GPU-hours lost", [
        graph(
            "GPU-hours lost per hour, by cause", """Starved GPU-seconds per second per
            cause over the last 5 minutes (instance_cause:gpuwatchd_starvation_seconds:rate5m)
            for the selected nodes, stacked: the number of GPUs starved on each cause on
            average, which is also the GPU-hours lost per hour of wall time.""",
            [query(
                "sum by (cause) ("
                + by_node(f"instance_cause:gpuwatchd_starvation_seconds:rate5m{{{FLEET_RULES}}}")
                + ")", "{{cause}}")],
            GPU_HOURS_PER_H, stack=True),
        graph(
            "GPU-hours lost in the last hour, by cause", """GPU-hours each cause cost over
            the preceding hour (job_cause:gpuwatchd_starvation_gpu_hours:increase1h), summed
            over the selected clusters and jobs; the node selection does not apply (the rule
            is per job).""",
            [query(f"sum by (cause) (job_cause:gpuwatchd_starvation_gpu_hours:increase1h"
                   f"{{{FLEET_RULES}}})", "{{cause}}")],
            GPU_HOURS, stack=True),
        graph(
            "Share of GPU time starved, by job", """Per job (and cluster), the share of its
            GPUs' time over the last 5 minutes during which any cause fired
            (job:gpuwatchd_gpu_starved:ratio_avg5m); the node selection does not apply.""",
            [query(f"sum by (cluster, job) (job:gpuwatchd_gpu_starved:ratio_avg5m"
                   f"{{{FLEET_RULES}}})", "{{job}} {{cluster}}")],
            RATIO, max_val=1),
        bars(
            "GPU-hours lost in the time range, by cause", """GPU-hours lost to each cause
            over the dashboard's time range on the selected nodes (increase of
            gpuwatchd_starvation_seconds_total / 3600), largest first: where to spend
            effort.""",
            query(f"sort_desc(sum by (cause) (increase(gpuwatchd_starvation_seconds_total"
                  f"{{{FLEET}}}[$__range])) / 3600)", "{{cause}}", instant=True),
            GPU_HOURS, height=8),
    ])


def fleet_worst() -> dash.Row:
    ratio1h = by_node(f"instance:gpuwatchd_gpu_starved:ratio_avg1h{{{FLEET_RULES}}}")
    ratio5m = by_node(f"instance:gpuwatchd_gpu_starved:ratio_avg5m{{{FLEET_RULES}}}")
    top = f"topk(10, {ratio1h})"

    def in_top(expr: str) -> str:
        return f"{by_node(expr)} and on (cluster, job, instance) {top}"

    return row("Worst nodes and jobs", [
        grid(
            "Worst nodes", """The 10 selected nodes whose GPUs were starved the largest
            share of the last hour (instance:gpuwatchd_gpu_starved:ratio_avg1h), with the
            share over the last 5 minutes, the GPUs starved now and the node's GPUs. Click
            a node to open its dashboard.""",
            [
                query(top, instant=True),
                query(in_top(f"instance:gpuwatchd_gpu_starved:ratio_avg5m{{{FLEET_RULES}}}"),
                      instant=True),
                query(in_top(f"instance:gpuwatchd_gpus_starved:sum{{{FLEET_RULES}}}"),
                      instant=True),
                query(in_top(f"instance:gpuwatchd_gpus:count{{{FLEET_RULES}}}"), instant=True),
            ],
            columns=["node", "job", "cluster", "instance"],
            display={
                "Value #A": ("Starved (1h)", RATIO),
                "Value #B": ("Starved (5m)", RATIO),
                "Value #C": ("Starved GPUs now", COUNT),
                "Value #D": ("GPUs", COUNT),
            },
            width=12, height=9, link=node_link("${__data.fields.job}"),
        ),
        bars(
            "Worst jobs and causes", """The 10 job × cause pairs that starve the most GPUs
            over the last 5 minutes (job_cause:gpuwatchd_starvation_seconds:rate5m: GPUs of
            the job starved on the cause, on average), largest first; the node selection
            does not apply (the rule is per job).""",
            query(f"sort_desc(topk(10, sum by (cluster, job, cause)"
                  f" (job_cause:gpuwatchd_starvation_seconds:rate5m{{{FLEET_RULES}}})))",
                  "{{job}} {{cluster}}: {{cause}}", instant=True),
            COUNT, height=9),
        graph(
            "Share of GPU time starved, worst nodes", """The nodes whose GPUs were starved
            the largest share of the last 5 minutes
            (topk(10, instance:gpuwatchd_gpu_starved:ratio_avg5m)), over time: a node that
            stays on top has a persistent problem, one that blips had a transient.""",
            [query(f"topk(10, {ratio5m})", "{{node}}")],
            RATIO, width=24, height=9, max_val=1),
    ])


# The job view: a job's GPUs on every node, through the owner info series each node
# exports per GPU and per MIG GPU instance (docs/fleet.md), joined as
# deploy/prometheus/jobs.yaml joins them: on (job, instance, uuid, gpu_instance), which a
# whole GPU's series (no gpu_instance) and an instance's share. The node selection does
# not apply: a job spans nodes.
OWNER_INFO = '__name__=~"gpuwatchd_gpu_owner_info|gpuwatchd_gpu_instance_owner_info"'
OWNER = f'{{{OWNER_INFO}, {FLEET_RULES}, job_id=~"$job_id", job_id!=""}}'
# jobs.yaml's per-GPU rules keep every label of the GPU's series plus the owner's; its
# per-job rules (job_id:..., job_id_cause:...) keep scheduler and job_id only.
JOB_GPU_RULES = f'{FLEET_RULES}, job_id=~"$job_id"'
JOB_RULES = 'job_id=~"$job_id"'


def of_job(expr: str, labels: str = "job_id") -> str:
    """`expr` (per GPU or MIG GPU instance) for the GPUs and instances of $job_id only,
    with the owner's `labels`."""
    return f"({expr}) * on (job, instance, uuid, gpu_instance) group_left ({labels}) {OWNER}"


def fleet_job() -> dash.Row:
    per_gpu_legend = "{{node}} GPU {{gpu}}"
    per_device_legend = per_gpu_legend + WHERE
    utilization = f"gpu:gpuwatchd_utilization:avg1m{{{JOB_GPU_RULES}}}"
    median = f"quantile by (scheduler, job_id) (0.5, {utilization})"
    last_active = f"gpu:gpuwatchd_last_active_timestamp_seconds{{{JOB_GPU_RULES}}}"
    starved_seconds = f"gpuwatchd_starvation_seconds_total{{{FLEET_RULES}}}"

    def by_device(metric: str) -> str:
        """gpuwatchd_gpu_<metric> per GPU of the job, and its instance form per MIG GPU
        instance of the job (a MIG GPU has no series of the per-GPU form)."""
        either = (f"gpuwatchd_gpu_{metric}{{{FLEET_RULES}}}"
                  f" or gpuwatchd_gpu_instance_{metric}{{{FLEET_RULES}}}")
        return with_where(f"max by (node, gpu, gpu_instance) ({of_job(either)})")

    return row("Job $job_id", [
        big_number(
            "Nodes of the job", """Nodes with at least one GPU owned by the selected job
            (job_id:gpuwatchd_nodes:count from deploy/prometheus/jobs.yaml). The cluster,
            job and node selection does not apply to the job's rules.""",
            query(f"sum(job_id:gpuwatchd_nodes:count{{{JOB_RULES}}})"), COUNT),
        big_number(
            "GPUs of the job", """GPUs the selected job owns across all its nodes
            (job_id:gpuwatchd_gpus:count), as each node's gpuwatchd_gpu_owner_info names
            them.""",
            query(f"sum(job_id:gpuwatchd_gpus:count{{{JOB_RULES}}})"), COUNT),
        big_number(
            "GPUs of the job at ≥ 80 %", """The job's GPUs whose 1-minute utilization is
            at least 80 % (job_id:gpuwatchd_gpus_busy:count). In a data-parallel job the
            ranks waiting for a straggler spin in the collective at ~100 %, so most GPUs
            busy and a few idle is the straggler pattern.""",
            query(f"sum(job_id:gpuwatchd_gpus_busy:count{{{JOB_RULES}}}) or vector(0)"),
            COUNT),
        big_number(
            "GPUs of the job in NCCL stall", """The job's GPUs whose nccl_stall cause fires
            now (gpu:gpuwatchd_nccl_stall:active). Half of them or more on two or more nodes
            for a minute pages as GpuJobNcclStall: the job is hung in a collective.""",
            query(f"sum(gpu:gpuwatchd_nccl_stall:active{{{JOB_GPU_RULES}}})"),
            COUNT, red_from=1),
        heatmap(
            "GPU utilization of the job, per node and GPU", """One row per GPU (or MIG
            GPU instance, "(instance N)") of the selected job, on every node it runs on
            (gpuwatchd_gpu_utilization_ratio or, on MIG, gpuwatchd_gpu_instance_utilization_ratio,
            joined with the owner on job, instance, uuid and gpu_instance): green is busy,
            red idle. A row (or a node's rows) red while the others are green is the
            straggler the rest of the job waits for.""",
            query(by_device("utilization_ratio"), per_device_legend)),
        heatmap(
            "SM activity of the job, per node and GPU (DCGM)", """Share of cycles an SM
            had work on each GPU of the selected job (DCGM profiling,
            gpuwatchd_gpu_sm_active_ratio), one row per node and GPU. Utilization can read
            100 % while ranks spin in NCCL; SM activity falls, on every row at once in a
            job-wide hang. A MIG GPU instance has its own row (its instance form).
            Empty where DCGM is not enabled.""",
            query(by_device("sm_active_ratio"), per_device_legend)),
        grid(
            "GPUs of the job, slowest first", """Each GPU (and MIG GPU instance,
            gpu_instance) of the selected job with its rank, its 1-minute
            utilization (gpu:gpuwatchd_utilization:avg1m) and that over
            the job's median: the straggler heads the table. GpuJobStraggler fires for a
            GPU under 20 % for 5 minutes while half the job runs at 80 % or more. Click a
            node to open its dashboard.""",
            [
                query(of_job(utilization, "rank"), instant=True),
                query(of_job(f"{utilization} / on (scheduler, job_id) group_left {median}",
                             "rank"), instant=True),
            ],
            columns=["node", "gpu", "gpu_instance", "rank", "user", "namespace", "job"],
            display={
                "Value #A": ("Utilization (1m)", RATIO),
                "Value #B": ("vs job median", RATIO),
            },
            width=12, height=10, link=node_link("${__data.fields.job}"),
            sort="Utilization (1m)"),
        bars(
            "Time since each GPU of the job last drew power", """Per GPU of the selected
            job, how long ago it last drew over 40 % of its power limit
            (gpu:gpuwatchd_last_active_timestamp_seconds, 30 minutes back), longest first.
            In a job-wide hang every GPU goes quiet; the one quiet longest stopped first
            and is the rank to look at. Whole GPUs only: a MIG GPU's power is all its
            instances'.""",
            query(f"sort_desc(time() - max by (node, gpu) ({last_active}))", per_gpu_legend,
                  instant=True),
            SECONDS, height=10),
        timeline(
            "Causes firing per node of the job", """Per node of the selected job, how many
            starvation causes fire on the job's GPUs there (gpuwatchd_starvation_active
            joined with the owner): green while none does, red with the count. A cause on
            one node only points at that node.""",
            [query(f"sum by (node) ({of_job(f'gpuwatchd_starvation_active{{{FLEET_RULES}}}')})",
                   "{{node}}")],
            {0: ("none", "green")}, width=12, height=8,
        ).thresholds(dash.ThresholdsConfig().mode(model.ThresholdsMode.ABSOLUTE).steps([
            model.Threshold(value=None, color="green"), model.Threshold(value=1, color="red"),
        ])).show_value(common.VisibilityMode.AUTO),
        grid(
            "Firing causes on the job's GPUs", """One row per GPU (or MIG GPU instance)
            of the selected job and cause firing now (gpuwatchd_starvation_info joined with
            the owner): node, GPU, gpu_instance, rank, cause, severity, the evidence
            recorded when it started (summary) and the
            remedy. Empty while nothing fires on the job; click a node to open its
            dashboard.""",
            [query(
                "max by (node, gpu, gpu_instance, rank, cause, severity, summary, remedy,"
                " job) (" + of_job(f"gpuwatchd_starvation_info{{{FLEET_RULES}}}", "job_id, rank")
                + ")", instant=True)],
            columns=["node", "gpu", "gpu_instance", "rank", "cause", "severity", "summary",
                     "remedy", "job"],
            width=12, height=8, link=node_link("${__data.fields.job}")),
        graph(
            "GPU-hours the job lost in the last hour, by cause", """GPU-hours each cause
            cost the selected job over the preceding hour, across all its nodes
            (job_id_cause:gpuwatchd_starvation_gpu_hours:increase1h), stacked. A GPU that
            changed jobs within the hour charges it to its new owner.""",
            [query(f"sum by (cause) (job_id_cause:gpuwatchd_starvation_gpu_hours:increase1h"
                   f"{{{JOB_RULES}}})", "{{cause}}")],
            GPU_HOURS, stack=True),
        bars(
            "GPU-hours the job lost in the time range, by cause", """GPU-hours lost to each
            cause on the selected job's GPUs over the dashboard's time range (increase of
            gpuwatchd_starvation_seconds_total / 3600 on the GPUs the job owns at its
            end), largest first.""",
            query(f"sort_desc(sum by (cause) ({of_job(f'increase({starved_seconds}[$__range])')})"
                  " / 3600)", "{{cause}}", instant=True),
            GPU_HOURS, width=6, height=8),
        bars(
            "GPU-hours lost in the last hour, by namespace and user", """The 10 namespaces
            and the 10 users whose GPUs lost the most GPU-hours to starvation in the last
            hour, every cause summed (namespace_cause: and
            user_cause:gpuwatchd_starvation_gpu_hours:increase1h, from every owned GPU, a
            pod without a job id too). Not limited to the selected job.""",
            [query(f"sort_desc(topk(10, sum by ({who}) ({who}_cause:gpuwatchd_starvation_gpu_"
                   "hours:increase1h)))", f"{who} {{{{{who}}}}}", instant=True)
             for who in ("namespace", "user")],
            GPU_HOURS, width=6, height=8),
    ])


def fleet() -> dash.Dashboard:
    d = new_dashboard(
        "gpuwatchd / Fleet", FLEET_UID,
        "Which GPUs in the fleet are starved, on what, and what it costs (gpuwatchd).",
    ).with_variable(datasource_variable())
    d = d.with_variable(label_variable("cluster", "Cluster", "gpuwatchd_build_info", multi=True))
    d = d.with_variable(label_variable(
        "job", "Job", 'gpuwatchd_build_info{cluster=~"$cluster"}', multi=True))
    d = d.with_variable(label_variable(
        "node", "Node", 'gpuwatchd_build_info{cluster=~"$cluster", job=~"$job"}', multi=True))
    d = d.with_variable(label_variable(
        "job_id", "Job ID",
        f'{{{OWNER_INFO}, cluster=~"$cluster", job=~"$job", job_id!=""}}', multi=False))
    for r in (fleet_now(), fleet_lost(), fleet_worst(), fleet_job()):
        d = d.with_row(r)
    return d


# --- one node --------------------------------------------------------------------------

# PCIe series are labelled by the GPU's PCI address (gpu_bus_id); gpu_info carries the same
# address as pci_bus_id, so this gives each of them the `gpu` index and applies $gpu.
GPU_OF_BUS = (
    f"label_replace(max by (job, instance, gpu, pci_bus_id) (gpuwatchd_gpu_info{{{GPU}}}),"
    ' "gpu_bus_id", "$1", "pci_bus_id", "(.+)")'
)


def pcie(metric: str, by: str = "gpu, role, device", how: str = "max") -> str:
    return (
        f"{how} by ({by}) (gpuwatchd_{metric}{{{NODE}}}"
        f" * on (job, instance, gpu_bus_id) group_left (gpu) {GPU_OF_BUS})"
    )


def per_gpu(metric: str, how: str = "max", extra: str = "") -> str:
    selector = GPU + (f", {extra}" if extra else "")
    return f"{how} by (gpu) (gpuwatchd_{metric}{{{selector}}})"


def count_per_gpu(metric: str) -> str:
    """How many series of a sparse cause family each GPU has, 0 where it has none."""
    return f"{per_gpu(metric, 'count')} or {per_gpu('gpu_starved')} * 0"


def or_none(expr: str, label: str, by: str = "gpu") -> str:
    """`expr`, or 0 per GPU under `label`="none" where it has no series: a family shown
    only while not 0 (docs/metrics.md) reads 0 on the panel, not "No data"."""
    base = per_gpu("gpu_info", "sum") if by == "gpu" else f"sum(gpuwatchd_gpu_info{{{GPU}}})"
    on = f"on ({by})" if by else "on ()"
    return f'{expr} or {on} label_replace(0 * {base}, "{label}", "none", "", "")'


def rate_per_gpu(metric: str) -> str:
    return f"sum by (gpu) (rate(gpuwatchd_{metric}{{{GPU}}}[$__rate_interval]))"


def host(metric: str, by: str, how: str = "max", extra: str = "") -> str:
    selector = NODE + (f", {extra}" if extra else "")
    return f"{how} by ({by}) (gpuwatchd_{metric}{{{selector}}})"


def per_device(whole: str, instance: str, *, by: str = "", how: str = "max",
               skip_mig_gpus: bool = False) -> str:
    """A per-GPU family per whole GPU and its instance form per MIG GPU instance, each
    labelled `device` as the status page names it: "0" for GPU 0, "0/2" for its GPU
    instance 2 (with gpu_instance and profile). A MIG-enabled GPU has no series of the
    per-GPU families that have an instance form (utilization, main process, owner), so
    each GPU shows once, whole or by its instances; `skip_mig_gpus` leaves out the whole
    GPU's series where it has them (memory: the sum over its instances). `by`: labels
    kept besides the device's (an owner's)."""
    extra = f", {by}" if by else ""
    gpus = f"{how} by (gpu{extra}) (gpuwatchd_{whole}{{{GPU}}})"
    if skip_mig_gpus:
        gpus += f" unless on (gpu) (gpuwatchd_gpu_mig_mode{{{GPU}}} == 1)"
    instances = f"{how} by (gpu, gpu_instance, profile{extra}) (gpuwatchd_{instance}{{{GPU}}})"
    return (f'label_replace({gpus}, "device", "$1", "gpu", "(.*)")'
            f' or label_join({instances}, "device", "/", "gpu", "gpu_instance")')


# a cause judged on a MIG GPU instance carries gpu_instance (empty on a whole GPU): the
# legend suffix that names it, from `where` (label_replace below)
WHERE = "{{where}}"


def with_where(expr: str) -> str:
    """`expr` with a `where` label " (instance N)" where it has gpu_instance N (none on a
    whole GPU): joined from constant parts, as a replacement's "$1" reads as a variable."""
    parts = (f'label_replace(label_replace({expr}, "open", " (instance ", "gpu_instance",'
             ' ".+"), "close", ")", "gpu_instance", ".+")')
    return ('max without (open, close) '
            f'(label_join({parts}, "where", "", "open", "gpu_instance", "close"))')


STATES = {  # the cause matrix's values
    0: ("ok", "green"),
    1: ("pending", "yellow"),
    2: ("firing", "red"),
    3: ("not evaluable", "text"),
}


def node_causes() -> dash.Row:
    # a GPU (or MIG GPU instance) x cause is in one state at a time, and only then has a
    # series
    states = with_where(
        f"max by (gpu, gpu_instance, cause) (2 * gpuwatchd_starvation_active{{{GPU}}}"
        f" or gpuwatchd_starvation_pending{{{GPU}}}"
        f" or 3 * gpuwatchd_starvation_not_evaluable{{{GPU}}})"
    )
    firing = timeline(
        "Causes firing per GPU", """Per GPU, how many starvation causes fire
        (sum of gpuwatchd_starvation_active), those on its MIG GPU instances included:
        green while none does, red with the count while one or more do. The per-GPU
        matrices below say which.""",
        [query(count_per_gpu("starvation_active"), "GPU {{gpu}}")],
        {0: ("none", "green")}, width=24, height=6,
    ).thresholds(dash.ThresholdsConfig().mode(model.ThresholdsMode.ABSOLUTE).steps([
        model.Threshold(value=None, color="green"), model.Threshold(value=1, color="red"),
    ])).show_value(common.VisibilityMode.AUTO)
    matrix = timeline(
        "Causes on GPU $gpu", """The starvation rules on this GPU that were not ok in the
        time range, one row per cause: pending (yellow: its condition holds, waiting out
        its `for`), firing (red), or not evaluable (grey: an input is missing, e.g. no
        DCGM profiling or no probe); gaps are ok (the daemon exports a cause only while
        it is in one of those states). On a MIG GPU a cause judged on a GPU instance
        has its own row, "(instance N)" after the cause. Repeated for each selected
        GPU.""",
        [query(states, "{{cause}}" + WHERE)], STATES, height=14,
    ).repeat("gpu").repeat_direction("h")
    table_ = grid(
        "Firing causes on this node", """One row per GPU (or MIG GPU instance: its
        gpu_instance, empty for a whole GPU) and cause firing now
        (gpuwatchd_starvation_info): the evidence recorded when it started firing
        (summary) and what to do (remedy). Empty while nothing fires.""",
        [query("max by (gpu, gpu_instance, cause, dimension, severity, summary, remedy)"
               f" (gpuwatchd_starvation_info{{{GPU}}})", instant=True)],
        columns=["gpu", "gpu_instance", "cause", "severity", "dimension", "summary",
                 "remedy"], height=6,
    )
    return row("Causes", [firing, table_, matrix])


def node_pcie() -> dash.Row:
    return row("PCIe", [
        grid(
            "PCIe links degraded per GPU", """How many functions on each GPU's path to
            the CPU (the GPU, the switch and root ports above it) run below what both ends
            of their link support (degraded): 0 on a healthy node. A degraded bridge slows
            every GPU behind it. Each link's generation and width, current and maximum,
            with detail_metrics (gpuwatchd_gpu_pcie_link_*).""",
            [query(f"{pcie('pcie_link_degraded', 'gpu', 'sum')} or {per_gpu('gpu_info')}"
                   " * 0", instant=True)],
            columns=["gpu"],
            display={"Value": ("Degraded functions", "none")},
            width=12, height=8,
        ),
        grid(
            "Degraded PCIe functions", """The functions on the GPUs' paths whose link runs
            below what both its ends support (gpuwatchd_pcie_link_degraded; role gpu: the
            GPU's own link, bridge: a switch or root port). The firing cause's summary
            says at which generation and width; every function's link with
            detail_metrics.""",
            [query(pcie("pcie_link_degraded"), instant=True)],
            columns=["gpu", "role", "device"],
            display={"Value": ("Degraded", "none")},
            width=12, height=8,
        ),
        graph(
            "PCIe throughput per GPU", """Bytes per second over each GPU's PCIe link as
            NVML measures it: host to GPU (input batches, weights) and GPU to host. A GPU
            starved on a degraded link shows less host-to-GPU traffic than its peers.""",
            [query(per_gpu("gpu_pcie_rx_bytes_per_second"), "GPU {{gpu}} host→GPU"),
             query(per_gpu("gpu_pcie_tx_bytes_per_second"), "GPU {{gpu}} GPU→host")],
            BYTES_PER_S),
        graph(
            "PCIe replays and AER errors", """Per second: link-level retransmissions
            (replays) NVML counts per GPU, and AER errors the kernel counts per severity on
            the GPU's path. Sustained replays mean a marginal link.""",
            [query(f"{rate_per_gpu('gpu_pcie_replay_errors_total')} or"
                   f" {per_gpu('gpu_info')} * 0", "GPU {{gpu}} replays"),
             query(or_none(f"sum by (gpu, severity) (rate(gpuwatchd_pcie_aer_errors_total"
                           f"{{{NODE}}}[$__rate_interval]) * on (job, instance, gpu_bus_id)"
                           f" group_left (gpu) {GPU_OF_BUS})", "severity"),
                   "GPU {{gpu}} AER {{severity}}")],
            PER_S),
    ])


def node_compute() -> dash.Row:
    return row("Compute", [
        graph(
            "GPU utilization (NVML)", """Share of time a kernel was running on each GPU
            (gpuwatchd_gpu_utilization_ratio). Low utilization with a cause firing is
            starvation; 100 % says only that a kernel ran, not how much of the GPU it used
            (see the activity panel).""",
            [query(per_gpu("gpu_utilization_ratio"), "GPU {{gpu}}")], RATIO, max_val=1),
        graph(
            "SM, tensor and DRAM activity (DCGM)", """DCGM profiling per GPU: share of
            cycles an SM had work (SM), a tensor pipe was busy (tensor), device memory was
            transferring (DRAM). High DRAM with low SM is memory-bound; low everything while
            utilization is high is waiting (NCCL, launches).""",
            [query(per_gpu("gpu_sm_active_ratio"), "GPU {{gpu}} SM"),
             query(per_gpu("gpu_tensor_active_ratio"), "GPU {{gpu}} tensor"),
             query(per_gpu("gpu_dram_active_ratio"), "GPU {{gpu}} DRAM")],
            RATIO, max_val=1),
        graph(
            "SM clock per GPU", """Each GPU's SM clock. Under load it should sit at the
            GPU's maximum (gpuwatchd_gpu_sm_clock_max_hertz with detail_metrics) or its
            power-capped design point; lower with a clock event reason active (next panel)
            is throttling.""",
            [query(per_gpu("gpu_sm_clock_hertz"), "GPU {{gpu}}")], HERTZ),
        graph(
            "Clock event reasons active", """How many of the selected GPUs each clock event
            reason holds down (gpuwatchd_gpu_clock_event_reason_active): thermal, power
            caps and hardware slowdowns under load starve the GPU of clock; gpu_idle is
            normal when idle.""",
            [query(or_none(host("gpu_clock_event_reason_active", "reason", "sum",
                                 'gpu=~"$gpu"'), "reason", by=""),
                   "{{reason}}")], COUNT),
    ])


def node_input() -> dash.Row:
    return row("Input", [
        graph(
            "Loader wait vs compute (probe)", """From gpuwatchd.probe in the training loop:
            share of wall time the process waited for its next batch versus computed
            (rates of gpuwatchd_probe_wait_seconds_total and _compute_seconds_total). Wait
            above a few percent while the GPU is not saturated is an input-pipeline stall.
            Empty for processes without the probe.""",
            [query(rate_per_gpu("probe_wait_seconds_total"), "GPU {{gpu}} waiting"),
             query(rate_per_gpu("probe_compute_seconds_total"), "GPU {{gpu}} computing")],
            RATIO, max_val=1),
        graph(
            "GPU process: cgroup throttling and busiest thread", """For each GPU's main
            process: the share of its cgroup's CPU periods throttled by the CPU limit, and
            how busy its busiest thread is (share of one core). Throttling, or one thread at
            100 % with no DataLoader workers, starves the input pipeline.""",
            [query(per_gpu("gpu_process_throttled_ratio"), "GPU {{gpu}} throttled"),
             query(per_gpu("gpu_process_busiest_thread_cpu_ratio"),
                   "GPU {{gpu}} busiest thread")],
            RATIO),
        graph(
            "GPU process CPU (cores)", """CPU used by each GPU's main process, in cores,
            next to the cgroup limit where there is one (its DataLoader workers' with
            detail_metrics: gpuwatchd_gpu_process_workers_cpu_cores).""",
            [query(per_gpu("gpu_process_cpu_cores"), "GPU {{gpu}} main process"),
             query(per_gpu("gpu_process_cpu_quota_cpus"), "GPU {{gpu}} limit")],
            COUNT),
    ])


def node_instances() -> dash.Row:
    device = "GPU {{device}}"
    memory = [
        per_device(f"gpu_memory_{m}_bytes", f"gpu_instance_memory_{m}_bytes",
                   skip_mig_gpus=True)
        for m in ("used", "total")
    ]
    owner_labels = "scheduler, job_id, rank, user, namespace, pod, container"
    return row("GPUs and MIG GPU instances", [
        grid(
            "GPUs and GPU instances: utilization, memory, main process", """One row per
            tenant's device: each whole GPU ("0") and each GPU instance of a MIG-enabled
            GPU ("0/2": GPU 0's GI 2, with its profile), as the status page names them.
            Utilization is NVML's for a whole GPU and DCGM's graphics engine activity of
            the instance on MIG (gpuwatchd_gpu_instance_utilization_ratio; empty without
            DCGM), memory the instance's own (its compute instances share it), and the
            pid of the device's main process (the one with the most GPU memory).""",
            [query(per_device("gpu_utilization_ratio", "gpu_instance_utilization_ratio"),
                   instant=True),
             *(query(m, instant=True) for m in memory),
             query(per_device("gpu_process_pid", "gpu_instance_process_pid"), instant=True)],
            columns=["device", "profile", "gpu", "gpu_instance"],
            display={
                "Value #A": ("Utilization", RATIO),
                "Value #B": ("Memory used", "bytes"),
                "Value #C": ("Memory total", "bytes"),
                "Value #D": ("Main process", "none"),
            },
            width=14, height=8),
        grid(
            "Owners of GPUs and GPU instances", """Who owns each whole GPU and each MIG
            GPU instance (gpuwatchd_gpu_owner_info, gpuwatchd_gpu_instance_owner_info):
            the scheduler, job, rank, user, namespace, pod and container of its main
            process, its job file or its device's kubelet allocation. An instance's owner
            is its own, never its neighbour's; a device nobody owns has no row.""",
            [query(per_device("gpu_owner_info", "gpu_instance_owner_info", by=owner_labels),
                   instant=True)],
            columns=["device", "profile", "scheduler", "job_id", "rank", "user",
                     "namespace", "pod", "container"],
            width=10, height=8),
        graph(
            "Utilization per GPU and GPU instance", """Share of time a kernel ran on each
            whole GPU (NVML) and each MIG GPU instance ("GPU 0/2": DCGM's graphics engine
            activity of the instance, NVML having none on MIG). One tenant's instance low
            while its neighbours are busy is that tenant's problem, not the GPU's.""",
            [query(per_device("gpu_utilization_ratio", "gpu_instance_utilization_ratio"),
                   device + " {{profile}}")],
            RATIO, max_val=1),
        graph(
            "Memory used vs total per GPU and GPU instance", """Device memory in use next
            to the total of each whole GPU and each MIG GPU instance (its own slice of the
            GPU's memory, shared by its compute instances). An instance at its total runs
            out of memory however empty its neighbours are.""",
            [query(memory[0], device + " used"), query(memory[1], device + " total")],
            "bytes"),
    ])


IB_STATES = {
    0: ("NOP", "text"),
    1: ("DOWN", "red"),
    2: ("INIT", "orange"),
    3: ("ARMED", "yellow"),
    4: ("ACTIVE", "green"),
    5: ("ACTIVE_DEFER", "green"),
}


def node_communication() -> dash.Row:
    port = "{{device}}/{{port}}"
    return row("Communication", [
        graph(
            "NVLink throughput per GPU (DCGM)", """Bytes per second each GPU sends and
            receives over all its NVLinks. Traffic that stops on every GPU of a job while
            utilization stays high is a collective (NCCL) stall.""",
            [query(per_gpu("gpu_nvlink_tx_bytes_per_second"), "GPU {{gpu}} tx"),
             query(per_gpu("gpu_nvlink_rx_bytes_per_second"), "GPU {{gpu}} rx")],
            BYTES_PER_S),
        graph(
            "NVLinks down per GPU", """NVLinks of each GPU that should be active and are
            not (gpuwatchd_gpu_nvlink_down; 0 while none is). Traffic falls back to fewer
            links or PCIe. The active count with detail_metrics.""",
            [query(f"count by (gpu) (gpuwatchd_gpu_nvlink_down{{{GPU}}}) or "
                   f"{per_gpu('gpu_info')} * 0", "GPU {{gpu}}")], COUNT),
        timeline(
            "InfiniBand port state", """Logical state of each InfiniBand/RoCE port: ACTIVE
            (green) carries traffic; DOWN, INIT or ARMED cut the node off its peers.""",
            [query(host("ib_port_state", "device, port"), port)], IB_STATES),
        graph(
            "InfiniBand port rate vs best", """Each port's current rate and its best (the
            configured expected rate, else the highest seen). Current below best is a port
            that retrained slower: a marginal cable or transceiver.""",
            [query(host("ib_port_rate_bits_per_second", "device, port"), f"{port} rate"),
             query(host("ib_port_rate_max_bits_per_second", "device, port"), f"{port} best")],
            BITS_PER_S),
        graph(
            "InfiniBand throughput", """Bytes per second received and transmitted on each
            port.""",
            [query(host("ib_port_receive_bytes_per_second", "device, port"), f"{port} rx"),
             query(host("ib_port_transmit_bytes_per_second", "device, port"), f"{port} tx")],
            BYTES_PER_S),
        graph(
            "InfiniBand transmit wait", """Share of each port's time it had data to send
            but could not (port_xmit_wait): congestion or a slow peer.""",
            [query(host("ib_port_transmit_wait_ratio", "device, port"), port)],
            RATIO, max_val=1),
    ])


def node_driver() -> dash.Row:
    xid = or_none(f"sum by (gpu, xid) (gpuwatchd_gpu_xid_errors_total{{{GPU}}})", "xid")
    return row("Driver", [
        graph(
            "Xid errors per GPU", """Xid errors the driver reported on each GPU since the
            daemon started, by Xid code (0, code none, while there has been none): each
            step up is an event. 13/31/43 point at the application, 48/63/64/94/95 at
            memory, 79 at the bus or power.""",
            [query(xid, "GPU {{gpu}} Xid {{xid}}")], COUNT),
        graph(
            "ECC errors per GPU", """ECC errors over each GPU's lifetime: corrected
            (single-bit, fixed by ECC) and uncorrected (double-bit: drain and reset the
            GPU).""",
            [query(or_none(f"sum by (gpu, type) (gpuwatchd_gpu_ecc_errors_total{{{GPU}}})",
                           "type"), "GPU {{gpu}} {{type}}")], COUNT),
        timeline(
            "GPU lost", """Whether NVML reports each GPU lost (fallen off the bus): red
            needs a reboot and a hardware check.""",
            [query(f"{per_gpu('gpu_lost')} or {per_gpu('gpu_info')} * 0", "GPU {{gpu}}")],
            {0: ("ok", "green"), 1: ("lost", "red")}),
    ])


def node_system() -> dash.Row:
    return row("System", [
        graph(
            "CPU busy per NUMA node", """Share of each NUMA node's CPUs that was busy. A
            GPU's loader on a saturated NUMA node starves while the node's average looks
            fine. Per-core figures, iowait, steal, disks and pressure (PSI): node_exporter,
            or detail_metrics.""",
            [query(host("cpu_numa_busy_ratio", "numa_node"), "NUMA {{numa_node}}")],
            RATIO, max_val=1),
        graph(
            "Interrupts per second by device class", """Interrupt rate summed per device
            class (nvidia, nvme, nic, usb, other; system = timer and IPI rows).""",
            [query(host("interrupts_per_second", "class", "sum"), "{{class}}")], PER_S),
    ])


def node_self() -> dash.Row:
    return row("gpuwatchd", [
        timeline(
            "Sources up", """Whether each gpuwatchd source's last poll succeeded
            (gpuwatchd_source_up). A source down leaves its panels empty and the rules
            that read it not evaluable.""",
            [query(host("source_up", "source"), "{{source}}")],
            {0: ("down", "red"), 1: ("up", "green")}),
        graph(
            "Rules not evaluable per GPU", """How many starvation rules cannot be evaluated
            on each GPU (an input is missing: no DCGM profiling, no probe, a source down).
            Those causes can be neither confirmed nor ruled out.""",
            [query(count_per_gpu("starvation_not_evaluable"), "GPU {{gpu}}")], COUNT),
    ])


def node() -> dash.Dashboard:
    d = new_dashboard(
        "gpuwatchd / Node", NODE_UID,
        "One node's GPUs: which starvation causes fire, and each dimension's evidence.",
    ).with_variable(datasource_variable())
    d = d.with_variable(label_variable("job", "Job", "gpuwatchd_build_info", multi=False))
    d = d.with_variable(label_variable(
        "node", "Node", 'gpuwatchd_build_info{job=~"$job"}', multi=False))
    d = d.with_variable(label_variable(
        "gpu", "GPU", 'gpuwatchd_gpu_info{job=~"$job", node=~"$node"}', multi=True,
        sort=model.VariableSort.NUMERICAL_ASC))
    for r in (node_causes(), node_pcie(), node_compute(), node_instances(), node_input(),
              node_communication(), node_driver(), node_system(), node_self()):
        d = d.with_row(r)
    return d


# --- one job (gpuwatchd report's numbers) -----------------------------------------------

JOB_UID = "gpuwatchd-job"
# deploy/prometheus/jobs.yaml, group gpuwatchd.jobs.accounting: each sample is the
# GPU-hours of one minute, so sum_over_time over the time range is the range's GPU-hours,
# the totals `gpuwatchd report` prints for the same window (docs/report.md).
THE_JOB = 'job_id="$job_id"'
# the job's owner series, per GPU and per MIG GPU instance
JOB_OWNER = f'{{{OWNER_INFO}, {THE_JOB}}}'
# 1 while any cause fires on a GPU (gpuwatchd_gpu_starved) or on a MIG GPU instance (its
# own causes; 0 while none does), to join with JOB_OWNER
STARVED_DEVICE = (
    "(gpuwatchd_gpu_starved or max by (job, instance, node, gpu, uuid, gpu_instance)"
    ' (gpuwatchd_starvation_active{gpu_instance!=""} or 0 * gpuwatchd_gpu_instance_info))'
)


def job_total(rule: str, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (sum_over_time({rule}{{{THE_JOB}}}[$__range]))"


HELD = job_total("job_id:gpuwatchd_gpu_hours:sampled1m")


def job_summary() -> dash.Row:
    starved = job_total("job_id:gpuwatchd_starvation_gpu_hours:sampled1m")
    return row("Job $job_id over the time range", [
        big_number(
            "GPU-hours of the job", """GPU-hours the job held over the dashboard's time
            range: its owned GPUs sampled every minute (job_id:gpuwatchd_gpu_hours:sampled1m
            from deploy/prometheus/jobs.yaml). Set the time range to the job's run; gpuwatchd
            report prints the same number.""",
            query(HELD, instant=True), GPU_HOURS),
        big_number(
            "GPU-hours lost to starvation", """GPU-hours during which at least one
            starvation cause fired on a GPU of the job, over the time range
            (job_id:gpuwatchd_starvation_gpu_hours:sampled1m).""",
            query(starved, instant=True), GPU_HOURS),
        big_number(
            "Share of the job's GPU time starved", """GPU time lost to any cause over the
            GPU time the job held, over the time range: the headline of gpuwatchd report.""",
            query(f"{starved} / {HELD}", instant=True), RATIO, red_from=0.1),
        big_number(
            "GPUs of the job", """GPUs (and MIG GPU instances) that
            gpuwatchd_gpu_owner_info (gpuwatchd_gpu_instance_owner_info) names as the job's
            at any time in the range, on every node it ran on.""",
            query(f"count(group by (job, instance, uuid, gpu_instance) "
                  f"(max_over_time({JOB_OWNER}[$__range])))", instant=True), COUNT),
        bars(
            "GPU-hours lost per cause", """GPU-hours each starvation cause cost the job over
            the time range (job_id_cause:gpuwatchd_starvation_gpu_hours:sampled1m), largest
            first; causes that never fired show zero. Two causes at once each count.""",
            query(f"sort_desc({job_total(CAUSE_GPU_HOURS, 'cause')})", "{{cause}}",
                  instant=True),
            GPU_HOURS, width=12, height=10),
        bars(
            "Share of GPU time lost per dimension", """Per dimension (pcie, input, compute,
            communication, driver, system), the share of the job's GPU time during which a
            cause of that dimension fired; two causes of one dimension at once count
            once (job_id_dimension:gpuwatchd_starvation_gpu_hours:sampled1m).""",
            query(f"sort_desc({job_total(DIMENSION_GPU_HOURS, 'dimension')} / scalar({HELD}))",
                  "{{dimension}}", instant=True),
            RATIO, width=12, height=10),
        graph(
            "GPUs of the job starved, per cause", """How many of the job's GPUs each cause
            starved, minute by minute (the accounting rule times 60), stacked: when in the
            run each cause struck and how widely.""",
            [query(f"sum by (cause) ({CAUSE_GPU_HOURS}{{{THE_JOB}}}) * 60 > 0", "{{cause}}")],
            COUNT, stack=True, width=24),
        bars(
            "Worst GPUs of the job", """The 10 GPUs (or MIG GPU instances) of the job
            starved the largest share of the time range (gpuwatchd_gpu_starved, or an
            instance's own causes, joined with the owner, averaged over the range): a node
            or rank that stands out is where to look first.""",
            query("sort_desc(" + with_where(
                "topk(10, avg by (node, gpu, gpu_instance) (avg_over_time(("
                f"{STARVED_DEVICE} * on (job, instance, uuid, gpu_instance) group_left ()"
                f" {JOB_OWNER})[$__range:])))") + ")",
                  "{{node}} GPU {{gpu}}" + WHERE, instant=True),
            RATIO, width=12, height=10),
        grid(
            "What the daemon saw, and the fix", """Each cause that fired on a GPU (or
            MIG GPU instance) of the job in the time range, per node and GPU, with
            the evidence the daemon froze when
            it started firing (summary) and the remedy (gpuwatchd_starvation_info joined
            with the owner). Empty when nothing fired.""",
            [query("max by (node, gpu, gpu_instance, cause, dimension, summary, remedy)"
                   " (max_over_time((gpuwatchd_starvation_info * on (job, instance, uuid,"
                   f" gpu_instance) group_left () {JOB_OWNER})[$__range:]))", instant=True)],
            columns=["node", "gpu", "gpu_instance", "cause", "dimension", "summary",
                     "remedy"],
            width=12, height=10),
    ])


CAUSE_GPU_HOURS = "job_id_cause:gpuwatchd_starvation_gpu_hours:sampled1m"
DIMENSION_GPU_HOURS = "job_id_dimension:gpuwatchd_starvation_gpu_hours:sampled1m"


def job() -> dash.Dashboard:
    d = new_dashboard(
        "gpuwatchd / Job", JOB_UID,
        "One job's GPU-hours, what starved them and the fix: gpuwatchd report's numbers.",
    ).time("now-24h", "now").with_variable(datasource_variable())
    d = d.with_variable(label_variable(
        "job_id", "Job ID", f'{{{OWNER_INFO}, job_id!=""}}', multi=False))
    return d.with_row(job_summary())


# --- JSON ------------------------------------------------------------------------------

DASHBOARDS = {"fleet.json": fleet, "node.json": node, "job.json": job}


def _prune(value: Any) -> Any:
    """Drop None values (Grafana fills its defaults in)."""
    if isinstance(value, dict):
        # a threshold's base step keeps "value": null (Grafana reads it as -Infinity)
        return {k: _prune(v) for k, v in value.items() if v is not None or k == "value"}
    if isinstance(value, list):
        return [_prune(v) for v in value]
    return value


def _finish(d: dict[str, Any]) -> dict[str, Any]:
    """Rows expanded (their panels follow them), stable ids, tidy variables."""
    panels: list[dict[str, Any]] = []
    for p in d.get("panels", []):
        nested = p.pop("panels", None) if p.get("type") == "row" else None
        panels.append(p)
        if nested is not None:
            p["panels"] = []
            p["collapsed"] = False
            panels.extend(nested)
    for i, p in enumerate(panels, 1):
        p["id"] = i
    d["panels"] = panels
    for v in d.get("templating", {}).get("list", []):
        v.pop("id", None)  # Grafana keys variables by name
        for key in ("auto", "auto_count", "auto_min"):  # interval variables only
            v.pop(key, None)
    return d


def render(name: str) -> str:
    """The JSON text of dashboard file `name` (fleet.json, node.json)."""
    built = DASHBOARDS[name]().build()
    data = _finish(_prune(json.loads(JSONEncoder().encode(built))))
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grafana.dashboards", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE, help="folder (default: grafana/)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a file differs from the generator's")
    args = parser.parse_args(argv)
    stale = []
    for name in DASHBOARDS:
        path = args.out / name
        text = render(name)
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path))
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if stale:
        print("out of date: " + ", ".join(stale) + " (run python -m grafana.dashboards)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
