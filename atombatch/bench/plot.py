"""`bench serve --plot`: the matrix as pictures a person reads at a glance.

The default (`--plot PATH`) is a summary of six panels, one PNG per policy. The top row is the
headline workload (the run's longest prompt and longest output on the native route, the origin
issue's 8192 in / 128 out at c16 by default) across every model: TTFT p99, completion max and
output tok/s, one bar per artifact in each model's group. The bottom row follows the run's first
model (`--models` order) across prompt lengths, one line per artifact: TTFT p99 and output tok/s,
and TTFT p99 per route at the headline workload (or completion max per prompt length when the
run has one route). A cell that did not run has no bar or point, and its group names why ("no
fit", "rejected", "error", "timeout": every request over the timeout); bars of `--ignore-fit`
cells are hatched. A y axis is logarithmic when its values span more than `LOG_SPAN`.

The full grid (`--plot-grid PATH`) draws every request's latency: rows are (model, route) pairs,
columns are (output length, metric) with the metric TTFT or completion time; inside a panel every
input length is a group on the x axis and every artifact a coloured box in that group. A cell
that did not run is marked where its box would be, with why. The y axis is logarithmic when a
panel's values span more than `LOG_SPAN`, linear otherwise; the timeout is drawn only when it lies
within the panel's range, and named in the title when it is off the scale.

`summary(report)` and `panels(report)` compute all of that without matplotlib (tested directly);
`write_plot` draws it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from atombatch.errors import ConfigError

LOG_SPAN = 30.0            # max/min ratio past which a panel's y axis is logarithmic
TIMEOUT_IN_RANGE = 1.5     # the timeout line is drawn when it is below 1.5x the panel's max
METRICS = (("ttft", "TTFT"), ("e2e", "completion"))
_STATUS_MARK = {"not-run: does not fit": "no fit", "rejected": "rejected", "error": "error"}


class Box(msgspec.Struct, frozen=True):
    """One artifact at one input length: its request latencies, or why there are none."""

    input_len: int
    artifact: str
    values: list[float]                  # seconds, every request that produced the metric
    mark: str | None = None              # "no fit" | "rejected" | "error" | "no data"
    hypothetical: bool = False           # ran with --ignore-fit although it does not fit


class Panel(msgspec.Struct, frozen=True):
    model: str
    route: str
    output_len: int
    metric: str                          # "ttft" | "e2e"
    title: str
    boxes: list[Box]
    log_scale: bool
    timeout_line: float | None           # drawn at this height, or None (off the scale / none)


class Point(msgspec.Struct, frozen=True):
    """One artifact's figure in one group of a summary panel, or why there is none."""

    group: str                           # the x category: a model, "in 8192", a route
    artifact: str
    value: float | None
    mark: str | None = None              # "no fit" | "rejected" | "error" | "timeout" | ...
    late: int = 0                        # requests over the timeout (not in the latency)
    hypothetical: bool = False           # ran with --ignore-fit although it does not fit


class SummaryPanel(msgspec.Struct, frozen=True):
    title: str
    ylabel: str
    kind: str                            # "bars" (groups side by side) | "lines" (x = groups)
    groups: list[str]
    points: list[Point]
    log_scale: bool


MARKERS = "os^Dv<>P*X"
SUMMARY_METRICS = {"ttft": "TTFT p99", "e2e": "completion max", "tok_s": "output tok/s"}


def _figure(cell: Any, metric: str) -> tuple[float | None, str | None]:
    """The summary figure of one cell: TTFT p99 or completion max over the on-time requests,
    or the output tokens per second over the makespan; or why there is none."""
    if cell is None:
        return None, "not in run"
    if cell.status != "ok":
        return None, _STATUS_MARK.get(cell.status, cell.status)
    if metric == "tok_s":
        return (cell.output_tok_s, None) if cell.output_tok_s > 0 else (None, "no data")
    latency = cell.ttft if metric == "ttft" else cell.completion
    value = None if latency is None else (latency.p99 if metric == "ttft" else latency.max)
    if value is None:
        return None, "timeout" if cell.timeouts else "no data"
    return value, None


def _point(cells: Sequence[Any], group: str, metric: str, artifact: str, **where: Any) -> Point:
    cell = next((c for c in cells if c.artifact == artifact and
                 all(getattr(c, k) == v for k, v in where.items())), None)
    value, mark = _figure(cell, metric)
    return Point(group, artifact, value, mark, late=cell.timeouts if cell is not None else 0,
                 hypothetical=bool(cell is not None and cell.hypothetical))


def _summary_panel(title: str, metric: str, kind: str, groups: list[str],
                   points: list[Point], unit: str) -> SummaryPanel:
    values = [p.value for p in points if p.value is not None and p.value > 0]
    log_scale = bool(values) and max(values) / min(values) > LOG_SPAN
    ylabel = "tok/s" if metric == "tok_s" else unit
    return SummaryPanel(title=f"{title}: {SUMMARY_METRICS[metric]}", ylabel=ylabel, kind=kind,
                        groups=groups, points=points, log_scale=log_scale)


def summary(report: Any, policy: str | None = None) -> list[SummaryPanel]:
    """The six headline panels of `report` (a `ServeReport`) for `policy` (default: the first
    policy of the run); see the module's docstring."""
    from atombatch.engine.scheduler import Policy
    params = report.params
    policy_label = Policy.parse(policy or params["policies"][0]).label
    cells = [c for c in report.cells if c.policy == policy_label]
    artifacts = list(dict.fromkeys(params["artifacts"]))
    models = list(dict.fromkeys(params["models"]))
    routes = list(dict.fromkeys(params["routes"]))
    inputs = sorted(set(params["inputs"]))
    top_in, top_out = inputs[-1], max(params["outputs"])
    route = "native" if "native" in routes else routes[0]
    first = models[0]
    unit = "s (virtual)" if report.runtime == "sim" else "s (wall)"
    load = params["load"]
    clients = f"c{load['concurrency']}" if load.get("concurrency") else ""
    workload = f"in {top_in} / out {top_out} {route} {clients}".strip()
    out = [_summary_panel(workload, metric, "bars", models,
                          [_point(cells, m, metric, a, model=m, route=route, input_len=top_in,
                                  output_len=top_out) for m in models for a in artifacts], unit)
           for metric in ("ttft", "e2e", "tok_s")]
    by_input = [f"in {i}" for i in inputs]
    for metric in ("ttft", "tok_s"):
        out.append(_summary_panel(f"{first} {route} out {top_out}", metric, "lines", by_input,
                                  [_point(cells, f"in {i}", metric, a, model=first, route=route,
                                          input_len=i, output_len=top_out)
                                   for i in inputs for a in artifacts], unit))
    if len(routes) > 1:
        out.append(_summary_panel(f"{first} in {top_in} / out {top_out} by route", "ttft", "bars",
                                  routes, [_point(cells, r, "ttft", a, model=first, route=r,
                                                  input_len=top_in, output_len=top_out)
                                           for r in routes for a in artifacts], unit))
    else:
        out.append(_summary_panel(f"{first} {route} out {top_out}", "e2e", "lines", by_input,
                                  [_point(cells, f"in {i}", "e2e", a, model=first, route=route,
                                          input_len=i, output_len=top_out)
                                   for i in inputs for a in artifacts], unit))
    return out


def require_matplotlib() -> None:
    """Fail before a run, not after it, when --plot cannot be drawn.

    Raises:
        ConfigError: matplotlib is not installed.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'atombatch[plot]' (checked "
                          "before the run, so nothing was measured)") from None


def panels(report: Any, policy: str | None = None) -> list[Panel]:
    """Every (model, route, output, metric) panel of `report` (a `ServeReport`) for `policy`
    (default: the first policy of the run)."""
    from atombatch.engine.scheduler import Policy
    params = report.params
    policy_label = Policy.parse(policy or params["policies"][0]).label
    timeout = params["load"]["timeout_s"]
    cells = [c for c in report.cells if c.policy == policy_label]
    artifacts = list(dict.fromkeys(params["artifacts"]))
    inputs = sorted(set(params["inputs"]))
    out: list[Panel] = []
    for model in params["models"]:
        for route in params["routes"]:
            here = [c for c in cells if c.model == model and c.route == route]
            if not here:
                continue
            for output_len in sorted(set(params["outputs"])):
                for metric, name in METRICS:
                    boxes = [_box(here, input_len, output_len, artifact, metric)
                             for input_len in inputs for artifact in artifacts]
                    values = [v for b in boxes for v in b.values if v > 0]
                    top = max(values, default=0.0)
                    log_scale = bool(values) and top / min(values) > LOG_SPAN
                    shown = timeout if timeout is not None and values and \
                        timeout <= top * TIMEOUT_IN_RANGE else None
                    off = f"; timeout {timeout:g} s off scale" if timeout is not None and \
                        shown is None and values else ""
                    out.append(Panel(model=model, route=route, output_len=output_len,
                                     metric=metric, title=f"{model} {route} out {output_len}: "
                                     f"{name}{off}", boxes=boxes, log_scale=log_scale,
                                     timeout_line=shown))
    return out


def _box(cells: Sequence[Any], input_len: int, output_len: int, artifact: str,
         metric: str) -> Box:
    cell = next((c for c in cells if (c.input_len, c.output_len, c.artifact) ==
                 (input_len, output_len, artifact)), None)
    if cell is None:
        return Box(input_len, artifact, [], mark="not in run")
    if cell.status != "ok":
        return Box(input_len, artifact, [], mark=_STATUS_MARK.get(cell.status, cell.status))
    values = [getattr(r, metric) for r in cell.request_records if getattr(r, metric) is not None]
    return Box(input_len, artifact, values, mark=None if values else "no data",
               hypothetical=cell.hypothetical)


def write_plot(report: Any, path: Path, grid: bool = False) -> list[Path]:
    """Draw the summary (or with `grid` the full grid) of every policy; `path` for the first,
    `stem-<policy>.png` for the others.

    Raises:
        ConfigError: matplotlib is missing, or no cell of the run produced a latency.
    """
    require_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    policies = list(dict.fromkeys(report.params["policies"]))
    if not any(c.status == "ok" for c in report.cells):
        raise ConfigError("--plot: no cell ran, so there is nothing to plot")
    written = []
    for n, policy in enumerate(policies):
        target = path if n == 0 else path.with_name(
            f"{path.stem}-{policy.replace(':', '')}{path.suffix or '.png'}")
        if grid:
            _draw(panels(report, policy), policy, report.runtime, target)
        else:
            _draw_summary(summary(report, policy), policy, target)
        written.append(target)
    return written


def _draw_summary(all_panels: list[SummaryPanel], policy: str, path: Path) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.transforms import blended_transform_factory

    fig, axes = plt.subplots(2, 3, squeeze=False, figsize=(15, 8.6))
    artifacts = list(dict.fromkeys(p.artifact for panel in all_panels for p in panel.points))
    colours = {a: plt.get_cmap("tab10")(i % 10) for i, a in enumerate(artifacts)}
    width = 0.8 / max(len(artifacts), 1)
    for ax, panel in zip(axes.flat, all_panels, strict=False):
        marks = blended_transform_factory(ax.transData, ax.transAxes)
        for artifact in artifacts:
            mine = [p for p in panel.points if p.artifact == artifact]
            offset = (artifacts.index(artifact) - (len(artifacts) - 1) / 2) * width
            if panel.kind == "lines":  # nudged apart and marked apart: equal figures stay visible
                xs = [panel.groups.index(p.group) + offset * 0.3 for p in mine]
                ys = [p.value if p.value is not None else float("nan") for p in mine]
                ax.plot(xs, ys, marker=MARKERS[artifacts.index(artifact) % len(MARKERS)],
                        markersize=5, linewidth=1.2, color=colours[artifact], alpha=0.9)
            for p in mine:
                x = panel.groups.index(p.group) + (offset if panel.kind == "bars" else 0.0)
                if p.value is not None and panel.kind == "bars":
                    ax.bar(x, p.value, width * 0.9, color=colours[artifact],
                           hatch="//" if p.hypothetical else None,
                           edgecolor="white" if p.hypothetical else None)
                if p.value is not None and p.late:
                    ax.annotate(f"{p.late} late", (x, p.value), fontsize=6, ha="center",
                                va="bottom", color="red")
                if p.value is None and panel.kind == "bars":
                    ax.plot([x], [0.03], marker="x", color=colours[artifact], transform=marks,
                            clip_on=False)
                    ax.text(x, 0.07, p.mark or "", rotation=90, fontsize=7, ha="center",
                            va="bottom", transform=marks, color="dimgray")
        ax.set_xticks(range(len(panel.groups)), panel.groups)
        ax.set_xlim(-0.5, len(panel.groups) - 0.5)
        if panel.log_scale:
            ax.set_yscale("log")
        ax.set_title(panel.title, fontsize=10)
        ax.set_ylabel(panel.ylabel, fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(all_panels):]:
        ax.set_visible(False)
    handles = [Patch(facecolor=colours[a], label=a) for a in artifacts]
    fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 8), fontsize=9,
               title=f"artifact (policy {policy}; x = did not run; hatched = --ignore-fit; "
                     "every request's latency: --plot-grid)", title_fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _draw(all_panels: list[Panel], policy: str, runtime: str, path: Path) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.transforms import blended_transform_factory

    rows = list(dict.fromkeys((p.model, p.route) for p in all_panels))
    columns = list(dict.fromkeys((p.output_len, p.metric) for p in all_panels))
    fig, axes = plt.subplots(len(rows), len(columns), squeeze=False,
                             figsize=(4.6 * len(columns), 3.0 * len(rows) + 0.8))
    artifacts = list(dict.fromkeys(b.artifact for p in all_panels for b in p.boxes))
    colours = {a: plt.get_cmap("tab10")(i % 10) for i, a in enumerate(artifacts)}
    width = 0.8 / max(len(artifacts), 1)
    unit = "s (virtual)" if runtime == "sim" else "s (wall)"
    for panel in all_panels:
        ax = axes[rows.index((panel.model, panel.route))][columns.index(
            (panel.output_len, panel.metric))]
        inputs = list(dict.fromkeys(b.input_len for b in panel.boxes))
        marks = blended_transform_factory(ax.transData, ax.transAxes)
        for box in panel.boxes:
            x = inputs.index(box.input_len) + (artifacts.index(box.artifact) -
                                               (len(artifacts) - 1) / 2) * width
            if box.values:
                art = ax.boxplot([box.values], positions=[x], widths=width * 0.85,
                                 patch_artist=True, showfliers=True,
                                 flierprops={"markersize": 2},
                                 medianprops={"color": "black"})
                for patch in art["boxes"]:
                    patch.set_facecolor(colours[box.artifact])
                    patch.set_alpha(0.45 if box.hypothetical else 0.85)
            else:
                ax.plot([x], [0.04], marker="x", color=colours[box.artifact], transform=marks,
                        clip_on=False)
                ax.text(x, 0.08, box.mark or "", rotation=90, fontsize=6, ha="center",
                        va="bottom", transform=marks, color="dimgray")
        ax.set_xticks(range(len(inputs)), [f"in {i}" for i in inputs])
        ax.set_xlim(-0.5, len(inputs) - 0.5)
        if panel.log_scale:
            ax.set_yscale("log")
        if panel.timeout_line is not None:
            ax.axhline(panel.timeout_line, color="red", linestyle="--", linewidth=0.8)
            ax.text(0.99, panel.timeout_line, " timeout", color="red", fontsize=7, ha="right",
                    va="bottom", transform=blended_transform_factory(ax.transAxes, ax.transData))
        ax.set_title(panel.title, fontsize=8)
        ax.set_ylabel(unit, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    handles = [Patch(facecolor=colours[a], label=a) for a in artifacts]
    fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 8), fontsize=8,
               title=f"artifact (policy {policy}; x = not run, faded = --ignore-fit)",
               title_fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.8 / (3.0 * len(rows) + 0.8)))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
