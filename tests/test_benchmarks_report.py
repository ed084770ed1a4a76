"""The benchmark report's arithmetic, on hand-made records.

Backend-independent, so it runs in one backend's process only.
"""

import json

import pytest

from benchmarks import report

pytestmark = pytest.mark.backends("jax")


def _records(rounds_by_config):
    """Timing records of one group, as `worker.time_group` yields them."""
    return [
        {
            "mode": "jax",
            "workload": "mlp",
            "optimizer": "adam",
            "config": config,
            "samples_per_s": sorted(rounds)[len(rounds) // 2],
            "repeats": rounds,
            "state_bytes": 100 if config == "parent" else 140,
            "trainable_bytes": 40,
        }
        for config, rounds in rounds_by_config.items()
    ]


def test_ideal_is_three_add_only_steps_and_one_parent_step_per_window():
    # add-only 1 s, parent 2 s per micro-batch: the fastest window of 4 is
    # 3 * 1 + 2 = 5 s, i.e. 1.25 s per micro-batch.
    assert report.ideal_seconds({"ceiling": 1.0, "parent": 2.0}) == 1.25
    assert report.ideal_seconds({"parent": 2.0}) is None


def test_paired_ratios_are_medians_over_rounds():
    # Round 2 is a slow spell for everything: paired ratios ignore it.
    results = {
        "timings": _records(
            {
                "parent": [100.0, 50.0, 100.0],
                "ours_k4": [120.0, 60.0, 110.0],
                "ours_k1": [100.0, 50.0, 90.0],
                "ceiling": [200.0, 100.0, 200.0],
                "keras_builtin_k4": [80.0, 40.0, 80.0],
            }
        )
    }
    (row,) = report.ratio_rows(results)
    assert row["ratios"]["ours4/parent"] == pytest.approx(1.2)
    assert row["ratios"]["ours4/keras"] == pytest.approx(1.5)
    assert row["ratios"]["ours1/parent"] == pytest.approx(1.0)
    # Every round: parent 1/r, add-only 1/(2r) s per micro-batch, so the
    # ideal takes (3/(2r) + 1/r) / 4 = 0.625/r s: 1.6x the parent's rate;
    # ours runs at 1.2x (median), so 1.2 / 1.6 = 0.75 of the ideal.
    assert row["ratios"]["ours4/ideal"] == pytest.approx(0.75)
    assert row["state_ok"]
    (best,) = report.ratio_rows(results, statistic="best")
    assert best["ratios"]["ours4/parent"] == pytest.approx(1.2)


def test_a_failed_configuration_has_no_rate_and_no_ratio():
    records = _records({"parent": [100.0], "ours_k4": [60.0]})
    records.append(
        {
            "mode": "jax",
            "workload": "mlp",
            "optimizer": "adam",
            "config": "keras_builtin_k4",
            "error": "RuntimeError: merge_call",
        }
    )
    (row,) = report.ratio_rows({"timings": records})
    assert row["ratios"]["ours4/keras"] is None
    assert row["ratios"]["ours4/ideal"] is None
    assert row["ratios"]["ours4/parent"] == pytest.approx(0.6)
    assert report._rate_cell(row, "keras_builtin_k4") == "fails: RuntimeError"


def test_markdown_lists_rates_and_ratios_without_verdicts():
    results = {
        "machine": {"platform": "test", "cpu_count": 2, "python": "3.11"},
        "command": "python -m benchmarks.run",
        "repeats": 1,
        "smoke": False,
        "seconds": 1,
        "memory": [
            {
                "mode": "jax",
                "workload": "mlp",
                "config": "ours_k4",
                "peak_rss_bytes": 3 * 2**20,
            }
        ],
        "timings": _records(
            {
                "parent": [100.0],
                "ours_k4": [60.0],
                "ours_k1": [100.0],
                "ceiling": [200.0],
                "keras_builtin_k4": [80.0],
            }
        ),
    }
    table = report.markdown(results)
    # rates: parent, Keras, ours k=4, ours k=1, add-only, parent 4b (none);
    # ratios: 0.6, 0.75, 60 / 160 = 0.375, 1.0.
    assert (
        "| jax | mlp | adam | 100 | 80 | 60 | 100 | 200 | - | "
        "0.60 | 0.75 | 0.38 | 1.00 | yes |"
    ) in table
    assert "| jax | mlp | - | - | 3 | - | 0 |" in table
    assert "**NO**" not in table


def test_the_state_check_allows_the_window_state_and_nothing_more():
    from accum_optimizers._window.spec import window_state

    # The benchmarks' optimizers do not measure the noise scale.
    state = window_state(measure_noise_scale=False)
    scalars = [variable for variable in state if not variable.per_variable]
    assert report.WINDOW_SCALARS == len(scalars)


def test_micro_step_summary_is_the_median_and_range_of_runs_medians(tmp_path):
    from benchmarks import micro_step

    # Per-round ratios ours / built-in: run 1: 1.1, 1.2, 3.0 (a slow spell
    # of the built-in in round 3) -> median 1.2; run 2: 0.9 each -> 0.9.
    runs = {
        1: {"keras_builtin_k4": [10.0, 10.0, 1.0], "ours_k4": [11, 12, 3]},
        2: {"keras_builtin_k4": [10.0] * 3, "ours_k4": [9.0] * 3},
    }
    for run, rounds in runs.items():
        path = micro_step.run_file(tmp_path, "jax", "mlp", run)
        path.write_text(
            "\n".join(
                json.dumps({"config": config, "repeats": values})
                for config, values in rounds.items()
            )
        )
    args = micro_step.parse(
        ["--runs", "2", "--modes", "jax", "--workloads", "mlp"]
        + ["--out", str(tmp_path)]
    )
    row = micro_step.summary(args).splitlines()[2]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[:3] == ["jax", "mlp", "1.05 (0.90-1.20)"]
    assert set(cells[3:]) == {"n/a"}  # no parent, no features' configs
