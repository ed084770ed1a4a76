"""The benchmark report's arithmetic, on hand-made records.

Backend-independent, so it runs in one backend's process only.
"""

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


def test_attainable_is_three_ceiling_steps_and_one_parent_step():
    # ceiling 1 s, parent 2 s per micro-batch: the fastest window of 4 is
    # 3 * 1 + 2 = 5 s, i.e. 1.25 s per micro-batch.
    seconds = {"ceiling": 1.0, "parent": 2.0, "keras_builtin_k4": 3.0}
    assert report.attainable(seconds, "ours4/parent") == pytest.approx(1.6)
    assert report.attainable(seconds, "ours4/keras") == pytest.approx(2.4)
    assert report.attainable(seconds, "ours4/ceiling") == pytest.approx(0.8)
    assert report.attainable(seconds, "ours1/parent") is None
    del seconds["ceiling"]
    assert report.attainable(seconds, "ours4/parent") is None


def test_paired_ratios_and_bounds_are_medians_over_rounds():
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
    assert row["ratios"]["ours4/parent"] == (pytest.approx(1.2), 1.0, True)
    assert row["ratios"]["ours4/keras"] == (pytest.approx(1.5), 1.5, True)
    assert row["ratios"]["ours4/ceiling"] == (pytest.approx(0.6), 0.9, False)
    assert row["ratios"]["ours1/parent"][0] == pytest.approx(1.0)
    # Every round: parent 1/r, ceiling 1/(2r) s per micro-batch, so
    # ours4/parent <= 4 * (1/r) / (3/(2r) + 1/r) = 1.6.
    assert row["bounds"]["ours4/parent"] == pytest.approx(1.6)
    assert row["bounds"]["ours4/ceiling"] == pytest.approx(0.8)
    assert "ours1/parent" not in row["bounds"]
    assert row["state_ok"]


def test_markdown_lists_each_miss_beside_its_attainable_value():
    results = {
        "machine": {"platform": "test", "cpu_count": 2, "python": "3.11"},
        "command": "python -m benchmarks.run",
        "repeats": 1,
        "smoke": False,
        "seconds": 1,
        "memory": [],
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
    assert "| jax | mlp | adam | ours4/ceiling | 0.300 | 0.9 | 0.80 " in table
    assert "| jax | mlp | adam | ours4/parent | 0.600 | 1.0 | 1.60 " in table
