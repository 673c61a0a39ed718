"""`bench serve --plot`: the matrix's latency distributions as box plots a person can read.

One PNG per policy. Rows are (model, route) pairs, columns are (output length, metric) with the
metric TTFT or completion time; inside a panel every input length is a group on the x axis and
every artifact a coloured box in that group, so all the run's inputs and routes are visible at
once. A cell that did not run is marked where its box would be, with why ("no fit": `plan.fit`
says it does not fit; "rejected": the artifact or the request breaks a rule; "error"). The y axis
is logarithmic when a panel's values span more than `LOG_SPAN` (short and long prompts side by
side), linear and auto-scaled otherwise; the timeout is drawn only when it lies within the
panel's range, and named in the title when it is off the scale.

`panels(report)` computes all of that without matplotlib (tested directly); `write_plot` draws it.
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
    from atombatch.scheduler import Policy
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


def write_plot(report: Any, path: Path) -> list[Path]:
    """Draw the panels of every policy; `path` for the first, `stem-<policy>.png` for others.

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
        _draw(panels(report, policy), policy, report.runtime, target)
        written.append(target)
    return written


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
