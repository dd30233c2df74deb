"""The runtime's recorded events of a real step become a timeline: flow copies on the h2d stream's thread, bucket
steps on the optimizer's thread, overlapping the backward on the compute thread."""
from socompile.tools.runtime_timeline import record_step, spans, to_svg
from training_helpers import bench_module


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


def _gpu_step():
    return bench_module("gpu_step")


def test_gpu_step_prints_each_cpu_buckets_step_and_upload_for_both_choices_on_the_emulated_device(monkeypatch,
                                                                                                  capsys):
    """bench/gpu_step.py's cases run with every bucket on the CPU and with the planner's own choice, each
    printing one step's per-bucket timeline: on the emulated device (the CUDA path: a separate host master,
    each CPU bucket uploaded after its step) every CPU bucket's step span precedes its upload span."""
    from training_helpers import use_emulated_device
    use_emulated_device(monkeypatch)
    gpu_step = _gpu_step()
    assert gpu_step.parse_gpu_buckets("0,planner, 2") == [0, None, 2]
    import argparse

    import pytest
    with pytest.raises(argparse.ArgumentTypeError, match="counts and 'planner'"):
        gpu_step.parse_gpu_buckets("0,auto")
    for choice in (0, None):
        gpu_step.emulated_timeline(choice, steps=2)
        out = capsys.readouterr().out
        header = next(line for line in out.splitlines() if line.startswith("emulated device"))
        cpu = int(header.split(" stepped on the CPU")[0].split()[-1])
        rows = [line.split() for line in out.splitlines() if line.startswith("    ") and line.split()[1] in
                ("step", "upload")]
        steps = {int(r[2]): float(r[3]) for r in rows if r[1] == "step" and r[0] == "optimizer"}
        uploads = {int(r[2]): float(r[3]) for r in rows if r[1] == "upload"}
        assert "ok: each of the" in out and (cpu > 0) == (choice == 0)
        assert len(steps) >= cpu and all(uploads[b] >= steps[b] for b in steps)
