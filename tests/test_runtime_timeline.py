"""The runtime's recorded events of a real step become a timeline: flow copies on the h2d stream's thread, bucket
steps on the optimizer's thread, overlapping the backward on the compute thread."""
from socompile.tools.runtime_timeline import record_step, spans, to_svg


def test_a_recorded_step_shows_copies_and_steps_on_their_own_threads_overlapping_backward():
    events, ctx = record_step(layers=1, batch=2, seq=32, warmup=1)
    rows = spans(events)
    backward = next((s, e) for lane, kind, _, s, e in rows if kind == "backward")
    copies = [r for r in rows if r[1] == "h2d"]
    steps = [r for r in rows if r[1] == "step"]
    assert {r[0] for r in copies} == {"h2d"} and {r[0] for r in steps} == {"optimizer"}
    flow = [b.index for b in ctx.plan.buckets if b.weight_mode == "flow"]
    assert sorted({r[2] for r in copies}) == sorted(flow)
    # CPU buckets are stepped while the backward still runs (speculation without validation: final steps)
    assert any(backward[0] < s < backward[1] for _, _, _, s, _ in steps)
    svg = to_svg(events, "test")
    assert svg.startswith("<svg") and svg.count("<rect") >= len(copies) + len(steps)
