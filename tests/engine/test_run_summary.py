"""The end of a pretraining run reports itself: the README's last-10 % figures, best validation, the probe,
the export; and no plot of a run is an empty frame."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from megakd.cli import main
from megakd.cli.pretrain import run_report
from megakd.engine.runlog import metric_figures, plot_metrics, summarize_run
from tests.helpers import tiny_overrides


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_summary_figures_by_hand(tmp_path):
    """20 logged steps: the last 10 % are the last 2 lines; validation losses lowest, scores highest (the
    earlier step on a tie); the probe's last and best."""
    rows = [{"step": s, "gen_loss": 10.0 - s / 4, "gen_acc": s / 100, "disc_loss": 1.0, "rtd_f1": s / 40}
            for s in range(1, 21)]
    rows[9].update(val_gen_loss=3.0, val_rtd_f1=0.5, probe_acc=0.6)
    rows[19].update(val_gen_loss=3.5, val_rtd_f1=0.5, probe_acc=0.55)
    summary = summarize_run(_write(tmp_path / "metrics.jsonl", rows))
    assert summary["tail_steps"] == (19, 20, 2) and summary["last_step"] == 20
    assert summary["tail"] == pytest.approx({"gen_loss": 5.125, "gen_acc": 0.195, "disc_loss": 1.0,
                                             "rtd_f1": 0.4875})
    assert summary["best_val"] == {"val_gen_loss": (3.0, 10), "val_rtd_f1": (0.5, 10)}
    assert summary["probe"] == {"last": (0.55, 20), "best": (0.6, 10)}
    text = run_report(summary, tmp_path, 125.4, tmp_path / "hf")
    assert "step 20, 2 min 5 s" in text and "gen_acc 0.195" in text and "rtd_f1 0.487" in text
    assert "val_gen_loss 3.000 (step 10)" in text and "probe: accuracy 0.550 at step 20 (best 0.600 at step 10)" in text
    assert f"HuggingFace export: {tmp_path / 'hf'}" in text


@pytest.mark.slow
def test_pretrain_ends_with_its_summary(tiny_data, tmp_path, caplog):
    """Through the command: the summary's averages are those of metrics.jsonl's last tenth, recomputed here."""
    run = tmp_path / "run"
    caplog.set_level(logging.INFO, logger="megakd")
    assert main(["pretrain", "-c", "configs/electra-tiny.yaml",
                 *tiny_overrides(tiny_data, run, **{"train.max_steps": 4, "train.probe_every": 4,
                                                    "train.probe_fit_examples": 60,
                                                    "train.probe_eval_examples": 30})]) == 0
    report = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("summary of"))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "gen_acc" in r]
    assert len(logged) == 4  # log_every 1: the last tenth (at least one line) is the last line
    assert f"steps 4-4): gen_loss {logged[-1]['gen_loss']:.3f}, gen_acc {logged[-1]['gen_acc']:.3f}" in report
    probe = [r for r in rows if "probe_acc" in r][-1]
    assert f"probe: accuracy {probe['probe_acc']:.3f} at step 4" in report
    assert f"HuggingFace export: {run / 'hf'}" in report


def _blue_pixels(png: Path) -> int:
    """Pixels of matplotlib's first line colour (tab:blue, #1f77b4) in a saved plot."""
    import matplotlib.image

    rgb = matplotlib.image.imread(png)[..., :3]
    return int((np.abs(rgb - np.array([0x1F, 0x77, 0xB4]) / 255).max(-1) < 0.08).sum())


def test_a_single_logged_point_is_drawn(tmp_path):
    """A one-point series (one probe in a short run) drawn as a bare line is an empty frame: only the
    legend's sample line is blue (60 pixels at this size). With markers, the legend's marker and the point's
    add about 50 pixels each; a two-point line more."""
    one = plot_metrics(_write(tmp_path / "one.jsonl", [{"step": 5, "probe_acc": 0.6}]), tmp_path / "one")
    two = plot_metrics(_write(tmp_path / "two.jsonl", [{"step": 5, "probe_acc": 0.6}, {"step": 50, "probe_acc": 0.7}]),
                       tmp_path / "two")
    assert [p.name for p in one] == ["probe.png"]
    drawn = _blue_pixels(one[0])
    assert drawn > 60 + 2 * 40, drawn
    assert _blue_pixels(two[0]) > drawn


def test_each_loss_fills_its_own_axis_and_the_probe_is_read_against_chance():
    """The discriminator's loss (0.62 -> 0.31) on the generator's axis (9 -> 2) is a flat line at the bottom. One
    probe on an axis zoomed to it says nothing: probe.png spans accuracy 0..1 and the run's steps, with chance
    drawn and the value written."""
    import matplotlib.pyplot as plt

    rows = [{"step": s, "gen_loss": 9 - 7 * s / 20, "disc_loss": 0.62 - 0.31 * s / 20} for s in range(1, 21)]
    figures = metric_figures([*rows, {"step": 10, "probe_acc": 0.6}], probe_chance=0.5)
    try:
        for ax, key, span in zip(figures["loss.png"].axes, ("gen_loss", "disc_loss"), (7 * 19 / 20, 0.31 * 19 / 20)):
            low, high = ax.get_ylim()
            assert [line.get_label() for line in ax.lines] == [key]
            assert span / (high - low) > 0.8, (key, low, high)  # the curve fills most of its axis
        (probe,) = figures["probe.png"].axes
        assert probe.get_ylim() == (0, 1) and probe.get_xlim()[0] == 0 and probe.get_xlim()[1] > 20
        chance = [line for line in probe.lines if line.get_label() == "chance (0.50)"]
        assert len(chance) == 1 and list(chance[0].get_ydata()) == [0.5, 0.5]
        assert [text.get_text() for text in probe.texts] == ["0.600"]
    finally:
        for fig in figures.values():
            plt.close(fig)
