"""benchmarks/charts.py: the ratios its charts draw (peer time over jaxfuse time, within one
run), on rows shaped as `benchmarks._timing.save` writes them."""
import json

import pytest

from benchmarks import charts

ROWS = [
    {"section": "attention", "workload": "fwd", "impl": "jaxfuse", "ms": 2.0},
    {"section": "attention", "workload": "fwd", "impl": "cudnn", "ms": 1.5},
    {"section": "attention", "workload": "fwd", "impl": "tokamax_mosaic", "ms": 3.0},
    {"section": "attention", "workload": "fwd", "impl": "xla", "ms": 9.0},
    # a failed peer is a row without a time; a workload without jaxfuse's time is left out
    {"section": "attention", "workload": "bwd", "impl": "jaxfuse", "ms": 4.0},
    {"section": "attention", "workload": "bwd", "impl": "cudnn", "ms": None, "error": "x"},
    {"section": "attention", "workload": "bwd", "impl": "tokamax_mosaic", "ms": 5.0},
    {"section": "attention", "workload": "peers only", "impl": "cudnn", "ms": 1.0},
]


def test_ratios_are_peer_time_over_ours_within_the_run():
    got = charts.ratios(ROWS, "jaxfuse", ["cudnn", "tokamax_mosaic"])
    assert [wl for wl, _ in got] == ["fwd", "bwd"]
    assert got[0][1] == pytest.approx({"cudnn": 0.75, "tokamax_mosaic": 1.5})
    assert got[1][1] == pytest.approx({"tokamax_mosaic": 1.25})


def test_a_run_with_nothing_to_compare_says_so(tmp_path):
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"rows": ROWS}))
    with pytest.raises(SystemExit, match="has jaxfuse_triton and one of"):
        charts.main([str(tmp_path / "out.png"), str(run), "--ours", "jaxfuse_triton"])
