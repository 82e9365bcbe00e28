import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser

import pytest

from ampdoctor import FixProposal, Report
from ampdoctor.report import _format as F
from ampdoctor.report import render_html, write_html
from ampdoctor.report.html import figures

from .conftest import T5_WO

pytest.importorskip("jinja2")

#: the bound the light report must stay under (issue 18: the plotly.js bundle made every report 4.8 MB)
MAX_BYTES = 1_500_000

EVIL = "<script>alert(1)</script>"
BREAKOUT = "</script><script>document.body.setAttribute('data-pwned','1')</script>"


class _Tags(HTMLParser):
    """What a browser's tokenizer sees: script elements (with their text) and attributes."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.scripts: list[dict] = []
        self.attrs: list[tuple[str, str | None]] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        self.attrs.extend(attrs)
        if tag == "script":
            self.scripts.append({"attrs": dict(attrs), "text": ""})
            self._in_script = True

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.scripts[-1]["text"] += data


def _parse(html: str) -> _Tags:
    parser = _Tags()
    parser.feed(html)
    parser.close()
    return parser


def _trace(fig: dict, name: str) -> dict:
    return next(t for t in fig["data"] if t["name"] == name)


def hostile_report(report: Report) -> Report:
    """Every model-supplied string replaced by markup that would run if it were not escaped."""
    root = report.findings[0]
    bad = dataclasses.replace(
        root,
        module=EVIL,
        op=BREAKOUT,
        title=EVIL,
        explanation=f"{BREAKOUT} <img src=x onerror=\"document.body.setAttribute('data-pwned','2')\">",
        evidence={EVIL: BREAKOUT, **root.evidence},
        fixes=(FixProposal(title=EVIL, snippet=BREAKOUT, verified=False, verification={EVIL: 1.0}),),
    )
    layers = [dict(x, module=f"{x['module']}{BREAKOUT}", op=EVIL) for x in report.layers]
    summary = dict(report.summary, chain=[{"op": EVIL, "module": BREAKOUT, "phase": "forward", "what": EVIL}],
                   first_nan={"op": EVIL, "module": BREAKOUT, "phase": "forward", "step": 0})
    return Report(findings=(bad,) + report.findings[1:], precision=report.precision, summary=summary,
                  layers=tuple(layers), source=BREAKOUT)


def _assert_offline_and_light(html: str) -> None:
    tags = _parse(html)
    assert len(tags.scripts) == 1  # the legend-toggle script
    assert all("src" not in s["attrs"] for s in tags.scripts)
    # nothing points to the network (no CDN script, stylesheet, font, image or namespace fetch)
    assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}/", html, flags=re.IGNORECASE)
    assert "<link" not in html and "@import" not in html and "url(" not in html
    assert len(html.encode("utf-8")) <= MAX_BYTES


def test_document_is_self_contained_and_light(t5, bert, watch):
    for report in (t5, bert, watch):
        html = render_html(report)
        _assert_offline_and_light(html)
        assert html.count('<svg class="figure"') == len(figures(report)) >= 2  # every figure drawn inline


def test_a_large_model_report_stays_under_the_bound(t5):
    # 1200 modules, forward and backward (T5 at 750M parameters has 1119 modules), every name long
    base = t5.layers[0]
    layers = tuple(dict(base, module=f"decoder.block.{i // 50}.layer.{i % 3}.DenseReluDense.wo_{i}", depth=i // 2,
                        phase="backward" if i % 2 else "forward") for i in range(2400))
    big = Report(findings=t5.findings, precision=t5.precision, summary=t5.summary, layers=layers)
    html = render_html(big)
    _assert_offline_and_light(html)
    assert "decoder.block.47.layer.2.DenseReluDense.wo_2399" in html


def test_root_cause_card_and_lineage(t5):
    html = render_html(t5)
    card = html.split('id="root-cause"')[1].split("</section>")[0]
    assert "Root cause: <span class=\"mono\">overflow</span>" in card
    assert f"<code>{T5_WO}</code>" in card
    assert '<td class="num mono">1.05e+05</td>' in card and '<td class="num mono">65504</td>' in card
    assert card.count('class="status verified"') == 2 and card.count('class="status failed"') == 1
    assert card.count('class="status untried"') == 1
    lineage = html.split('id="lineage"')[1].split("</section>")[0]
    assert lineage.index(T5_WO) < lineage.index("encoder.block.1.layer.0.layer_norm") < lineage.index("loss is NaN")


def test_range_figure_values_and_format_lines(t5):
    fig = next(f for f in figures(t5) if f["id"] == "plot-range")
    assert fig["layout"]["yaxis"]["type"] == "log"
    ref, target = _trace(fig, "reference |max|"), _trace(fig, "target |max|")
    i = ref["x"].index(11)
    assert ref["y"][i] == 1.05e5
    assert target["y"][i] is None  # inf cannot sit on a log axis ...
    over = _trace(fig, "target |max| = inf (overflow)")  # ... it is marked above everything else
    assert over["x"] == [11, 12]
    assert over["y"][0] > 65504 * 4 - 1
    assert T5_WO in ref["text"][i] and "aten.mm.default · float16 · forward" in ref["text"][i]
    lines = {t["name"]: t["y"][0] for t in fig["data"] if t["mode"] == "lines"}
    assert lines == {
        "bf16 max 3.39e+38": pytest.approx(3.3895313892515355e38),
        "fp16 max 65504": 65504.0,
        "e4m3 max 448": 448.0,
        "fp16 smallest normal 6.10e-05": 2.0**-14,
        "fp16 smallest subnormal 5.96e-08": 2.0**-24,
    }
    assert _trace(fig, "bf16 max 3.39e+38")["visible"] == "legendonly"  # fp16 run: keep the y axis readable
    assert _trace(fig, "reference |max| (backward)")["y"] == [412.0, 0.0312]


def test_bf16_run_shows_the_bf16_line(healthy):
    fig = next(f for f in figures(healthy) if f["id"] == "plot-range")
    assert "visible" not in _trace(fig, "bf16 max 3.39e+38")


def test_error_figure(t5):
    fig = next(f for f in figures(t5) if f["id"] == "plot-error")
    flush, rel = _trace(fig, "flush fraction"), _trace(fig, "relative error")
    assert flush["y"][flush["x"].index(9)] == 0.0123
    assert rel["yaxis"] == "y2" and fig["layout"]["yaxis2"]["type"] == "log"
    assert rel["y"][rel["x"].index(11)] is None  # rel error inf: a gap, not a fake number
    assert rel["y"][rel["x"].index(2)] == 4.1e-4


def test_scale_timeline(watch, t5, bert):
    fig = next(f for f in figures(watch) if f["id"] == "plot-scale")
    scale = _trace(fig, "loss scale")
    assert scale["y"] == [65536.0 / 2 ** (i + 1) for i in range(10)]
    assert _trace(fig, "skipped step")["x"] == list(range(10))
    assert _trace(fig, "loss (target)")["y"] == [0.01214] * 10
    assert [f["id"] for f in figures(t5)] == ["plot-range", "plot-error", "plot-scale"]
    assert [f["id"] for f in figures(bert)] == ["plot-range", "plot-error"]


@pytest.mark.parametrize(
    ("scales", "skipped_steps", "expected"),
    [
        ([32768.0, 32768.0, 16384.0], 1, [2]),
        ([32768.0, 32768.0, 16384.0], 2, [0, 2]),  # step 0's drop is only visible through the count
        ([65536.0, 65536.0], 0, []),
        ([1024.0, "nan", 512.0], None, []),
    ],
)
def test_skipped_steps_follow_gradscaler_halving(scales, skipped_steps, expected):
    summary = {"scales": scales} if skipped_steps is None else {"scales": scales, "skipped_steps": skipped_steps}
    assert F.scale_timeline(summary)[1] == expected
    assert F.scale_timeline({"scales": scales, "skipped": [1]})[1] == [1]


def test_initial_scale_decides_step_zero():
    assert F.scale_timeline({"scales": [32768.0], "initial_scale": 65536.0})[1] == [0]
    assert F.scale_timeline({"scales": [65536.0, 32768.0], "initial_scale": 65536.0})[1] == [1]
    assert F.scale_text({"scales": [32768.0], "initial_scale": 65536.0}) == "32768 after 1 step, 1 skipped"
    assert F.scale_text({"scales": [32768.0]}) == "32768 after 1 step"  # unknown: no count claimed
    assert F.scale_text({"scales": [4.0, 2.0, 1.0]}) == "4 -> 1 after 3 steps, at least 2 skipped"


def test_figures_are_valid_plotly(any_report):
    go = pytest.importorskip("plotly.graph_objects")
    name, report = any_report
    figs = figures(report)
    assert figs, f"{name}: no figure to check"
    for fig in figs:
        made = go.Figure(data=fig["data"], layout=fig["layout"])  # raises on an unknown property or bad value
        assert len(made.data) == len(fig["data"]) >= 1, fig["id"]
        assert made.to_plotly_json()["data"][0]["type"] == fig["data"][0].get("type", "scatter"), fig["id"]


def test_no_layers_no_layer_plots():
    report = Report(summary={"precision": "fp16"})
    assert figures(report) == []
    html = render_html(report)
    assert "No root cause found" in html and 'id="layers"' not in html


def test_model_strings_cannot_inject_markup(t5):
    html = render_html(hostile_report(t5))
    assert EVIL not in html
    tags = _parse(html)
    assert len(tags.scripts) == 1
    assert html.count("<script") == 1
    assert not any(name.startswith("on") for name, _ in tags.attrs)  # no event handler attribute got through
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html  # shown as text
    data = figures(hostile_report(t5))  # the figure spec carries the name verbatim
    ref = _trace(data[0], "reference |max|")
    assert "&lt;/script&gt;" in ref["text"][0]  # hover text is HTML for plotly: escaped again
    svg = html.split('<div id="plot-range" class="plot">')[1].split("</svg>")[0]
    assert "&lt;/script&gt;" in svg and "</script>" not in svg  # tooltips: text, escaped once more


def test_json_round_trip_renders_the_same(t5):
    again = Report.from_dict(json.loads(json.dumps(t5.to_dict())))
    assert figures(again) == figures(t5)


def test_write_html(t5, tmp_path):
    path = write_html(t5, tmp_path / "report.html")
    assert path.read_text(encoding="utf-8") == render_html(t5)
    assert os.listdir(tmp_path) == ["report.html"]


def test_missing_jinja_names_the_extra(t5, monkeypatch):
    monkeypatch.setitem(sys.modules, "jinja2", None)
    with pytest.raises(ImportError, match=r"ampdoctor\[html\]"):
        render_html(t5)


# ------------------------------------------------------------------------------------------ real browser


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _load_in_browser(tmp_path, html_path) -> tuple[str, list[str]]:
    """Load a file in headless chromium; return the DOM after scripts ran and the console lines of the page."""
    exe = _chromium()
    if exe is None:
        pytest.skip("no chromium binary on PATH (Debian: apt-get install -y chromium)")
    cmd = [exe, "--headless", "--disable-gpu", "--no-sandbox", "--disable-dev-shm-usage", "--no-first-run",
           f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
           "--virtual-time-budget=5000", "--dump-dom", html_path.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
    return proc.stdout, console


@pytest.mark.parametrize(
    ("name", "card_text", "traces"),
    [
        ("t5", f"<code>{T5_WO}</code>", ["reference |max|", "target |max|", "fp16 max 65504", "loss scale"]),
        ("bert", "<code>module.pooler.dense</code>", ["target |max|", "flush fraction", "e4m3 max 448"]),
    ],
)
def test_renders_in_headless_chromium(name, card_text, traces, tmp_path, request):
    report = request.getfixturevalue(name)
    path = write_html(report, tmp_path / f"{name}.html")
    dom, console = _load_in_browser(tmp_path, path)
    assert console == []  # the page logs nothing: no error, no uncaught exception
    card = dom.split('id="root-cause"')[1].split("</section>")[0]
    assert "Root cause:" in card and card_text in card
    assert len(re.findall(r'<svg class="figure"', dom)) >= 2
    legend = re.findall(r'class="legend-item[^"]*"[^>]*>.*?<text[^>]*>([^<]*)</text>', dom)
    for trace in traces:
        assert trace in legend


def test_hostile_names_do_not_run_in_chromium(t5, tmp_path):
    path = write_html(hostile_report(t5), tmp_path / "hostile.html")
    dom, console = _load_in_browser(tmp_path, path)
    assert console == []
    assert "data-pwned=" not in dom
    assert len(re.findall(r'<svg class="figure"', dom)) >= 2  # the plots still draw
    assert EVIL not in dom.split("<body")[1].split('<script type="application/json"')[0]


def test_malformed_summary_and_layers_render_everywhere():
    pytest.importorskip("rich")
    from ampdoctor.report import render_json, terminal_text

    report = Report(
        summary={"steps": "two", "scales": "65536", "chain": [1, {"op": None}], "first_nan": "somewhere",
                 "loss_target": 3.0, "elapsed_s": "fast", "skipped_steps": True},
        layers=({"module": "a"}, "junk", {"module": "b", "depth": "x", "target_absmax": "inf", "dtype": None},
                {"module": "c", "dtype": "float8_e4m3fn", "target_absmax": 500.0, "flush_fraction": "nan"}),
    )
    text = terminal_text(report, width=100)
    assert re.search(r"\n3 +c +- +- +e4m3 +- +500 +-0\.2 +-\n", text)  # log2(448 / 500) = -0.16 bits
    html = render_html(report)
    assert len(_parse(html).scripts) == 1
    assert json.loads(render_json(report))["layers"][1] == "junk"
    fig = figures(report)[0]
    assert _trace(fig, "target |max| = inf (overflow)")["x"] == [2]
