"""``flashckpt report --html FILE``: the job's timeline as one self-contained page.

The page holds everything it shows (styles, the timeline as inline SVG, hover text as SVG
titles): no network, no script, so it opens from a cluster's shared file system or as a CI
artifact. Above the timeline, the headline: effective training time, the time lost by cause
as one stacked bar, and, with ``--project``, the projection beside it. Below, one row per
failure. The page is a Jinja2 template (autoescaped), the optional ``report`` extra: the
report's text output and the training path never import it.
"""

from __future__ import annotations

from typing import Any

from ..faults.report import Report
from ..faults.timeline import Timeline
from .common import Problem
from .report_svg import PHASE_COLORS, clock, draw, effective_shown, headline, span

STALL_COLOR = "#aec7e8"
STARTUP_COLOR = "#ffbb78"  # the job's start-up: launch to every rank's first step

TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>{{ title }}</title>
<style>
body { font: 14px sans-serif; margin: 20px; color: #222; max-width: 1240px }
h1 { font-size: 20px; margin: 0 0 4px } .sub { color: #555; margin-bottom: 14px }
.headline { display: flex; gap: 40px; align-items: flex-start; margin-bottom: 14px }
.big { font-size: 34px; font-weight: bold } .label { color: #555 }
.bar { display: flex; width: 420px; height: 22px; border: 1px solid #ccc; background: #fff }
.bar div { height: 100% } .keys span { margin-right: 12px; font-size: 12px }
.keys i { display: inline-block; width: 10px; height: 10px; margin-right: 4px }
table { border-collapse: collapse; margin-top: 14px; font-size: 13px }
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left }
th { background: #f3f3f3 } .num { text-align: right }
</style></head>
<body>
<h1>{{ title }}</h1>
<div class="sub">{{ period }}</div>
<div class="headline">
  <div><div class="label">effective training time</div>
    <div class="big" id="effective">{{ effective }}</div>
    <div class="label">lost {{ lost }} of {{ wall }}; {{ failures|length }} failure(s);
      typical step {{ step }}</div></div>
  <div><div class="label">time lost, by cause</div>
    <div class="bar" id="lost-bar">{% for c in causes %}<div style="width:{{ c.width }}%;background:{{ c.color }}" title="{{ c.name }}: {{ c.text }}"></div>{% endfor %}</div>
    <div class="keys">{% for c in causes %}<span><i style="background:{{ c.color }}"></i>{{ c.name }} {{ c.text }}</span>{% endfor %}</div></div>
  {% if projection %}<div id="projection"><div class="label">projected for {{ projection.gpus }} GPUs
      ({{ projection.rate }} interruptions a day)</div>
    {% for p in projection.policies %}<div>{{ p.name }}: <b>{{ p.effective }}</b> effective
      <div class="bar">{% for c in p.causes %}<div style="width:{{ c.width }}%;background:{{ c.color }}" title="{{ c.name }}: {{ c.text }}"></div>{% endfor %}</div></div>{% endfor %}
  </div>{% endif %}
</div>
{{ svg|safe }}
{% if failures %}<table id="failures"><tr><th>#</th><th>fault</th><th>when</th><th>node</th><th>ranks</th>
<th>path</th><th>restored</th><th>from</th>{% for name in phases %}<th>{{ name }}</th>{% endfor %}</tr>
{% for f in failures %}<tr><td>{{ loop.index }}</td><td>{{ f.kind }}</td><td>{{ f.when }}</td>
<td>{{ f.node }}</td><td>{{ f.ranks }}</td><td>{{ f.path }}</td><td class="num">{{ f.step }}</td>
<td>{{ f.source }}</td>{% for v in f.phases %}<td class="num">{{ v }}</td>{% endfor %}</tr>
{% endfor %}</table>{% endif %}
</body></html>
"""


def _template() -> Any:
    try:
        import jinja2
    except ImportError:
        raise Problem(
            "flashckpt report --html needs Jinja2: pip install 'flashckpt[report]' "
            "(the text report and --svg work without it)"
        ) from None
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    return env.from_string(TEMPLATE)


def _bar(parts: dict[str, float], colors: dict[str, str], total: float) -> list[dict]:
    return [{"name": k, "width": f"{100 * v / total:.3f}", "color": colors.get(k, "#999"),
             "text": span(v)} for k, v in parts.items() if v > 0]  # fmt: skip


def lost_by_cause(tl: Timeline, report: Report) -> dict[str, float]:
    """Seconds lost, by cause: the job's start-up, the save stall and each recovery phase,
    summed over failures."""
    out = {"start-up": report.startup_s, "save stall": report.save_stall_s}
    for r in tl.recoveries:
        for p in r.phases:
            out[p.name] = out.get(p.name, 0.0) + (p.end - p.start)
    return out


def _projection(model: Any) -> dict | None:
    if model is None:
        return None
    from ..faults import projection

    colors = {"save stall": STALL_COLOR, "detection": PHASE_COLORS["detect"],
              "recovery": PHASE_COLORS["restart"], "recomputed": PHASE_COLORS["recompute"]}  # fmt: skip
    policies = []
    for name in projection.POLICIES:
        got = model.project(name)
        lost = {k: v for k, v in got.items() if k != "effective"}
        share = max(sum(lost.values()), 1e-12)
        policies.append({"name": name, "effective": f"{100 * got['effective']:.2f}%",
                         "causes": [{**c, "text": f"{100 * lost[c['name']]:.3f}%"}
                                    for c in _bar(lost, colors, share)]})  # fmt: skip
    return {"gpus": model.gpus, "rate": f"{model.rate_per_h * 24:.2f}", "policies": policies}


def render(tl: Timeline, report: Report, projected: Any = None) -> str:
    """The page for the timeline ``tl`` of ``report``; ``projected``: a projection model."""
    shown = effective_shown(report)
    causes = lost_by_cause(tl, report)
    colors = {"start-up": STARTUP_COLOR, "save stall": STALL_COLOR, **PHASE_COLORS}
    phase_names = [n for n in PHASE_COLORS if causes.get(n, 0) > 0]
    failures = []
    for r in tl.recoveries:
        f = r.failure
        took = {p.name: p.end - p.start for p in r.phases}
        failures.append({
            "kind": f.kind, "when": clock(f.at - f.detect_s), "node": f.node or "?",
            "ranks": ", ".join(str(k) for k in sorted({k for k in f.ranks if isinstance(k, int)})),
            "path": r.path + (f" (fell back: {f.fallback})" if f.fallback else ""),
            "step": "?" if f.restored_step is None else f.restored_step, "source": r.source,
            "phases": [span(took[n]) if n in took else "" for n in phase_names],
        })  # fmt: skip
    return _template().render(
        title="flashckpt report: the job's timeline",
        period=f"{clock(tl.start)} to {clock(tl.end)} ({span(tl.end - tl.start)})",
        effective=shown, lost=span(report.lost_s()), wall=span(report.wall_s),
        step="unknown" if not report.step_s else f"{report.step_s * 1000:.1f} ms",
        causes=_bar(causes, colors, max(sum(causes.values()), 1e-12)),
        projection=_projection(projected), svg=draw(tl, headline(report)), failures=failures,
        phases=phase_names,
    )  # fmt: skip
