"""The dashboard under AppTest: every page on a small runs root, query parameters, bad runs."""

from __future__ import annotations

import ast
import html
import re
import subprocess
import sys
from pathlib import Path

import pytest
from app_runs import OUTSIDE, PAGES, REPO, TITLES
from markdown_it import MarkdownIt

from app.plain import code, md
from runlog import write_synthetic_run

streamlit_testing = pytest.importorskip("streamlit.testing.v1")
AppTest = streamlit_testing.AppTest

MAIN = REPO / "app" / "main.py"


@pytest.fixture(scope="module")
def root(app_runs_root) -> Path:
    return app_runs_root


def app(root: Path, monkeypatch: pytest.MonkeyPatch, **params: str) -> AppTest:
    """A fresh session (as from a link) with ``params`` as the URL query parameters, run once."""
    monkeypatch.setenv("H2O_LENS_ROOT", str(root))
    at = AppTest.from_file(str(MAIN), default_timeout=120)
    at.query_params.update(params)
    return at.run()


def texts(at: AppTest, kind: str) -> str:
    return "\n".join(str(e.value) for e in getattr(at, kind))


def no_exception(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]


def widget(at: AppTest, kind: str, label: str):
    found = [w for w in getattr(at, kind) if w.label == label]
    assert found, f"no {kind} labelled {label!r}: {[w.label for w in getattr(at, kind)]}"
    return found[0]


# -- every page ----------------------------------------------------------------------------------

_EXPECT = {  # page: (plotly charts at least, other elements that must be there)
    "runs": (0, ("dataframe",)),
    "overview": (1, ("metric",)),
    "tokens": (1, ("metric", "number_input")),
    "heads": (5, ("selectbox",)),
    "dynamics": (3, ("metric",)),
    "evictions": (1, ("dataframe", "metric")),
    "compare": (3, ("dataframe",)),
    "report": (0, ("download_button", "dataframe")),
    "sql": (0, ("text_area", "expander")),
}


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_for_a_complete_run(root, monkeypatch, page):
    at = app(root, monkeypatch, run="h2o-sum", page=page)
    no_exception(at)
    assert [t.value for t in at.title] == [TITLES[page]]
    charts, kinds = _EXPECT[page]
    assert len(at.get("plotly_chart")) >= charts
    for kind in kinds:
        assert len(at.get(kind)) > 0, f"{page}: no {kind}"
    assert not at.error or page == "report"  # the report's gate may fail, in red
    assert at.query_params["page"] == page and at.query_params["run"] == "h2o-sum"
    assert widget(at, "selectbox", "Run").value == "h2o-sum"


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("run", ["cut-short", "damaged", "h2o-max", "bad-manifest", "hostile"])
def test_every_page_survives_partial_runs(root, monkeypatch, page, run):
    at = app(root, monkeypatch, run=run, page=page)
    no_exception(at)
    assert [t.value for t in at.title] == [TITLES[page]]
    assert widget(at, "selectbox", "Run").value == run


def test_runs_page_lists_runs_and_skipped_files(root, monkeypatch):
    at = app(root, monkeypatch)
    no_exception(at)
    table = at.dataframe[0].value
    assert sorted(table["run_id"]) == ["bad-manifest", "cut-short", "damaged", "h2o-max", "h2o-sum", "hostile"]
    row = table.set_index("run_id").loc["h2o-sum"]
    assert row["evictions"] > 0 and 0 <= row["top1_agreement"] <= 1 and row["correct"] == "1/2"
    assert table.set_index("run_id").loc["cut-short", "status"] == "interrupted"
    warning = texts(at, "warning")
    assert "replay-00000.parquet" in warning and "damaged" in warning
    assert "Runs root:" in texts(at, "caption")


# -- bad runs: a clear message, the rest keeps working --------------------------------------------


def test_damaged_run_names_the_file_and_the_section(root, monkeypatch):
    at = app(root, monkeypatch, run="damaged", page="heads")
    no_exception(at)
    warning = texts(at, "warning")
    assert str(root / "damaged" / "replay-00000.parquet") in warning
    assert "`replay` files of this run could not be read" in warning
    at = app(root, monkeypatch, run="damaged", page="evictions")  # its other tables still show
    no_exception(at)
    assert len(at.get("plotly_chart")) == 1 and len(at.dataframe[0].value) > 0


def test_interrupted_run_says_so_and_shows_what_it_wrote(root, monkeypatch):
    at = app(root, monkeypatch, run="cut-short", page="overview")
    no_exception(at)
    assert "interrupted" in texts(at, "warning")
    assert "no teacher replay" in texts(at, "info")
    at = app(root, monkeypatch, run="cut-short", page="tokens")
    no_exception(at)
    assert len(at.get("plotly_chart")) == 1  # evictions and tokens were written before it stopped


def test_unreadable_manifest_is_reported(root, monkeypatch):
    at = app(root, monkeypatch, run="bad-manifest", page="overview")
    no_exception(at)
    warning = texts(at, "warning")
    assert "status **unknown**" in warning and str(root / "bad-manifest" / "manifest.json") in warning
    assert len(at.get("plotly_chart")) == 1  # its segments are still read


def test_unknown_run_in_the_link_is_reported(root, monkeypatch):
    at = app(root, monkeypatch, run="no-such-run", page="overview")
    no_exception(at)
    assert "no-such-run" in texts(at, "warning")
    assert at.query_params["run"] != "no-such-run"


@pytest.mark.parametrize("exists", [True, False])
def test_empty_or_missing_root_shows_a_friendly_message(tmp_path, monkeypatch, exists):
    root = tmp_path / "runs"
    if exists:
        root.mkdir()
    for page in PAGES:
        at = app(root, monkeypatch, page=page)
        no_exception(at)
        shown = texts(at, "info") + texts(at, "warning")
        assert ("No runs under" if exists else "does not exist") in shown, page
        assert "h2o-lens record --out" in texts(at, "markdown"), page


# -- selections live in the URL --------------------------------------------------------------------


def test_query_params_select_the_view(root, monkeypatch):
    at = app(root, monkeypatch, run="h2o-sum", page="heads", layer="2", head="4")
    no_exception(at)
    assert widget(at, "selectbox", "Layer").value == 2
    assert widget(at, "selectbox", "Query head").value == 4
    widget(at, "selectbox", "Layer").set_value(3).run()
    assert at.query_params["layer"] == "3" and at.query_params["head"] == "4"

    at = app(root, monkeypatch, run="h2o-sum", page="overview", step="80")
    assert widget(at, "slider", "Inspect step").value == 80
    at = app(root, monkeypatch, run="h2o-sum", page="tokens", layer="1", head="1", step="90", token="7", request="1")
    no_exception(at)
    assert widget(at, "selectbox", "Request").value == 1
    assert widget(at, "slider", "Cache at step").value == 90
    assert widget(at, "number_input", "Selected token (position)").value == 7
    assert "Token 7" in [h.value.split(":")[0] for h in at.subheader]
    assert dict(at.query_params) == {
        "page": "tokens",
        "run": "h2o-sum",
        "request": "1",
        "layer": "1",
        "head": "1",
        "step": "90",
        "token": "7",
    }


def test_selections_follow_the_user_across_pages(root, monkeypatch):
    at = app(root, monkeypatch, run="h2o-sum", page="heads", layer="3")
    at.switch_page("screens/dynamics.py").run()
    no_exception(at)
    assert widget(at, "selectbox", "Layer").value == 3
    assert at.query_params["page"] == "dynamics" and at.query_params["layer"] == "3"
    widget(at, "selectbox", "Run").set_value("h2o-max").run()
    no_exception(at)
    assert at.query_params["run"] == "h2o-max"
    assert "h2o-max" in texts(at, "caption")


def test_out_of_range_params_fall_back_to_defaults(root, monkeypatch):
    at = app(root, monkeypatch, run="h2o-sum", page="heads", layer="99", head="x")
    no_exception(at)
    assert widget(at, "selectbox", "Layer").value == 0
    assert at.query_params["layer"] == "0"


# -- page specifics -----------------------------------------------------------------------------------


def test_overview_attributes_the_failed_request(root, monkeypatch):
    at = app(root, monkeypatch, run="h2o-sum", page="overview")
    markdown = texts(at, "markdown")
    assert "#### Request 0:" in markdown and "Why:" in markdown
    assert "answer_checker" in texts(at, "caption")
    assert any("FROM evictions" in c.value for c in at.code)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Correct"] == "1/2" and metrics["First divergence"] != "–"


def test_heads_shows_gqa_overlap_of_the_paired_run(root, monkeypatch):
    at = app(root, monkeypatch, run="h2o-sum", page="heads")
    assert "`h2o-sum` (sum) and `h2o-max` (max)" in texts(at, "caption")
    assert "No paired run" not in texts(at, "info")
    at = app(root, monkeypatch, run="damaged", page="heads")
    assert "No paired run" in texts(at, "info")


def test_compare_defaults_to_the_paired_run_on_the_same_tokens(root, monkeypatch):
    at = app(root, monkeypatch, run="h2o-max", page="compare")
    no_exception(at)
    assert widget(at, "selectbox", "Compare with").value == "h2o-sum"
    assert "do not share their prompt" not in texts(at, "warning")
    free = at.dataframe[0].value
    assert (free["prompt_mismatches"] == 0).all() and (free["compared"] > 0).all()
    at = app(root, monkeypatch, run="h2o-sum", page="compare", other="damaged")
    assert widget(at, "selectbox", "Compare with").value == "damaged"
    assert "do not share their prompt" in texts(at, "warning")


def test_evictions_filters_cap_and_histogram(root, monkeypatch):
    at = app(root, monkeypatch, run="h2o-sum", page="evictions", layer="1", head="0")
    no_exception(at)
    rows = at.dataframe[0].value
    assert len(rows) > 0 and set(rows["layer"]) == {1} and set(rows["kv_head"]) == {0}
    widget(at, "selectbox", "Phase").set_value("decode").run()
    rows = at.dataframe[0].value
    assert set(rows["phase"]) == {"decode"}
    widget(at, "number_input", "Largest margin").set_value(0.05).run()
    rows = at.dataframe[0].value
    assert (rows["margin"] <= 0.05).all()


def test_report_offers_three_downloads_and_the_gate(root, monkeypatch):
    at = app(root, monkeypatch, run="h2o-sum", page="report")
    labels = [b.label for b in at.get("download_button")]
    assert labels == ["HTML report", "Markdown report", "JSON report"]
    assert "fails the gate" in texts(at, "error") or "passes" in texts(at, "success")
    assert "#### Request 0:" in texts(at, "markdown")


def test_sql_console_runs_and_refuses(root, monkeypatch):
    at = app(root, monkeypatch, run="h2o-sum", page="sql")
    assert "evictions" in texts(at, "markdown") or len(at.expander) >= 6
    assert "WHERE run_id = 'h2o-sum'" in at.text_area[0].value
    at.get("form_submit_button")[0].click().run()  # the default example
    no_exception(at)
    result = at.dataframe[0].value  # the console's column comes first, the schemas beside it
    assert list(result.columns[:3]) == ["layer", "kv_head", "evictions"] and len(result) == 8
    assert "**8 row(s)**" in texts(at, "markdown")
    at.text_area[0].set_value("DROP VIEW runs")
    at.get("form_submit_button")[0].click().run()
    assert "refused" in texts(at, "error")
    widget(at, "selectbox", "Example").set_value("Runs").run()
    assert at.text_area[0].value.startswith("SELECT run_id, status")


def test_reload_button_picks_up_new_runs(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    write_synthetic_run(root, "first", steps=8, prompt_len=32, fsync=False)
    at = app(root, monkeypatch)
    assert list(at.dataframe[0].value["run_id"]) == ["first"]
    write_synthetic_run(root, "second", steps=8, prompt_len=32, fsync=False)
    widget(at, "button", "Reload runs").click().run()
    no_exception(at)
    assert sorted(at.dataframe[0].value["run_id"]) == ["first", "second"]


# -- the package -------------------------------------------------------------------------------------


def test_app_never_imports_torch_or_transformers():
    for path in (REPO / "app").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                assert name.split(".")[0] not in ("torch", "transformers", "h2o_lens"), f"{path}: {name}"
    code = (
        "import sys, app.launch, app.state, app.data, app.charts, app.textview, app.common, app.bench; "
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad); sys.exit(bool(bad))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_server_command_and_default_root(tmp_path):
    from app import launch

    cmd = launch.server_command(tmp_path, 8765)
    assert cmd[1:4] == ["-m", "app.serve", "run"] and cmd[4] == str(MAIN)
    for flag, value in (("--server.headless", "true"), ("--server.address", "127.0.0.1"), ("--server.port", "8765")):
        assert cmd[cmd.index(flag) + 1] == value
    assert cmd[-3:] == ["--", "--root", str(tmp_path.resolve())]
    assert launch.server_command(None)[-1] == str(REPO / "sample_runs")
    assert launch.server_command(None, open_browser=True)[6] == "false"
    with pytest.raises(ValueError, match="port"):
        launch.server_command(tmp_path, 0)


def test_root_resolution(tmp_path, monkeypatch):
    from app import state

    monkeypatch.delenv(state.ROOT_ENV, raising=False)
    assert state.resolve_root([]) == REPO / "sample_runs"
    monkeypatch.setenv(state.ROOT_ENV, str(tmp_path))
    assert state.resolve_root(["-q", "--ro"]) == tmp_path  # no abbreviation of --root
    assert state.resolve_root(["--root", str(tmp_path / "x")]) == tmp_path / "x"


# -- text shown to people is shown as text --------------------------------------------------------

_MARKDOWN_KINDS = ("title", "subheader", "markdown", "caption", "warning", "error", "info", "success")


def _rendered_elements(at: AppTest) -> str:
    """The HTML a CommonMark renderer makes of every Markdown element of the page."""
    md = MarkdownIt("commonmark")
    return "\n".join(md.render(str(e.value)) for kind in _MARKDOWN_KINDS for e in getattr(at, kind))


@pytest.mark.parametrize("page", ["runs", "overview", "tokens", "compare", "report"])
def test_manifest_and_log_text_is_shown_as_text(root, monkeypatch, page):
    at = app(root, monkeypatch, run="hostile", page=page, other="hostile")
    no_exception(at)
    shown = "\n".join(str(e.value) for kind in _MARKDOWN_KINDS for e in getattr(at, kind))
    rendered = _rendered_elements(at)
    assert "<img" not in rendered and "<a " not in rendered and ":red[red]" not in shown
    if page == "overview":  # the error is there, as text
        assert f"boom \\[click\\]\\(http\N{WORD JOINER}\\://{OUTSIDE}/error\\)" in texts(at, "warning")
        assert "damaged or incomplete data" in texts(at, "caption")  # its manifest had bad fields


def test_link_parameters_are_shown_as_text(root, monkeypatch):
    crafted = f"x` ![p](http://{OUTSIDE}/p.png) [l](http://{OUTSIDE}/l) <img src=http://{OUTSIDE}/i.png>"
    at = app(root, monkeypatch, run=crafted, page="overview")
    no_exception(at)
    assert OUTSIDE in texts(at, "warning")  # named in the "not under this root" message...
    rendered = _rendered_elements(at)
    assert "<img" not in rendered and "<a " not in rendered  # ...as text


def test_manifest_fields_of_the_wrong_type_mark_the_run(root, monkeypatch):
    at = app(root, monkeypatch, run="hostile", page="runs")
    no_exception(at)
    table = at.dataframe[0].value.set_index("run_id")
    assert "writer invalid" in table.loc["hostile", "integrity"] and "seed invalid" in table.loc["hostile", "integrity"]
    assert table.loc["h2o-sum", "integrity"] == "ok"
    assert "replay-00000.parquet left out" in table.loc["damaged", "integrity"]
    assert "field writer is str, expected an object" in texts(at, "warning")
    picker = widget(at, "selectbox", "Run")
    assert picker.format_func("hostile").endswith("· damaged data")
    assert not picker.format_func("h2o-sum").endswith("damaged data")


def test_page_icon_is_drawn_locally():
    tree = ast.parse(MAIN.read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "set_page_config"]
    (icon,) = [ast.literal_eval(k.value) for c in calls for k in c.keywords if k.arg == "page_icon"]
    # ":material/...:" and ":shortcode:" icons make the browser fetch from a font server
    assert not icon.startswith(":") and len(icon) == 1


# GFM's literal autolinks (mdast-util-gfm-autolink-literal), which Streamlit applies to text after escapes
_GFM_URL = re.compile(r"(https?://|www(?=\.))([-.\w]+)", re.I)
_GFM_EMAIL = re.compile(r"([-.\w+]+)@([-\w]+(?:\.[-\w]+)+)")


@pytest.mark.parametrize(
    "text",
    [
        "![pixel](http://example.com/p.png)",
        "[click](https://example.com)",
        "<img src=x onerror=alert(1)>",
        "see www.example.com or HTTP://example.com/x",
        "mail a.b@example.com",
        ":red[red] :material/home: $x^2$",
        "**bold** _it_ `code` # head | pipe ~strike~ \\ back",
        "line\nbreak",
    ],
)
def test_plain_markdown_shows_the_characters_and_nothing_more(text):
    rendered = MarkdownIt("commonmark").render(md(text))
    assert rendered.count("<") == 2 and rendered.startswith("<p>")  # one paragraph, no other element
    shown = html.unescape(rendered[3:-5]).replace("\N{WORD JOINER}", "")
    assert shown == " ".join(text.splitlines())
    plain = html.unescape(rendered[3:-5])  # the text node Streamlit's GFM plugin searches for links
    assert not _GFM_URL.search(plain) and not _GFM_EMAIL.search(plain)
    assert not re.search(r":\w+\[|:material/|\$", md(text).replace("\\:", "").replace("\\$", ""))
    inline = MarkdownIt("commonmark").render(f"x {code(text)} y")
    assert inline.count("<code>") == 1 and "<a" not in inline and "<img" not in inline


def test_compare_colours_runs_by_their_policy():
    """The dashboard takes each policy's colour from the registry (through analyses)."""
    import pandas as pd

    import analyses
    from app import charts, common

    colours = analyses.policy_colours()
    assert common.run_colours(["h2o", "tova"]) == [colours["h2o"], colours["tova"]]
    assert common.run_colours(["h2o", "h2o"]) is None  # one policy: the palette tells them apart
    assert common.run_colours(["h2o", None]) is None and common.run_colours(["h2o", "lru"]) is None
    snap = "kvpress:SnapKVPress(compression_ratio=0.6, window_size=64, kernel_size=5)"  # a press run (DESIGN.md §17)
    assert common.run_colours(["h2o", snap]) == [colours["h2o"], analyses.policy_colour(snap)]
    series = pd.DataFrame({"request": [0, 0], "step": [4, 5], "kl": [0.1, 0.2]})
    dropped = pd.DataFrame({"request": [0, 0], "step": [4, 5], "mean": [0.01, 0.02]})
    fig = charts.compare_figure([("a", series, dropped), ("b", series, dropped)], ["#123456", "#abcdef"])
    assert [t.line.color for t in fig.data] == ["#123456", "#123456", "#abcdef", "#abcdef"]


def test_the_server_warm_up_opens_the_root_the_first_session_uses(app_runs_root, monkeypatch):
    """app.serve's warm-up scans the root before any session; the first connection of the same
    root version takes that connection instead of scanning again."""
    from app import serve, state

    state._WARM.clear()
    serve._warm(["run", "app/main.py", "--server.port", "1", "--", "--root", str(app_runs_root)])
    warmed = dict(state._WARM)
    assert len(warmed) == 1
    ((root, con),) = warmed.items()
    assert root.path == str(Path(app_runs_root).resolve()) and root.version == state._version(Path(root.path))
    assert con.sql("SELECT count(*) FROM runs").fetchall()[0][0] > 0

    def no_scan(*args, **kwargs):
        raise AssertionError("the warmed root was scanned again")

    monkeypatch.setattr(state.runlog, "open_runs", no_scan)
    assert state.connection.__wrapped__(root) is con and not state._WARM


def test_runs_page_shows_the_split_each_policy_runs_with(monkeypatch, tmp_path):
    """A local run configured heavy 17 + recent 18 runs every slot as recent: the table says 0 + 35."""
    import json
    import shutil

    root = tmp_path / "runs"
    for name in ("delayed-recall-0-local-20", "delayed-recall-0-h2o-20", "delayed-recall-0-full-100"):
        shutil.copytree(REPO / "sample_runs" / name, root / name)
    configs = {p.name: json.loads((p / "manifest.json").read_text())["config"] for p in root.iterdir()}
    at = app(root, monkeypatch)
    no_exception(at)
    table = at.dataframe[0].value.set_index("run_id")
    local = configs["delayed-recall-0-local-20"]
    assert local["policy"] == "local" and local["heavy"] > 0
    row = table.loc["delayed-recall-0-local-20"]
    assert (row["heavy"], row["recent"], row["sink"]) == (0, local["heavy"] + local["recent"], 0)
    h2o = configs["delayed-recall-0-h2o-20"]
    row = table.loc["delayed-recall-0-h2o-20"]
    assert (row["heavy"], row["recent"]) == (h2o["heavy"], h2o["recent"])
    assert table.loc["delayed-recall-0-full-100", ["heavy", "recent", "sink"]].isna().all()


def _union_recall(root: Path, shared: str, none_run: str) -> float:
    """Mean over steps (of the mean over KV sets) of the share of ``none_run``'s per-query-head union
    that ``shared`` holds, from the evictions and steps segments with plain sets."""
    import pandas as pd

    def table(run: str, name: str) -> pd.DataFrame:
        return pd.concat(pd.read_parquet(f) for f in sorted((root / run).glob(f"{name}-*.parquet")))

    gone = {  # (request, layer, kv_head, position) -> step it left the shared set
        (r.request, r.layer, r.kv_head, r.position): r.step for r in table(shared, "evictions").itertuples()
    }
    heads: dict[tuple, dict[int, int]] = {}
    for r in table(none_run, "evictions").itertuples():
        heads.setdefault((r.request, r.layer, r.kv_head, r.position), {})[r.q_head] = r.step
    steps_none = table(none_run, "steps")
    group = steps_none.groupby(["layer", "kv_head"])["q_head"].nunique().to_dict()
    grid = set(table(shared, "steps")[["request", "step", "layer", "kv_head"]].itertuples(index=False, name=None))
    grid &= set(steps_none[["request", "step", "layer", "kv_head"]].itertuples(index=False, name=None))
    per_step: dict[int, list[float]] = {}
    for request, step, layer, kv in grid:
        kept, union = set(), set()
        for i in range(step + 1):
            key = (request, layer, kv, i)
            if gone.get(key, step) >= step:
                kept.add(i)
            left = heads.get(key, {})
            if not (len(left) == group[(layer, kv)] and max(left.values()) < step):
                union.add(i)
        per_step.setdefault(step, []).append(len(kept & union) / len(union))
    return sum(sum(v) / len(v) for v in per_step.values()) / len(per_step)


@pytest.mark.parametrize("first", ["shared", "none"])
def test_compare_shows_the_union_bound_beside_a_per_query_head_run(monkeypatch, tmp_path, first):
    """A gqa=none run compared with a shared-set run: how much of the per-query-head union the shared
    sets hold (the upper bound of GQA aggregation), not an error."""
    import shutil

    root = tmp_path / "runs"
    runs = {"shared": "gqa-split-h2o-sum-h3r4", "none": "gqa-split-h2o-none-h3r4"}
    for name in runs.values():
        shutil.copytree(REPO / "sample_runs" / name, root / name)
    expected = _union_recall(root, runs["shared"], runs["none"])
    assert 0 < expected < 1
    other = runs["none" if first == "shared" else "shared"]
    at = app(root, monkeypatch, run=runs[first], page="compare", other=other)
    no_exception(at)
    assert not at.error, [e.value for e in at.error]
    assert "Kept-set union bound" in [s.value for s in at.subheader]
    assert widget(at, "metric", "Mean recall of the per-query-head union").value == f"{expected:.1%}"
    assert "upper bound of GQA aggregation" in texts(at, "caption")
    assert len(at.get("plotly_chart")) == 3  # the curves, recall over steps, recall per KV set


@pytest.mark.parametrize("page", ["overview", "report"])
def test_the_threshold_attribution_is_labelled_an_estimate(root, monkeypatch, page):
    at = app(root, monkeypatch, run="h2o-sum", page=page)
    no_exception(at)
    cards = [m.value for m in at.markdown if m.value.startswith("#### Request ")]
    assert cards and all("(estimate)]" in c for c in cards)
    assert "Attribution: the threshold estimate" in [s.value for s in at.subheader]
