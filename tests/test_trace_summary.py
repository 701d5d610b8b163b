"""benchmarks/attention_trace.py's summary of a Mosaic GPU trace: which warpgroup is the
producer in CTAs of three and four warpgroups, and the producer's own scopes, on a trace
shaped as Mosaic GPU writes it (B/E events per thread id, one id per warpgroup, CTA by CTA,
the producer last; `ts` in thousands of cycles, as the summary reads it)."""
import json

import pytest

from benchmarks import attention_trace


def _trace(tmp_path, wgs):
    events = []

    def scope(tid, name, t0, t1):
        events.extend([dict(ph="B", name=name, ts=t0, tid=tid),
                       dict(ph="E", name=name, ts=t1, tid=tid)])
    for cta in range(2):
        for wg in range(wgs - 1):                       # consumers: two steps each
            tid = 1 + cta * wgs + wg
            for step in range(2):
                t = step * 10
                scope(tid, "wait_k", t, t + 1)          # 1000 cycles
                scope(tid, "softmax", t + 1, t + 4)
        producer = 1 + cta * wgs + wgs - 1
        scope(producer, "land", 0, 2)
        scope(producer, "clean", 2, 7)
    path = tmp_path / "t-trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


@pytest.mark.parametrize("wgs", [3, 4])
def test_producer_is_the_last_warpgroup_of_each_cta(tmp_path, wgs):
    out = attention_trace.summarize(_trace(tmp_path, wgs), "fwd", wgs)
    consumers = 2 * (wgs - 1)
    assert out["steps"] == 2 * consumers
    assert out["wait_k cyc/step"] == pytest.approx(1000)
    assert out["softmax cyc/step"] == pytest.approx(3000)
    # the producer's scopes are its own rows, never a consumer's
    assert "land cyc/step" not in out and "clean cyc/step" not in out
    assert out["producer clean cyc/each"] == pytest.approx(5000)
    assert out["producer land cyc/each"] == pytest.approx(2000)
    assert out["producer clean count"] == 2
