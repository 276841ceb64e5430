"""The report's human-readable forms: a Markdown table and a self-contained HTML page (inline CSS
and SVG chart, no scripts, no network) with the same table under a per-layer latency chart."""
from __future__ import annotations

import html as _html
import math

COLORS = {"eager": "#8c8c8c", "ort": "#e69f00", "accelc": "#0072b2"}
COLUMNS = ["layer", "kind", "input shape", "kernel", "eager ms", "ORT ms", "accelc ms", "vs ORT", "vs eager",
           "torch.compile ms", "vs compile", "accelc error", "ORT error", "status"]


def _ms(v, spread=None) -> str:
    """A time in ms; with its samples' spread ((p90 - p10) / median) where it is known."""
    return "" if v is None else f"{v:.4g}" + (f" ±{spread / 2:.0%}" if spread is not None else "")


def _x(v) -> str:
    return "" if v is None else (f"{v:.2f}x" if v >= 0.1 else f"{v:.2g}x")


def _err(rel, sqnr, passed) -> str:
    if rel is None:
        return ""
    mark = "" if passed is None else (" ok" if passed else " FAIL")
    return f"{rel:.1e} ({sqnr:.1f} dB){mark}" if sqnr is not None else f"{rel:.1e}{mark}"


def _status(r: dict) -> str:
    if r["status"] == "rewritten":
        return "rewritten" + (f" ({r['reason']})" if r["reason"] else "")
    return f"{r['status']}: {r['reason']}" if r["status"] else ""


def _cells(r: dict) -> list[str]:
    ort_err = _err(r["ort_rel_error"], r["ort_sqnr_db"], r["ort_pass"])
    if r["ort_ms"] is None and r["ort_error"]:
        ort_err = r["ort_error"]
    ort_ms = _ms(r["ort_ms"])
    if r.get("ort_opt_ms") is not None:
        ort_ms += f" (transformer optimizer {_ms(r['ort_opt_ms'])})"
    comp = _ms(r.get("compile_ms"))
    if r.get("compile_ro_ms") is not None:
        comp += f" (reduce-overhead {_ms(r['compile_ro_ms'])})"
    if r.get("compile_error") and r.get("compile_ms") is None:
        comp = r["compile_error"]
    return [r["layer"], r["kind"], r["input_shape"], r["kernel"], _ms(r["eager_ms"], r.get("eager_spread")), ort_ms,
            _ms(r["accelc_ms"], r.get("accelc_spread")), _x(r["speedup_vs_ort"]), _x(r["speedup_vs_eager"]), comp,
            _x(r.get("speedup_vs_compile")), _err(r["accelc_rel_error"], r["accelc_sqnr_db"], r["accelc_pass"]), ort_err, _status(r)]


def _totals_cells(t: dict) -> list[str]:
    return ["total (timed layers)", "", "", "", _ms(t["eager_ms"]),
            _ms(t["ort_ms"]) + (f" ({t['ort_failed']} without ORT)" if t.get("ort_failed") else ""),
            _ms(t["accelc_ms"]), _x(t["speedup_vs_ort"]), _x(t["speedup_vs_eager"]), _ms(t.get("compile_ms")),
            _x(t.get("speedup_vs_compile")), "", "",
            f"{t['rewritten']} rewritten, {t['reverted']} reverted, {t['kept']} kept; "
            f"{t['faster_than_ort_1_5x']} layer(s) >= 1.5x ORT"]


def _header_lines(d: dict) -> list[tuple[str, str]]:
    h = d["header"]
    v = h["versions"]
    return [
        ("model", f"{h['model']} (inputs {', '.join('x'.join(map(str, s)) for s in h['input_shapes'])}"
                  f"{', ' + h['dtype'] if h['dtype'] else ''}{', int8' if h['int8'] else ''}"
                  f"{', fp8' if h.get('fp8') else ''}; capture {h['capture']})"),
        ("device", h["device"]),
        ("date", h["date"]),
        ("versions", ", ".join(f"{k} {val}" for k, val in v.items() if val)),
        ("ONNX Runtime", h["ort"]),
        ("timer", h["timer"]),
    ]


def markdown(report) -> str:
    d = report.to_dict()
    lines = [f"# accelc per-layer report: {d['header']['model']}", ""]
    if d["header"]["note"]:
        lines += [f"**{d['header']['note']}**", ""]
    lines += [f"- {k}: {val}" for k, val in _header_lines(d)]
    wide = spread_warning(d)
    if wide:
        lines += ["", f"**{wide}**"]
    lines += ["", (f"Times in ms (median); no speedup columns: {d['totals']['no_ratio']}. " if d["totals"].get("no_ratio")
                   else "Times in ms (median). Speedup = other's time / accelc's; > 1: accelc faster (vs compile: "
                   "against the faster of its modes). ") + "Errors: relative L2 "
              "vs the layer in fp32 (fp64 for fp32 layers), SQNR in brackets; ok / FAIL against the dtype's "
              "tolerance (int8 and fp8 layers: the SQNR floor).", ""]
    rows = [_cells(r) for r in d["layers"]] + [_totals_cells(d["totals"]), _cells(d["end_to_end"])]
    keep = filled_columns(rows)
    lines.append("| " + " | ".join(COLUMNS[i] for i in keep) + " |")
    lines.append("|" + "---|" * len(keep))
    for cells in rows:
        lines.append("| " + " | ".join(cells[i].replace("|", "\\|") for i in keep) + " |")
    lines += ["", ort_optimizer_line(d["end_to_end"])]
    return "\n".join(lines) + "\n"


SPREAD_LIMIT = 0.25     # a median whose samples spread wider than this ((p90 - p10) / median) is not to trust


def spread_warning(d: dict) -> str:
    """One sentence where some timing's samples spread past SPREAD_LIMIT (a busy machine), else ''."""
    spreads = [(r.get(k), r["layer"]) for r in d["layers"] + [d["end_to_end"]] for k in ("eager_spread", "accelc_spread")
               if r.get(k) is not None]
    wide = [(v, name) for v, name in spreads if v > SPREAD_LIMIT]
    if not wide:
        return ""
    worst, name = max(wide)
    return (f"{len(wide)} of {len(spreads)} timings spread wider than {SPREAD_LIMIT:.0%} of their median (the widest "
            f"{worst:.0%}, {name}): the machine was busy while timing; those figures are not to trust (the ms "
            "cells show each spread as ±).")


def filled_columns(rows: list[list[str]]) -> list[int]:
    """The columns some row fills (the layer's always): what cannot be filled here (on a CPU: ONNX Runtime's
    and torch.compile's times, every speedup) is left out of the table rather than shown blank."""
    return [i for i in range(len(COLUMNS)) if i == 0 or any(cells[i].strip() for cells in rows)]


def ort_optimizer_line(e: dict) -> str:
    """The whole model in ORT with its transformer optimizer, in one sentence (how it was made,
    or why there is no such figure)."""
    if e.get("ort_opt_ms") is not None:
        return (f"Whole model in ORT with its transformer optimizer: {_ms(e['ort_opt_ms'])} ms "
                f"({e['ort_opt_method']}; error {e['ort_opt_rel_error']:.1e}); vs ORT compares accelc with the "
                "faster of it and plain ORT.")
    return f"Whole model in ORT with its transformer optimizer: no figure ({e.get('ort_opt_error') or 'not run'})."


def _chart(rows: list[dict], title: str) -> str:
    """Horizontal grouped bars: eager / ORT / accelc ms per row on a log scale (one slow layer
    must not flatten the others), decades marked; speedup vs ORT on the right."""
    rows = [r for r in rows if r["accelc_ms"] is not None]
    if not rows:
        return ""
    label_w, bar_w, right_w, bar_h, gap, top = 300, 460, 150, 9, 12, 58
    group = 3 * bar_h + gap
    width, height = label_w + bar_w + right_w, top + group * len(rows) + 10
    values = [r[k] for r in rows for k in ("eager_ms", "ort_ms", "accelc_ms") if r[k]]
    lo = 10 ** math.floor(math.log10(min(values))) if values else 1e-3
    hi = 10 ** math.ceil(math.log10(max(values))) if values else 1.0
    hi = hi if hi > lo else lo * 10
    span = math.log10(hi) - math.log10(lo)

    def length(v: float) -> float:   # the log-scale bar length of v ms; lo maps to a stub
        return max(bar_w * 0.9 * (math.log10(v) - math.log10(lo)) / span, 0) + 2

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11" role="img">',
           f'<text x="0" y="14" font-size="13" font-weight="bold">{_html.escape(title)} (log scale)</text>']
    for i, (key, name) in enumerate((("eager", "eager PyTorch"), ("ort", "ONNX Runtime"), ("accelc", "accelc"))):
        x = label_w + i * 130
        out.append(f'<rect x="{x}" y="24" width="12" height="10" fill="{COLORS[key]}"/>'
                   f'<text x="{x + 16}" y="33">{name}</text>')
    if any(r["speedup_vs_ort"] is not None for r in rows):
        out.append(f'<text x="{label_w + bar_w + 8}" y="33">accelc vs ORT</text>')
    for d in range(round(span) + 1):   # a line and a label at each decade
        v = lo * 10 ** d
        x = label_w + length(v)
        out.append(f'<line x1="{x:.1f}" y1="{top - 6}" x2="{x:.1f}" y2="{height - 10}" stroke="#ddd"/>'
                   f'<text x="{x:.1f}" y="{top - 9}" font-size="9" fill="#666" text-anchor="middle">'
                   f'{v:g} ms</text>')
    for j, r in enumerate(rows):
        y0 = top + j * group
        label = r["layer"] if len(r["layer"]) <= 44 else r["layer"][:42] + "..."
        out.append(f'<text x="{label_w - 6}" y="{y0 + 1.5 * bar_h + 4}" text-anchor="end">'
                   f'<title>{_html.escape(r["layer"])}</title>{_html.escape(label)}</text>')
        for i, key in enumerate(("eager", "ort", "accelc")):
            v = r[f"{key}_ms"]
            y = y0 + i * bar_h
            if not v:
                out.append(f'<text x="{label_w + 2}" y="{y + bar_h - 1}" fill="#999" font-size="9">n/a</text>')
                continue
            w = length(v)
            out.append(f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h - 1}" fill="{COLORS[key]}">'
                       f'<title>{key}: {v:.4g} ms</title></rect>'
                       f'<text x="{label_w + w + 3:.1f}" y="{y + bar_h - 1}" font-size="9">{v:.3g}</text>')
        sp = r["speedup_vs_ort"]
        if sp is None:     # (no ratio stated: nothing to show, not a red n/a)
            continue
        color = "#1a7f37" if sp >= 1.5 else ("#b35900" if sp >= 1 else "#c62828")
        out.append(f'<text x="{label_w + bar_w + 8}" y="{y0 + 1.5 * bar_h + 4}" fill="{color}" '
                   f'font-weight="bold">{_x(sp)}</text>')
    out.append("</svg>")
    return "\n".join(out)


_CSS = """
body { font-family: -apple-system, Segoe UI, Helvetica, Arial, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
.note { background: #fff3cd; border: 1px solid #e0c060; padding: 10px; font-weight: bold; }
dl { display: grid; grid-template-columns: max-content auto; gap: 2px 12px; font-size: 13px; }
dt { font-weight: bold; }
table { border-collapse: collapse; font-size: 12px; margin-top: 8px; }
th, td { border: 1px solid #ccc; padding: 3px 6px; text-align: left; vertical-align: top; }
th { background: #f0f0f0; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.total td { font-weight: bold; background: #f7f7f7; }
td.fail { color: #c62828; } td.fast { color: #1a7f37; font-weight: bold; }
"""


def html(report) -> str:
    d = report.to_dict()
    h = d["header"]
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>accelc report: {_html.escape(h['model'])}</title>", f"<style>{_CSS}</style></head><body>",
             f"<h1>accelc per-layer report: {_html.escape(h['model'])}</h1>"]
    if h["note"]:
        parts.append(f'<p class="note">{_html.escape(h["note"])}</p>')
    if spread_warning(d):
        parts.append(f'<p class="note">{_html.escape(spread_warning(d))}</p>')
    parts.append("<dl>" + "".join(f"<dt>{_html.escape(k)}</dt><dd>{_html.escape(str(v))}</dd>"
                                  for k, v in _header_lines(d)) + "</dl>")
    parts.append('<h2>Latency per layer</h2><div class="chart">' + _chart(d["layers"], "per-layer latency (ms)")
                 + "</div>")
    parts.append('<h2>End to end</h2><div class="chart">' + _chart([d["end_to_end"]], "whole model (ms)")
                 + "</div>")
    table = [(r, _totals_cells(d["totals"]) if r is None else _cells(r)) for r in d["layers"] + [None, d["end_to_end"]]]
    keep = filled_columns([cells for _, cells in table])
    ratios = any(COLUMNS[i].startswith("vs ") for i in keep)
    parts.append("<h2>Layers</h2><p>Times in ms (median)." + (" Speedup = other's time / accelc's." if ratios else "")
                 + " Errors: relative L2 vs the layer in higher precision (SQNR in dB).</p><table><thead><tr>"
                 + "".join(f"<th>{COLUMNS[i]}</th>" for i in keep) + "</tr></thead><tbody>")
    numeric = {4, 5, 6, 7, 8, 9, 10}
    for r, cells in table:
        cls = ' class="total"' if r is None or r is d["end_to_end"] else ""
        tds = []
        for i, c in ((i, cells[i]) for i in keep):
            klass = []
            if i in numeric:
                klass.append("num")
            if "FAIL" in c:
                klass.append("fail")
            if i == 7 and r is not None and r["speedup_vs_ort"] and r["speedup_vs_ort"] >= 1.5:
                klass.append("fast")
            attr = f' class="{" ".join(klass)}"' if klass else ""
            tds.append(f"<td{attr}>{_html.escape(c)}</td>")
        parts.append(f"<tr{cls}>" + "".join(tds) + "</tr>")
    parts.append(f"</tbody></table><p>{_html.escape(ort_optimizer_line(d['end_to_end']))}</p></body></html>")
    return "\n".join(parts) + "\n"
