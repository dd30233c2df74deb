"""The backend's surface: entry point, options, errors, custom ops, events, plan report, optimizer API."""
import json
import logging
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import socompile
from socompile.models import build
from socompile.options import OptionError, Options
from training_helpers import assert_same_params, batches, lm_loss, run_pair

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_backend_is_found_by_name_in_a_fresh_interpreter_without_importing_socompile():
    script = textwrap.dedent("""
        import sys, torch
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        cmodel = torch.compile(model, backend="superoffload", options={"compute": "eager"})
        cmodel(torch.randn(4, 8)).sum().backward()
        assert "socompile" in sys.modules  # loaded by Dynamo through the entry point, not by us
        assert all(p.grad is not None for p in model.parameters())  # no socompile optimizer: plain .grad
        print("OK")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("OK")


def test_unknown_option_names_the_closest_valid_one():
    with pytest.raises(OptionError, match="did you mean 'bucket_size'"):
        Options.resolve({"bucket_sise": "1MB"})


def test_unknown_option_through_torch_compile_fails_at_compile_time():
    model = nn.Linear(4, 4)
    cmodel = torch.compile(model, backend="superoffload", options={"trget": "gh200"})
    with pytest.raises(Exception, match="did you mean 'target'"):
        cmodel(torch.randn(2, 4))


def test_wrong_option_type_is_rejected_with_the_expected_type():
    with pytest.raises(OptionError, match="'gpu_buckets' must be int or NoneType"):
        Options.resolve({"gpu_buckets": "two"})
    with pytest.raises(OptionError, match="cannot read 'lots' as a size"):
        Options.resolve({"bucket_size": "lots"})


def test_options_come_from_socompile_environment_variables():
    opts = Options.resolve({"compute": "eager"}, environ={"SOCOMPILE_BUCKET_SIZE": "2MB",
                                                           "SOCOMPILE_SPECULATE": "false",
                                                           "SOCOMPILE_TARGET": "h100-pcie"})
    assert (opts.bucket_size, opts.speculate, opts.target, opts.compute) == (2_000_000, False, "h100-pcie", "eager")


def test_misspelt_socompile_environment_variable_is_an_error_naming_the_closest_option(monkeypatch):
    # Every source of options is validated alike: dict, keyword arguments and SOCOMPILE_* variables.
    with pytest.raises(OptionError, match="SOCOMPILE_BUCKET_SISE .*did you mean SOCOMPILE_BUCKET_SIZE"):
        Options.resolve({}, environ={"SOCOMPILE_BUCKET_SISE": "1MB"})
    with pytest.raises(OptionError, match="did you mean 'speculate'"):
        socompile.SuperOffload(compute="eager", speculte=False)
    monkeypatch.setenv("SOCOMPILE_SPECULTE", "false")
    with pytest.raises(OptionError, match="did you mean SOCOMPILE_SPECULATE"):
        socompile.SuperOffload(compute="eager")


def test_socompile_variables_read_by_other_parts_are_not_options():
    from socompile.options import NOT_OPTIONS
    environ = {name: "x" for name in NOT_OPTIONS}
    assert Options.resolve({}, environ={**environ, "SOCOMPILE_BUCKET_SIZE": "2MB"}).bucket_size == 2_000_000
    # The list names every SOCOMPILE_* variable the project reads that is not an option.
    read = set()
    for folder in ("socompile", "socompile_ext", "bench", "examples"):
        for path in pathlib.Path(REPO, folder).rglob("*.py"):
            read |= set(re.findall(r"""(?:environ\.get|getenv|environ\[)\(?["'](SOCOMPILE_[A-Z0-9_]+)""",
                                   path.read_text()))
    assert "SOCOMPILE_ISA" in read, "the scan must find the variables the project reads"
    options = {f"SOCOMPILE_{name.upper()}" for name in Options.__dataclass_fields__}
    assert read - options - set(NOT_OPTIONS) == set()


def test_optimizer_threads_sets_the_kernel_threads_for_this_models_buckets_only(monkeypatch):
    import socompile_ext
    default = socompile_ext.get_num_threads()
    pinned = default + 1          # differs from the default on any machine (OpenMP may run more threads than cores)
    seen = []                     # (model, thread count the kernel reads) at each CPU Adam step

    def spy(*args, **kwargs):
        seen.append((current, socompile_ext.get_num_threads()))
        return real_step(*args, **kwargs)

    real_step = socompile_ext.adam_step
    monkeypatch.setattr(socompile_ext, "adam_step", spy)
    torch.manual_seed(0)
    models = {"pinned": nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), "default": nn.Linear(8, 2)}
    threads = {"pinned": pinned, "default": None}
    for current, model in models.items():
        opt = socompile.AdamW(model.parameters(), lr=1e-2)
        cmodel = torch.compile(model, backend=socompile.SuperOffload(compute="eager", gpu_buckets=0,
                                                                     optimizer_threads=threads[current]))
        for _ in range(2):
            cmodel(torch.randn(4, 8)).square().sum().backward()
            opt.step()
            opt.zero_grad()
    assert {n for m, n in seen if m == "pinned"} == {pinned}, seen
    assert {n for m, n in seen if m == "default"} == {default}, seen
    assert socompile_ext.get_num_threads() == default   # restored: the setting is process-wide
    with pytest.raises(OptionError, match="optimizer_threads must be >= 1"):
        Options.resolve({"optimizer_threads": 0})


def test_model_without_parameters_gets_a_clear_error():
    cmodel = torch.compile(nn.ReLU(), backend="superoffload")
    with pytest.raises(Exception, match="has no parameters"):
        cmodel(torch.randn(3, requires_grad=True))


def test_parameters_without_socompile_optimizer_keep_grad_and_warn(caplog):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    reference = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="socompile"):
        cmodel = torch.compile(model, backend="superoffload", options={"compute": "eager"})
        cmodel(torch.randn(4, 8)).sum().backward()
    assert "have no socompile optimizer and keep ordinary .grad" in caplog.text
    assert all(p.grad is not None for p in model.parameters())
    reference.step()  # any torch optimizer still works


def test_inserted_optimizer_nodes_are_socompile_custom_ops_with_provenance_and_survive_dce():
    backend = socompile.SuperOffload(compute="eager", bucket_size="256KB")
    _, _, backend, _ = run_pair(lambda: build("tiny", n_layers=1), steps=1, options=backend.options.to_dict())
    bw = backend.compiled[0].backward_graph
    nodes = [n for n in bw.graph.nodes if n.target is torch.ops.socompile.bucket_grads_ready.default]
    assert len(nodes) == len(backend.compiled[0].plan.buckets) > 1
    for node in nodes:
        assert node.meta["socompile"]["pass"] == "insert_optimizer_steps"
        assert "bucket" in node.meta["socompile"]["why"]
        assert node.meta["stack_trace"]  # points back at user code
    bw.graph.eliminate_dead_code()
    assert sum(n.target is torch.ops.socompile.bucket_grads_ready.default for n in bw.graph.nodes) == len(nodes)


def test_late_buckets_step_before_backward_reaches_the_first_layers():
    # gpu_buckets=0: every bucket is a CPU bucket (a tiny model would otherwise fit on the device entirely).
    _, _, backend, opt = run_pair(lambda: build("tiny", n_layers=4), steps=2,
                                  options={"bucket_size": "256KB", "gpu_buckets": 0},
                                  socompile_kwargs={"cpu_worker": "thread"})
    plan = backend.compiled[0].plan
    last = plan.buckets[-1].index  # holds the embedding: its gradients come last in backward
    assert last >= 2
    events = opt.events.events()
    # Look at the second step (the first also compiles the backward graph).
    second = [e for e in events if e.kind == "commit"][0].t_ns
    step2 = [e for e in events if e.t_ns > second]
    first_step_start = next(e.t_ns for e in step2 if e.kind == "step_start" and e.bucket == 0)
    last_grads = next(e.t_ns for e in step2 if e.kind == "grads_ready" and e.bucket == last)
    assert first_step_start < last_grads
    assert next(e.thread for e in step2 if e.kind == "step_start").startswith("socompile-cpu-optimizer")


def test_inline_cpu_worker_steps_late_buckets_inside_backward_on_its_thread():
    _, _, backend, opt = run_pair(lambda: build("tiny", n_layers=4), steps=1,
                                  options={"bucket_size": "256KB", "gpu_buckets": 0},
                                  socompile_kwargs={"cpu_worker": "inline"})
    last = backend.compiled[0].plan.buckets[-1].index
    events = opt.events.events()
    first_step_start = next(e.t_ns for e in events if e.kind == "step_start" and e.bucket == 0)
    last_grads = next(e.t_ns for e in events if e.kind == "grads_ready" and e.bucket == last)
    assert first_step_start < last_grads
    assert not any(e.thread.startswith("socompile-cpu-optimizer") for e in events)


def test_disabled_pass_keeps_gradients_in_grad_and_steps_in_opt_step():
    # cast_gradients requires the optimizer-step nodes (passes/table.py): both are turned off
    ours, ref, backend, opt = run_pair(lambda: build("tiny", n_layers=1), steps=3,
                                       options={"disable_passes": ["insert_optimizer_steps", "cast_gradients"]})
    assert backend.compiled[0].dumps == []
    assert not any(e.kind == "grads_ready" for e in opt.events.events())
    assert_same_params(ours, ref)


def test_unknown_pass_name_in_disable_passes_is_an_error():
    with pytest.raises(OptionError, match="unknown passes.*insert_optimizer_steps"):
        socompile.SuperOffload(disable_passes=["insert_prefetch_x"])


def test_socompile_adamw_without_compile_matches_torch_adamw():
    torch.manual_seed(0)
    model, ref = build("tiny", n_layers=1), build("tiny", n_layers=1)
    ref.load_state_dict(model.state_dict())
    opt = socompile.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, bucket_size="128KB")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    for x, y in batches(5):
        for m, o in ((model, opt), (ref, ref_opt)):
            lm_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    assert_same_params(model, ref)


def test_clipping_matches_clip_grad_norm_then_adamw():
    # The global norm is summed in double by the kernel and in fp32 by torch: the clip coefficients agree to
    # ~1e-7 relative, which moves parameters by far less than 1e-6 over 10 steps.
    ours, ref, _, opt = run_pair(lambda: build("tiny", n_layers=1), clip=0.05)
    assert opt.last_grad_norm > 0.05  # clipping really happened
    assert_same_params(ours, ref)


def test_second_backward_without_step_is_an_error_naming_the_fix():
    model = build("tiny", n_layers=1)
    opt = socompile.AdamW(model.parameters())
    cmodel = torch.compile(model, backend=socompile.SuperOffload(compute="eager", gpu_buckets=0))
    x, y = batches(1)[0]
    lm_loss(cmodel(x), y).backward()
    with pytest.raises(RuntimeError, match="grad_accumulation_steps"):
        lm_loss(cmodel(x), y).backward()
    del opt


def test_state_dict_has_torch_adamw_layout_and_loads_into_torch():
    ours, ref, _, opt = run_pair(lambda: build("tiny", n_layers=1), steps=3)
    mine = opt.state_dict()
    torch_opt = torch.optim.AdamW(ours.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    reference = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    assert set(mine["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert mine["state"][0]["step"].item() == 3.0
    torch_opt.load_state_dict(mine)  # plain torch accepts it
    assert torch_opt.state_dict()["param_groups"][0]["params"] == mine["param_groups"][0]["params"]
    del reference


def test_plan_command_prints_a_bucket_table_and_json(tmp_path):
    out = subprocess.run([sys.executable, "-m", "socompile", "plan", "--model", "tiny", "--seq", "32",
                          "--json", str(tmp_path / "plan.json")], capture_output=True, text=True, timeout=300,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "bucket" in out.stdout and ("cpu" in out.stdout or "device" in out.stdout)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["buckets"] and plan["buckets"][0]["optimizer_site"] in ("cpu", "device")


def test_dump_command_writes_graphs_before_and_after_the_optimizer_pass(tmp_path):
    out = subprocess.run([sys.executable, "-m", "socompile", "dump", "--model", "tiny", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    after = next(tmp_path.glob("*insert_optimizer_steps_after.py")).read_text()
    before = next(tmp_path.glob("*insert_optimizer_steps_before.py")).read_text()
    assert "socompile.bucket_grads_ready" in after and "socompile.bucket_grads_ready" not in before
    assert next(tmp_path.glob("*_after.dot")).read_text().startswith("digraph")


def test_dump_command_with_weight_flow_shows_prefetch_and_release_nodes(tmp_path):
    out = subprocess.run([sys.executable, "-m", "socompile", "dump", "--model", "tiny", "--weight-mode", "flow", "--gpu-buckets", "0",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    forward = next(tmp_path.glob("*_fw_*weight_flow*_after.py")).read_text()
    assert "socompile.prefetch" in forward and "socompile.release" in forward
