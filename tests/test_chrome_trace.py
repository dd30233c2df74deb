"""Timelines people can open: the simulated step and the runtime's recorded events as Chrome trace JSON
(Perfetto, chrome://tracing), and the runtime's work as named ranges in a user's torch.profiler trace."""
import json

import torch
import torch.nn.functional as F

import socompile
from socompile.data import ByteBatches, stdlib_corpus
from socompile.models import build
from socompile.runtime import ranges
from socompile.runtime.events import Event
from socompile.tools.runtime_timeline import SPANS, chrome_trace


def lanes_by_tid(trace: dict, pid: int) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == pid}


def test_recorded_events_become_spans_and_instants_each_event_once():
    names = ["MainThread", "socompile-h2d_0"]
    recorded = [Event(1000, "h2d_start", 3, names[1]), Event(2000, "fw_wait", 3, names[0]),
                Event(5000, "h2d_end", 3, names[1]), Event(6000, "step_start", 0, names[0]),
                Event(9000, "validate", -1, names[0]), Event(9500, "step_start", 1, names[0])]
    trace = chrome_trace(recorded)
    lanes = lanes_by_tid(trace, 10)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    instants = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    assert [(e["name"], lanes[e["tid"]], e["ts"], e["dur"]) for e in spans] == [("h2d", names[1], 0.0, 4.0)]
    # no end recorded for the steps: they stay moments, not lost
    assert [(e["name"], lanes[e["tid"]]) for e in instants] == [
        ("fw_wait", names[0]), ("step_start", names[0]), ("validate", names[0]), ("step_start", names[0])]


def _train(cmodel, opt, batches):
    for x, y in batches:
        F.cross_entropy(cmodel(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()


def test_runtime_work_shows_as_named_ranges_in_torch_profiler_on_every_thread():
    torch.manual_seed(0)
    model = build("tiny", n_layers=1)
    # validation on (max_grad_norm), a worker thread, every bucket's weights flowing: every kind of work runs
    opt = socompile.AdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0, cpu_worker="thread")
    backend = socompile.SuperOffload({"compute": "eager", "gpu_buckets": 0, "bucket_size": "256KB",
                                      "weight_mode": "flow", "prefetch_distance": 1})
    cmodel = torch.compile(model, backend=backend)
    data = ByteBatches(stdlib_corpus(100_000), 2, 32, seed=0)
    _train(cmodel, opt, [next(data)])
    opt.events.clear()
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)   # the worker and h2d threads
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                experimental_config=config) as prof:
        _train(cmodel, opt, [next(data)])
    seen = {e.name for e in prof.events()}
    expected = {ranges.GRAD_COPY, ranges.BUCKET_STEP, ranges.VALIDATE, ranges.UPLOAD, ranges.PREFETCH,
                ranges.PREFETCH_COPY}
    assert expected <= seen, expected - seen
    # the validation range covers validation's work (its commits' uploads, or the redone steps), not a moment
    validate = [e for e in prof.events() if e.name == ranges.VALIDATE]
    inside = [e for e in prof.events() for v in validate if e.name in (ranges.UPLOAD, ranges.BUCKET_STEP)
              and e.thread == v.thread and v.time_range.start <= e.time_range.start <= v.time_range.end]
    assert validate and inside, [(e.name, e.thread) for e in prof.events() if e.name in expected]
    # the same step's recorded events as a trace: every event once, spans on the thread that started them
    events = opt.events.events()
    trace = json.loads(json.dumps(chrome_trace(events)))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    instants = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    assert 2 * len(spans) + len(instants) == len(events)
    lanes = lanes_by_tid(trace, 10)
    assert set(lanes.values()) == {e.thread for e in events}
    starts = [e for e in events if e.kind in SPANS]
    assert sorted(lanes[s["tid"]] for s in spans) == sorted(e.thread for e in starts)


def test_no_profiler_no_record_function():
    """Outside a profiler a range is a null context (no record_function call per bucket)."""
    assert not torch.autograd.profiler._is_profiler_enabled
    assert type(ranges.named(ranges.BUCKET_STEP, 0)).__name__ == "nullcontext"
