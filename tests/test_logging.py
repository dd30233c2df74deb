"""socompile in PyTorch's tooling: TORCH_LOGS=+socompile, structured-trace artifacts (tlparse), compile-phase
timings in torch's compile-time breakdown. Subprocesses, because torch reads TORCH_LOGS/TORCH_TRACE at import."""
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import torch

import socompile  # noqa: F401  (registers the log name)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_TRAIN_ONE_STEP = textwrap.dedent("""
    import torch, socompile
    from socompile.models import build
    torch.manual_seed(0)
    model = build("tiny", n_layers=1)
    opt = socompile.AdamW(model.parameters())
    cmodel = torch.compile(model, backend="superoffload", options={"compute": "eager", "gpu_buckets": 0})
    x = torch.randint(0, 256, (2, 16))
    torch.nn.functional.cross_entropy(cmodel(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    print(sorted(k for k in torch._dynamo.utils.compilation_time_metrics if k.startswith("socompile.")))
""")


def _run(env_extra: dict, script: str = _TRAIN_ONE_STEP) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_LOGS", "TORCH_TRACE"))}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_torch_trace_holds_the_plan_and_each_pass_graph_as_artifacts(tmp_path):
    out = _run({"TORCH_TRACE": str(tmp_path)})
    assert "'socompile.capture', 'socompile.passes', 'socompile.plan'" in out.stdout   # dynamo_timed phases
    logs = list(tmp_path.glob("*.log"))
    assert logs
    records = []
    for line in logs[0].read_text().splitlines():
        if "] {" in line:
            records.append(json.loads(line.split("] ", 1)[1]))
    artifacts = {r["artifact"]["name"]: r for r in records if "artifact" in r}
    for name in ("socompile_plan", "socompile_plan_table", "socompile_pass_insert_optimizer_steps_before",
                 "socompile_pass_insert_optimizer_steps_after"):
        assert name in artifacts, sorted(artifacts)
        assert artifacts[name]["frame_id"] == 0   # attached to the compile that made it
    assert artifacts["socompile_plan"]["artifact"]["encoding"] == "json"
    # Compile phases appear as timed (chromium) events in the trace, next to torch's own.
    text = logs[0].read_text()
    for phase in ("capture", "plan", "passes"):
        assert f'"name": "socompile.{phase}"' in text
    if shutil.which("tlparse") or os.path.exists(os.path.join(os.path.dirname(sys.executable), "tlparse")):
        exe = shutil.which("tlparse") or os.path.join(os.path.dirname(sys.executable), "tlparse")
        parsed = subprocess.run([exe, str(logs[0]), "-o", str(tmp_path / "tl"), "--no-browser"],
                                capture_output=True, text=True, timeout=120)
        assert parsed.returncode == 0, parsed.stderr[-2000:]
        names = {p.name for p in (tmp_path / "tl").rglob("socompile_*")}
        assert any(n.startswith("socompile_plan_") and n.endswith(".json") for n in names), names
        assert any(n.startswith("socompile_pass_insert_optimizer_steps_after") for n in names), names


def test_torch_logs_plus_socompile_enables_debug_logs():
    out = _run({"TORCH_LOGS": "+socompile"})
    assert "socompile: planned" in out.stderr


def test_socompile_logs_are_quiet_by_default():
    out = _run({})
    assert "socompile: planned" not in out.stderr


def test_socompile_is_a_registered_torch_log_name_and_set_logs_controls_it():
    from torch._logging._internal import log_registry
    assert log_registry.is_log("socompile")
    logger = logging.getLogger("socompile")
    try:
        torch._logging.set_logs(modules={"socompile": logging.DEBUG})
        assert logger.getEffectiveLevel() == logging.DEBUG
    finally:
        torch._logging.set_logs()
    assert logger.getEffectiveLevel() > logging.DEBUG


def test_importing_socompile_leaves_torchs_other_loggers_alone():
    script = textwrap.dedent("""
        import logging, torch
        from torch._logging._internal import log_registry
        def snapshot():
            names = sorted(log_registry.get_log_qnames())
            return names, {n: (logging.getLogger(n).level, len(logging.getLogger(n).handlers)) for n in names}
        names, before = snapshot()
        import socompile
        names_after, after = snapshot()
        assert set(names_after) - set(names) == {"socompile"}, set(names_after) ^ set(names)
        assert {n: after[n] for n in names} == before
        print("OK")
    """)
    assert _run({}, script).stdout.strip() == "OK"


def test_compile_phases_are_in_torchs_compile_time_breakdown():
    from socompile.models import build
    from training_helpers import run_pair
    torch._dynamo.utils.compilation_time_metrics.clear()
    run_pair(lambda: build("tiny", n_layers=1), steps=1)
    table = torch._dynamo.utils.compile_times(repr="str")
    for name in ("socompile.capture", "socompile.plan", "socompile.passes"):
        assert torch._dynamo.utils.compilation_time_metrics.get(name), name
        assert name in table
