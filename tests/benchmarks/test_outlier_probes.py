"""benchmarks/outlier_probes.py on the debug flavor: the numbers benchmarks/outliers.md quotes come from these
functions, so they must measure what they say."""

import torch

from benchmarks.outlier_probes import cala_kernel_ratio, hla_range, init_stats


def test_cala_kernel_ratio_is_bounded_at_gain_one_and_grows_with_the_gain():
    # elu+1 of a LayerNorm'd vector lies in (0, 1 + sqrt(D)]: one key outweighs another by a few times at most
    low, high = cala_kernel_ratio(1.0, dim=16, starts=8, steps=100), cala_kernel_ratio(4.0, dim=16, starts=8, steps=100)
    assert 1.5 < low < 4.0 and high > 5 * low


def test_init_stats_measure_the_attention_branch():
    flags = ["--model.flavor", "debug", "--model.vocab_size", "256"]
    soft, hla = (init_stats(m, flags, None, None, 32) for m in ("softmax", "hla"))
    # HLA's per-head output RMSNorm makes the mixer output unit RMS; softmax averages values of RMS ~0.02·sqrt(dim)
    assert abs(hla["mixer_rms_mean"] - 1.0) < 0.05 and soft["mixer_rms_mean"] < 0.5
    assert hla["branch_rms_mean"] > 2 * soft["branch_rms_mean"]
    rows = hla_range(flags, None, None, 32)
    assert len(rows) == 4 and all(torch.isfinite(torch.tensor(float(r["median"]))) for r in rows)
