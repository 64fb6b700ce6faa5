"""The job's timeline drawn as one SVG image (``flashckpt report --svg``, and the heart of the
``--html`` page): a lane of training progress with the faults marked on it, a lane of
recoveries split into their phases, and one lane per tier with its commits, lag and outages.

Plain SVG written here, no plotting library: every mark carries its details as a ``<title>``
(the hover text browsers show) and as ``data-`` attributes, so the page needs no script.
"""

from __future__ import annotations

import math
import time
from xml.sax.saxutils import escape as _escape
from xml.sax.saxutils import quoteattr

from ..faults.report import Report
from ..faults.timeline import Recovery, Timeline, thin

WIDTH = 1200
LEFT, RIGHT = 150, 20  # room for lane labels, and after the last moment
PLOT = WIDTH - LEFT - RIGHT
MAX_ROWS = 4  # recoveries closer than their bars are long overlap beyond this

FAULT_COLORS = {"exit": "#d62728", "hang": "#ff7f0e", "node": "#9467bd", "exception": "#1f77b4"}
PHASE_COLORS = {"detect": "#e377c2", "decide": "#bcbd22", "restart": "#ff9896",
                "round": "#98df8a", "restore": "#17becf", "first step": "#c7c7c7",
                "recompute": "#8c564b"}  # fmt: skip
PATH_COLORS = {"in-process": "#2ca02c", "restart": "#d62728", "node replaced": "#9467bd"}
SOURCE_COLORS = {"own memory": "#2ca02c", "peer": "#9467bd", "tier": "#7f7f7f", "none": "#000"}


def esc(text: object) -> str:
    return _escape(str(text))


def _attrs(**kv: object) -> str:
    return "".join(f" {k.rstrip('_').replace('_', '-')}={quoteattr(str(v))}" for k, v in kv.items())


def _el(tag: str, title: str | None = None, **kv: object) -> str:
    inner = f"<title>{esc(title)}</title>" if title else ""
    return f"<{tag}{_attrs(**kv)}>{inner}</{tag}>"


def effective_shown(report: Report) -> str:
    """The effective training time as the page and the image show it (the text report's)."""
    effective = report.effective()
    return "n/a" if effective is None else f"{100 * effective:.1f}%"


def headline(report: Report) -> str:
    return f"effective training time {effective_shown(report)}; {len(report.failures)} failure(s)"


def clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) + " UTC"


def span(s: float) -> str:
    """A duration as people read it: 0.42 s, 3.1 min, 2.5 h."""
    if s < 120:
        return f"{s:.2f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


class _Scale:
    def __init__(self, start: float, end: float):
        self.start, self.end = start, max(end, start + 1e-3)

    def x(self, t: float) -> float:
        return LEFT + PLOT * (t - self.start) / (self.end - self.start)

    def ticks(self) -> list[tuple[float, str]]:
        """About eight ticks at round offsets from the start."""
        total = self.end - self.start
        raw = total / 8
        unit = next((u for u in (0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900,
                                 1800, 3600, 7200, 21600, 43200, 86400) if u >= raw), 86400.0)  # fmt: skip
        out, k = [], 0
        while k * unit <= total + 1e-9:
            out.append((self.start + k * unit, "+" + span(k * unit)))
            k += 1
        return out


def _progress_lane(tl: Timeline, sc: _Scale, top: float, height: float) -> list[str]:
    out = [
        f'<text x="10" y="{top + 16}" class="lane">training</text>',
        f'<text x="10" y="{top + 32}" class="note">newest step</text>',
    ]
    points = thin(tl.progress, sc.start, sc.end, PLOT)
    top_step = max((s for _, s, _ in points), default=0) or 1

    def y(step: int) -> float:
        return top + height - 4 - (height - 24) * step / top_step

    out.append(_el("rect", None, x=LEFT, y=top, width=PLOT, height=height, class_="lanebg"))
    if points:
        path = []
        for i, (t, step, _) in enumerate(points):
            if i:
                path.append(f"H{sc.x(t):.1f}")
                path.append(f"V{y(step):.1f}")
            else:
                path.append(f"M{sc.x(t):.1f},{y(step):.1f}")
        path.append(f"H{sc.x(sc.end):.1f}")
        out.append(_el("path", None, d=" ".join(path), class_="progress"))
        for t, step, n in points:
            what = f"step {step} at {clock(t)}" + (f" ({n} events in this column)" if n > 1 else "")
            out.append(_el("circle", what, cx=f"{sc.x(t):.1f}", cy=f"{y(step):.1f}", r=1.6,
                           class_="dot"))  # fmt: skip
        out.append(
            f'<text x="{LEFT - 6}" y="{y(top_step) + 4:.1f}" class="axis end">{top_step}</text>'
        )
        out.append(f'<text x="{LEFT - 6}" y="{y(0) + 4:.1f}" class="axis end">0</text>')
    return out


def _fault_mark(r: Recovery, sc: _Scale, y: float, bottom: float) -> str:
    f = r.failure
    t = f.at - f.detect_s
    x = sc.x(t)
    color = FAULT_COLORS.get(f.kind, "#000")
    ranks = sorted({k for k in f.ranks if isinstance(k, int)})
    what = {"exit": "worker exited", "hang": "hang", "node": "node lost",
            "exception": "exception"}.get(f.kind, f.kind)  # fmt: skip
    title = (f"{what} on {f.node or 'an unnamed node'}, rank(s) {ranks or '?'}, at {clock(t)} "
             f"(+{span(t - sc.start)}); {r.path}, restored step {f.restored_step} from "
             f"{r.source}; training again {span(r.end - t)} later")  # fmt: skip
    shape = {"exit": f"M{x - 5:.1f},{y - 5} L{x + 5:.1f},{y + 5} M{x - 5:.1f},{y + 5} "
                     f"L{x + 5:.1f},{y - 5}",
             "hang": f"M{x - 4:.1f},{y - 5} h8 v10 h-8 Z",
             "node": f"M{x:.1f},{y - 6} L{x + 6:.1f},{y} L{x:.1f},{y + 6} L{x - 6:.1f},{y} Z",
             }.get(f.kind, f"M{x:.1f},{y - 6} L{x + 6:.1f},{y + 5} L{x - 6:.1f},{y + 5} Z")  # fmt: skip
    line = f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y}" y2="{bottom}" class="faultline" stroke="{color}"/>'
    return (f'<g class="fault"{_attrs(data_kind=f.kind, data_time=f"{t:.3f}", data_node=f.node or "", data_ranks=",".join(map(str, ranks)))}>'
            f"<title>{esc(title)}</title>{line}"
            f'<path d="{shape}" stroke="{color}" fill="{color}" stroke-width="2.5"/></g>')  # fmt: skip


def _recovery_lane(tl: Timeline, sc: _Scale, top: float, row_h: float) -> tuple[list[str], float]:
    rows: list[float] = []  # each row's last end, in x
    out = [f'<text x="10" y="{top + 16}" class="lane">recoveries</text>',
           f'<text x="10" y="{top + 32:.0f}" class="note">phases; edge: path</text>']  # fmt: skip
    placed = []
    for r in tl.recoveries:
        x0, x1 = sc.x(r.start), max(sc.x(r.end), sc.x(r.start) + 4)
        row = next((i for i, end in enumerate(rows) if end + 2 < x0), None)
        if row is None and len(rows) < MAX_ROWS:
            rows.append(x1)
            row = len(rows) - 1
        elif row is None:  # crowded: over the row that frees first
            row = min(range(len(rows)), key=rows.__getitem__)
        rows[row] = x1
        placed.append((r, row))
    height = max(1, len(rows)) * row_h + 20
    out.append(_el("rect", None, x=LEFT, y=top, width=PLOT, height=height, class_="lanebg"))
    for r, row in placed:
        y = top + 10 + row * row_h
        out.append(_recovery_bar(r, sc, y, row_h - 8))
    return out, height


def _recovery_bar(r: Recovery, sc: _Scale, y: float, h: float) -> str:
    f = r.failure
    parts = []
    for p in r.phases:
        x0 = sc.x(p.start)
        w = max(sc.x(p.end) - x0, 0.6)
        parts.append(_el("rect", f"{p.name}: {span(p.end - p.start)}", x=f"{x0:.2f}", y=y,
                         width=f"{w:.2f}", height=h, fill=PHASE_COLORS.get(p.name, "#999")))  # fmt: skip
    x0, x1 = sc.x(r.start), max(sc.x(r.end), sc.x(r.start) + 4)
    phases = ", ".join(f"{p.name} {span(p.end - p.start)}" for p in r.phases)
    title = (f"{f.kind} at {clock(r.start)}: {r.path}"
             + (f" (in-process fell back: {f.fallback})" if f.fallback else "")
             + f"; restored step {f.restored_step} from {r.source}"
             + (f" ({', '.join(f.sources)})" if f.sources else "") + f"; {phases}")  # fmt: skip
    edge = _el("rect", None, x=f"{x0 - 1:.2f}", y=y - 1, width=f"{x1 - x0 + 2:.2f}", height=h + 2,
               fill="none", stroke=PATH_COLORS.get(r.path, "#000"), stroke_width=1.5)  # fmt: skip
    source = _el("rect", f"restored from {r.source}", x=f"{x1 + 2:.2f}", y=y + h / 4,
                 width=5, height=h / 2, fill=SOURCE_COLORS.get(r.source, "#000"))  # fmt: skip
    return (f'<g class="recovery"{_attrs(data_kind=f.kind, data_path=r.path, data_source=r.source, data_start=f"{r.start:.3f}", data_end=f"{r.end:.3f}")}>'
            f"<title>{esc(title)}</title>{''.join(parts)}{edge}{source}</g>")  # fmt: skip


LABEL_CHARS = 18  # what fits in a lane's label at its font


def tier_label(url: str, width: int = LABEL_CHARS) -> str:
    """A tier's name for its lane: its scheme and where it keeps the job, its query dropped
    (``pfs …/run7``, ``s3 bucket/…/run1``, ``peer auto``), the end kept where it is too long;
    the whole URL is the label's tooltip."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url if len(url) <= width else url[: width - 1] + "…"
    host, _, path = rest.split("?", 1)[0].rstrip("/").partition("/")
    last = path.rsplit("/", 1)[-1]
    if not path:
        where = host
    elif not host:
        where = ("…/" if "/" in path else "/") + last
    else:
        where = f"{host}/…/{last}" if "/" in path else f"{host}/{last}"
    label = f"{scheme} {where}"
    if len(label) > width:
        keep = max(width - len(scheme) - 2, 1)
        label = f"{scheme} …{(last or host)[-keep:]}"
    return label


def _tier_lane(lane, sc: _Scale, top: float, height: float) -> list[str]:
    name = tier_label(lane.tier)
    newest = lane.commits[-1].step if lane.commits else None
    out = [f'<text x="10" y="{top + 16}" class="lane">{esc(name)}<title>{esc(lane.tier)}</title></text>',
           f'<text x="10" y="{top + 32}" class="note">{len(lane.commits)} commits, to step '
           f"{newest}</text>",
           _el("rect", None, x=LEFT, y=top, width=PLOT, height=height, class_="lanebg")]  # fmt: skip
    for start, end, error in lane.outages:
        x0 = sc.x(start)
        out.append(_el("rect", f"failing from {clock(start)} for {span(end - start)}: {error}",
                       x=f"{x0:.1f}", y=top, width=f"{max(sc.x(end) - x0, 2):.1f}",
                       height=height, class_="outage"))  # fmt: skip
    points = thin([(c.t, c) for c in lane.commits], sc.start, sc.end, PLOT)
    most_lag = max((c.lag for _, c, _ in points), default=0) or 1
    for t, c, n in points:
        x = sc.x(t)
        what = (f"step {c.step} committed at {clock(t)}, {c.lag} step(s) behind the newest "
                f"saved, {c.bytes / 2**20:.1f} MiB in {c.seconds:.2f} s"
                + (f" (the last of {n} commits in this column)" if n > 1 else ""))  # fmt: skip
        out.append(_el("line", what, x1=f"{x:.1f}", x2=f"{x:.1f}", y1=top + 4,
                       y2=top + height / 2, class_="commit"))  # fmt: skip
        lag_h = (height / 2 - 6) * c.lag / most_lag
        if c.lag:
            out.append(_el("rect", f"lag {c.lag} step(s) at step {c.step}", x=f"{x - 0.8:.1f}",
                           y=f"{top + height - 2 - lag_h:.1f}", width=1.6, height=f"{lag_h:.1f}",
                           class_="lag"))  # fmt: skip
    return out


def _axis(sc: _Scale, y: float) -> list[str]:
    out = [f'<line x1="{LEFT}" x2="{LEFT + PLOT}" y1="{y}" y2="{y}" class="axisline"/>']
    for t, label in sc.ticks():
        x = sc.x(t)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y}" y2="{y + 5}" class="axisline"/>')
        out.append(f'<text x="{x:.1f}" y="{y + 18}" class="axis mid">{esc(label)}</text>')
    out.append(f'<text x="{LEFT}" y="{y + 36}" class="note">from {esc(clock(sc.start))} to '
               f"{esc(clock(sc.end))} ({esc(span(sc.end - sc.start))})</text>")  # fmt: skip
    return out


def _legend(y: float) -> list[str]:
    out, x = [], LEFT
    items = ([(f"fault: {k}", c) for k, c in FAULT_COLORS.items()]
             + [(k, c) for k, c in PHASE_COLORS.items()]
             + [(f"path: {k}", c) for k, c in PATH_COLORS.items()]
             + [(f"from {k}", c) for k, c in SOURCE_COLORS.items() if k != "none"])  # fmt: skip
    for label, color in items:
        width = 14 + 6.2 * len(label)
        if x + width > WIDTH - RIGHT:
            x, y = LEFT, y + 16
        out.append(f'<rect x="{x:.0f}" y="{y - 9}" width="10" height="10" fill="{color}"/>')
        out.append(f'<text x="{x + 13:.0f}" y="{y}" class="note">{esc(label)}</text>')
        x += width + 10
    return out


STYLE = """
.lane { font: bold 13px sans-serif; fill: #222 }
.note { font: 11px sans-serif; fill: #555 }
.axis { font: 11px sans-serif; fill: #333 }
.axis.end { text-anchor: end } .axis.mid { text-anchor: middle }
.axisline { stroke: #666 }
.lanebg { fill: #f7f7f7; stroke: #ddd }
.progress { fill: none; stroke: #1f77b4; stroke-width: 1.5 }
.dot { fill: #1f77b4 }
.faultline { stroke-dasharray: 3 3; stroke-width: 1; opacity: 0.6 }
.commit { stroke: #2ca02c; stroke-width: 1.2 }
.lag { fill: #ff7f0e }
.outage { fill: #d62728; opacity: 0.25 }
"""


def draw(tl: Timeline, headline: str) -> str:
    """The timeline as one standalone SVG document (its own styles, no external reference)."""
    sc = _Scale(tl.start, tl.end)
    body: list[str] = [f'<text x="10" y="22" class="lane">{esc(headline)}</text>']
    y = 40.0
    body += _progress_lane(tl, sc, y, 150)
    y += 160
    lane, h = _recovery_lane(tl, sc, y, 26)
    body += lane
    y += h + 10
    for t in tl.tiers:
        body += _tier_lane(t, sc, y, 44)
        y += 54
    body += [_fault_mark(r, sc, 50, y) for r in tl.recoveries]  # over the lanes they cross
    body += _axis(sc, y + 4)
    body += _legend(y + 64)
    height = math.ceil(y + 64 + 40)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" role="img">'
            f"<title>{esc(headline)}</title><style>{STYLE}</style>"
            + "".join(body) + "</svg>\n")  # fmt: skip
