"""What a reader sees in each figure: text on the canvas, readable log and step axes, lone points
drawn, the paper's figure number, and what a curve's end or absence means. Synthetic run
folders (tests/report_runs.py), no training."""

import math

import numpy as np
import pytest
from report_runs import paft_runs, random_node, write_run

from sdcstudy.core import reports
from sdcstudy.paft import report as paft_report
from sdcstudy.report import plots, runs as report
from sdcstudy.reproduce import bands as B, figures as FG


def _runs(*dirs):
    return report.label_runs([report.load_run(d) for d in dirs])


@pytest.fixture
def drawn(monkeypatch):
    """drawn(draw, *args) -> the figure `draw` saved (as written: after `save_figure`'s last
    touches), or None when it drew nothing."""
    kept = []
    monkeypatch.setattr(reports, "save_png", lambda fig, path, **kw: kept.append(fig) or path)

    def draw(function, *args):
        kept.clear()
        path = function(*args)
        if path is None:
            return None
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        fig = kept[-1]
        FigureCanvasAgg(fig).draw()  # `save_figure` closed it: a canvas to measure text on
        return fig
    return draw


def _metrics(steps, **columns):
    return [{"step": s, "loss/healthy": 3.0 - 0.01 * s, "grad/norm": 1.0,
             **{k: v[s - 1] for k, v in columns.items()}} for s in range(1, steps + 1)]


def _nan_from(step, steps, values):
    return [float("nan") if s >= step else v for s, v in zip(range(1, steps + 1), values)]


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    """{name: runs}: a single node, one step, a run gone NaN, and 20 runs."""
    root = tmp_path_factory.mktemp("figures")
    single = list(random_node(root / "single", 7, steps=12, layers=1, tp=1).values())
    one = list(random_node(root / "one", 14, steps=1, layers=1, tp=1).values())
    steps = 12
    up = [0.01 * s for s in range(1, steps + 1)]
    gone = _metrics(steps, **{"loss/suspect": _nan_from(5, steps, [3.0] * steps),
                              "grad/norm_suspect": _nan_from(5, steps, [1.1] * steps),
                              "grad/diff_l2": _nan_from(5, steps, up),
                              "grad/nts": _nan_from(5, steps, up),
                              "param/diff_l2": _nan_from(5, steps, up)})
    nan = [write_run(root / "nan" / "a-long-run-folder-name-free", mode="free",
                     profile="nan-burst", metrics=gone),
           write_run(root / "nan" / "a-long-run-folder-name-sync", mode="paramsync",
                     profile="nan-burst", metrics=gone)]
    many = [d for node in range(1, 8)
            for d in random_node(root / "many", node, steps=8, layers=1, tp=1).values()]
    return {"single": _runs(*single), "one step": _runs(*one), "nan": _runs(*nan),
            "21 runs": _runs(*many)}


def _off_canvas(fig):
    """The inches by which what `fig` draws (titles, labels, tick labels, legends) reaches
    past each edge of its canvas, [] when nothing does."""
    box = fig.get_tightbbox(fig.canvas.get_renderer())
    width, height = fig.get_size_inches()
    slack = 1 / fig.dpi
    return [(edge, round(by, 2)) for edge, by in (("left", -box.x0), ("bottom", -box.y0),
                                                 ("right", box.x1 - width),
                                                 ("top", box.y1 - height)) if by > slack]


@pytest.mark.parametrize("scenario", ["single", "one step", "nan", "21 runs"])
def test_report_figures_keep_every_text_on_the_canvas(scenarios, drawn, tmp_path, scenario):
    # Seen before: Figure 6's legend cut off a run's "(not finite from step N)", Figure 5's
    # title ran off both sides of a one-panel figure, and a one-step run's log tick labels
    # (1.12x10^-3) ran off the left edge.
    for name, function in plots.FIGURES.items():
        fig = drawn(function, scenarios[scenario], tmp_path / name)
        if fig is not None:
            assert _off_canvas(fig) == [], name


def _log_axes(fig):
    return [(ax, which) for ax in fig.axes if ax.get_visible() for which in ("x", "y")
            if getattr(ax, f"get_{which}scale")() == "log"]


def _labelled_ticks(ax, which):
    axis = getattr(ax, f"{which}axis")
    low, high = sorted(getattr(ax, f"get_{which}lim")())
    return [t.get_text() for t, loc in zip(axis.get_ticklabels(), axis.get_ticklocs())
            if low <= loc <= high and t.get_text()]


@pytest.mark.parametrize("scenario", ["single", "one step", "nan"])
def test_every_log_axis_labels_at_least_two_ticks(scenarios, drawn, tmp_path, scenario):
    # A run whose values stay within one decade got one labelled tick (10^-4) or none.
    for name, function in plots.FIGURES.items():
        fig = drawn(function, scenarios[scenario], tmp_path / name)
        for ax, which in _log_axes(fig) if fig is not None else ():
            shared = getattr(ax, f"get_shared_{which}_axes")().get_siblings(ax)
            assert max(len(_labelled_ticks(a, which)) for a in shared) >= 2, (name, which)


def test_step_axes_of_a_one_step_run_have_whole_steps(scenarios, drawn, tmp_path):
    # A one-step run's axis was ticked 0.95, 0.975, 1.0, ...: steps are whole numbers.
    for name in ("fig3_mismatch_frequency.png", "fig5_gradient_difference.png",
                 "fig6_training_dynamics.png", "fig10_abft_flag_frequency.png"):
        fig = drawn(plots.FIGURES[name], scenarios["one step"], tmp_path / name)
        for ax in fig.axes:
            if ax.get_visible() and ax.get_xlabel() == "optimizer step":
                ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
                assert len(ticks) >= 2 and all(t == int(t) for t in ticks), (name, ticks)


def test_a_one_step_run_is_drawn_as_points(scenarios, drawn, tmp_path):
    # Figure 6 drew each curve of a one-step run as a line of one point: nothing at all.
    fig = drawn(plots.training, scenarios["one step"], tmp_path / "fig6.png")
    for ax in fig.axes:
        for line in ax.get_lines():
            if np.isfinite(np.asarray(line.get_ydata(), float)).sum() == 1:
                assert line.get_marker() not in (None, "", "None"), ax.get_title()


def _title(fig):
    """The figure's title and its panels' titles, as one line of words."""
    return " ".join(" ".join([fig._suptitle.get_text() if fig._suptitle else ""]
                             + [ax.get_title() for ax in fig.axes]).split())


@pytest.mark.parametrize("name, number", [("fig3_mismatch_frequency.png", 3),
                                          ("fig4_mismatch_frequency_smoothed.png", 4),
                                          ("fig5_gradient_difference.png", 5),
                                          ("fig6_training_dynamics.png", 6),
                                          ("fig10_abft_flag_frequency.png", 10)])
def test_figures_name_the_paper_figure_they_reproduce(scenarios, drawn, tmp_path, name, number):
    # The PNGs said nothing of the paper's figure number; only report.md's heading did.
    fig = drawn(plots.FIGURES[name], scenarios["single"], tmp_path / name)
    assert f"Figure {number} " in _title(fig)


def test_figure_5_of_lockstep_runs_says_it_is_not_the_papers_quantity(tmp_path, drawn):
    # Without a paramsync run, Figure 5 draws lock-step runs, whose taps repair the compared
    # sites before the weight gradients (docs/metrics.md): it was titled as Figure 5 anyway.
    runs = _runs(random_node(tmp_path, 1, steps=6, layers=1, tp=1)["lockstep"])
    title = _title(drawn(plots.gradients, runs, tmp_path / "fig5.png"))
    assert "not Figure 5's quantity" in title and "Figure 5 (" not in title


def test_figure_5_marks_the_step_from_which_gradients_are_not_finite(scenarios, drawn,
                                                                     tmp_path):
    # The red curve of a run gone NaN just stopped, as if the run had ended.
    fig = drawn(plots.gradients, scenarios["nan"], tmp_path / "fig5.png")
    assert any("not finite from step 5" in t.get_text() for ax in fig.axes for t in ax.texts)


def test_figure_6_draws_the_healthy_curves_over_the_suspects(scenarios, drawn, tmp_path):
    # The healthy (dashed black) curve was drawn first and hidden under 15 coloured ones.
    fig = drawn(plots.training, scenarios["21 runs"], tmp_path / "fig6.png")
    for ax in fig.axes[1:]:
        lines = ax.get_lines()
        healthy = [line for line in lines if line.get_color() == "black"]
        others = [line for line in lines if line.get_color() != "black"]
        assert healthy and min(h.get_zorder() for h in healthy) > max(
            o.get_zorder() for o in others)


# --- PAFT -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def paft(tmp_path_factory):
    return _runs(*paft_runs(tmp_path_factory.mktemp("paft"), steps=12))


def test_paft_curves_say_they_are_smoothed_and_why_the_divergence_has_gaps(paft, drawn,
                                                                           tmp_path):
    # The loss curves are a moving mean over 5 steps and said nothing of it; the divergence is
    # zero right after each sync, a gap on its log axis, unexplained.
    loss = drawn(paft_report.curves, paft, tmp_path / "l.png", paft_report.LOSS, "t", None, 5)
    assert "moving mean over 5 steps" in loss.axes[0].get_ylabel()
    div = drawn(paft_report.curves, paft, tmp_path / "d.png", paft_report.DIV, "t")
    assert "after a sync" in div.axes[0].get_title()


def test_paft_legends_keep_long_labels_and_the_report_names_each_method(paft, drawn, tmp_path,
                                                                        monkeypatch):
    # The legend had room for 1.6 inches whatever the labels: the experiments' "model-only
    # H=16 s2=0.01" ran off the figure; the report's legend gave folder names, not methods.
    long = {f"model-only H=16 s2=0.01 {label}": run for label, run in paft.items()}
    fig = drawn(paft_report.curves, long, tmp_path / "l.png", paft_report.LOSS, "t")
    assert _off_canvas(fig) == []
    figures = []
    monkeypatch.setattr(paft_report, "curves", lambda runs, *a, **k: figures.append(runs))
    paft_report.draw_figures(paft, tmp_path)
    assert "sync-8: PAFT-Sync(H=8)" in figures[0] and "dyn: PAFT-Dyn" in figures[0]


def test_paft_final_loss_bars_keep_the_legend_off_the_bars(paft, drawn, tmp_path):
    # The legend sat inside the axes, over the bars of the last group.
    table = paft_report.final_table(paft)
    fig = drawn(paft_report.bar_final, table, tmp_path / "b.png", "sigma2", "method", "t")
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    legend, axes_box = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
    assert legend.x0 >= axes_box.x1 and "not from zero" in ax.get_ylabel()


# --- the scorecard ---------------------------------------------------------------------------


def _wcnts_rows(ours):
    return [B.Row(node, "Figure 5", "WCNTS", 1e-2, value, None, "x", "pass", expected=1e-2)
            for node, value in enumerate(ours, 1)]


def test_scorecard_wcnts_of_zero_is_written_not_drawn_as_a_bar(drawn, tmp_path):
    # A WCNTS of 0 was drawn as a bar up to a tenth of the smallest value: a number it is not.
    fig = drawn(FG.wcnts, _wcnts_rows([0.0, 2e-3]), tmp_path / "w.png")
    ax = fig.axes[0]
    floor = ax.get_ylim()[0]
    ours = ax.containers[1]
    assert ours[0].get_height() == 0 and ours[1].get_y() + ours[1].get_height() == \
        pytest.approx(2e-3)
    assert ax.containers[0][0].get_y() + ax.containers[0][0].get_height() == \
        pytest.approx(1e-2)
    assert [t.get_text() for t in ax.texts] == ["0"] and ax.texts[0].get_position()[1] == floor
    assert "Figure 5" in ax.get_title() and _off_canvas(fig) == []


def test_scorecard_wcnts_of_one_node_has_labelled_ticks(drawn, tmp_path):
    fig = drawn(FG.wcnts, _wcnts_rows([2e-2]), tmp_path / "w.png")
    assert len(_labelled_ticks(fig.axes[0], "y")) >= 2


def test_scorecard_free_runs_name_zero_and_nonfinite_runs_and_label_axes(tmp_path, drawn):
    # A run whose param/diff_l2 is 0 throughout vanished from the log axes without a word;
    # the axes had no y labels, the 2% line no name, and a long label ran off the figure.
    steps = 6
    zero = write_run(tmp_path / "zero", mode="free", profile="paper-node-13",
                     metrics=_metrics(steps, **{"loss/suspect": [3.0] * steps,
                                                "param/diff_l2": [0.0] * steps}))
    gone = write_run(tmp_path / "gone-with-a-rather-long-folder-name", mode="free",
                     profile="nan-burst",
                     metrics=_metrics(steps, **{"loss/suspect": _nan_from(3, steps, [3.1] * 6),
                                                "param/diff_l2": _nan_from(3, steps, [.1] * 6)}))
    fig = drawn(FG.free_runs, _runs(zero, gone), tmp_path / "f.png")
    labels = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert "Node 13 (always 0)" in labels and "nan-burst (not finite from step 3)" in labels
    assert any("band" in label for label in labels)
    assert all(ax.get_ylabel() for ax in fig.axes) and _off_canvas(fig) == []


# --- the bench plot ---------------------------------------------------------------------------


def test_bench_overheads_have_distinct_colours_and_do_not_cover_each_other(drawn, tmp_path):
    # 20 overheads got matplotlib's 10 colours twice over, and every curve measured at the same
    # preset put its marker and bar on the same x.
    from sdcstudy.bench import plot as bench_plot

    ratio = {"median": 1.0, "min": 1.0, "max": 1.0}
    variants = {"off": {"ratio": ratio}, **{f"v{i}": {"ratio": dict.fromkeys(ratio, 1 + i / 10)}
                                            for i in range(20)}}
    fig = drawn(bench_plot.overhead_figure, {"suite": "abft", "results": [
        {"preset": "tiny", "n_params": 1000, "variants": variants}]}, tmp_path / "b.png")
    points = {(str(line.get_color()), float(line.get_xdata()[0]))
              for line in fig.axes[0].get_lines() if line.get_marker() == "o"}
    assert len({colour for colour, _ in points}) == 20
    assert len({x for _, x in points}) == 20 and all(math.isfinite(x) for _, x in points)


def test_figure_6_says_which_pair_never_drifted_apart(tmp_path, drawn):
    # A pair whose parameters never differed (a rare profile, a short run) has no line on the
    # log axis of the parameter difference, yet the legend listed it like the others.
    steps = 4
    apart = write_run(tmp_path / "apart", mode="free", profile="paper-node-1",
                      metrics=_metrics(steps, **{"param/diff_l2": [0.0, 1e-3, 2e-3, 3e-3],
                                                 "loss/suspect": [3.0] * steps}))
    same = write_run(tmp_path / "same", mode="free", profile="paper-node-7",
                     metrics=_metrics(steps, **{"param/diff_l2": [0.0] * steps,
                                                "loss/suspect": [3.0] * steps}))
    fig = drawn(plots.training, _runs(apart, same), tmp_path / "fig6.png")
    legend = [t.get_text() for ax in fig.axes if ax.get_legend()
              for t in ax.get_legend().get_texts()]
    assert legend[:2] == ["Node 1", "Node 7 (parameters never differed)"]
