"""attnlab/tools/plot_ppl.py: debiased EMA in loss space, tokens axis, --skip, several runs on one figure."""

import json
import math

import pytest

from attnlab.tools import plot_ppl


def test_debiased_ema_of_a_constant_is_the_constant():
    for beta in (0.0, 0.5, 0.9, 0.99):
        assert plot_ppl.debiased_ema([3.25] * 50, beta) == pytest.approx([3.25] * 50, rel=1e-12)


def test_debiased_ema_first_points():
    beta = 0.9
    out = plot_ppl.debiased_ema([4.0, 2.0, 1.0], beta)
    assert out[0] == pytest.approx(4.0)  # not (1 - β)·4 = 0.4, as an undebiased EMA from 0 gives
    assert out[1] == pytest.approx((beta * 4.0 + 2.0) / (1 + beta))  # weights β : 1, normalised
    assert out[2] == pytest.approx((beta**2 * 4.0 + beta * 2.0 + 1.0) / (1 + beta + beta**2))
    with pytest.raises(ValueError):
        plot_ppl.debiased_ema([1.0], 1.0)


def test_smoothing_is_per_step_whatever_the_log_frequency():
    """Logged every 20 steps, β = 0.9 per step decays by 0.9^20 between points: the smoothed curve follows the
    logged one (it used to average ~10 logged points, ~200 steps, and end far above the last value)."""
    steps = list(range(20, 420, 20))
    losses = [9.0 - 0.3 * k for k in range(len(steps))]
    out = plot_ppl.debiased_ema(losses, 0.9, steps)
    assert out[0] == pytest.approx(losses[0])
    assert abs(out[-1] - losses[-1]) < 0.3 * 0.9**20 / (1 - 0.9**20) + 1e-9  # one gap's lag, weighted
    per_step = [9.0 - 0.3 * (s - 20) / 20 for s in range(20, 401)]  # the same line logged at every step
    assert plot_ppl.debiased_ema(per_step, 0.9)[-1] == pytest.approx(
        plot_ppl.debiased_ema(per_step, 0.9, list(range(20, 401)))[-1])


def _run(root, name, losses, gbs=4, seq=16):
    d = root / name
    d.mkdir()
    with open(d / "metrics.jsonl", "w") as f:
        for step, loss in enumerate(losses, 1):
            f.write(json.dumps({"step": step, "loss": loss, "ppl": math.exp(loss)}) + "\n")
        f.write(json.dumps({"step": len(losses), "val_loss": losses[-1], "val_ppl": math.exp(losses[-1])}) + "\n")
    (d / "config.toml").write_text(f"[training]\nglobal_batch_size = {gbs}\nseq_len = {seq}\n")
    return d


def test_two_runs_tokens_axis_skip_and_smoothing_in_loss_space(tmp_path, monkeypatch):
    import matplotlib.axes

    a = _run(tmp_path, "a", [8.0, 6.0, 2.0, 6.0, 2.0, 6.0])
    b = _run(tmp_path, "b", [7.0] * 6, gbs=2)
    drawn = []
    real = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda self, x, y, *a, **kw: drawn.append((kw["label"], list(x), list(y))) or real(self, x, y, *a, **kw))
    plot_ppl.main([str(a), str(b), "-o", str(tmp_path / "p.png"), "--x", "tokens", "--skip", "2", "--smooth", "0.5"])
    assert (tmp_path / "p.png").stat().st_size > 0
    lines = {label: (x, y) for label, x, y in drawn}
    assert set(lines) == {"_raw", "a train", "a val", "b train", "b val"}  # "_raw": the faint logged curves
    assert [y for label, _, y in drawn if label == "_raw"][0] == pytest.approx([math.exp(v) for v in (2, 6, 2, 6)])
    x, y = lines["a train"]
    assert x == [3 * 64, 4 * 64, 5 * 64, 6 * 64]  # steps 1-2 skipped; 4 x 16 tokens per step
    # smoothing of the losses 2, 6, 2, 6 (debiased), then exp: below the mean of the perplexities
    assert y == pytest.approx([math.exp(v) for v in plot_ppl.debiased_ema([2.0, 6.0, 2.0, 6.0], 0.5)])
    assert lines["b train"][0] == [3 * 32, 4 * 32, 5 * 32, 6 * 32]
    assert lines["b train"][1] == pytest.approx([math.exp(7.0)] * 4)
    assert lines["a val"] == ([6 * 64], [pytest.approx(math.exp(6.0))])


def test_bands_draw_each_arms_mean_and_seed_range(tmp_path, monkeypatch):
    import matplotlib.axes

    runs = [_run(tmp_path, "arm_s0", [4.0, 3.0, 2.0]), _run(tmp_path, "arm_s1", [6.0, 5.0, 4.0]),
            _run(tmp_path, "other", [5.0, 5.0, 5.0])]
    drawn, bands = [], []
    real_plot, real_fill = matplotlib.axes.Axes.plot, matplotlib.axes.Axes.fill_between
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda self, x, y, *a, **kw: drawn.append((kw["label"], list(y))) or real_plot(self, x, y, *a, **kw))
    monkeypatch.setattr(matplotlib.axes.Axes, "fill_between",
                        lambda self, x, lo, hi, **kw: bands.append((list(lo), list(hi))) or real_fill(self, x, lo, hi, **kw))
    plot_ppl.main([*map(str, runs), "-o", str(tmp_path / "p.png"), "--bands"])
    lines = dict(drawn)
    assert set(lines) == {"arm train (mean of 2)", "arm val", "other train", "other val"}
    assert lines["arm train (mean of 2)"] == pytest.approx([math.exp(5.0), math.exp(4.0), math.exp(3.0)])
    assert lines["arm val"] == pytest.approx([math.exp(3.0)])
    assert bands == [(pytest.approx([math.exp(v) for v in (4, 3, 2)]), pytest.approx([math.exp(v) for v in (6, 5, 4)]))]
