"""Every row of docs/errors.md triggers its error (rows whose test lives elsewhere name that test)."""
import copy
import logging

import pytest
import torch
from torch import nn

import socompile
from socompile.models import build
from socompile.plan.planner import PlanError
from training_helpers import batches, lm_loss


def _backend(**options):
    return socompile.SuperOffload({"compute": "eager", "gpu_buckets": 0, **options})


class Broken(nn.Module):
    """A graph break between two layers; ``share`` also uses the first layer's weight after the break."""

    def __init__(self, share: bool = False):
        super().__init__()
        self.a, self.b, self.share = nn.Linear(8, 8), nn.Linear(8, 8), share

    def forward(self, x):
        h = torch.relu(self.a(x))
        torch._dynamo.graph_break()   # the break the error must point at
        h = self.b(h)
        return self.a(h) if self.share else h


def test_graph_break_warns_with_the_source_line_and_advises_fullgraph(caplog):
    model = Broken()
    opt = socompile.AdamW(model.parameters())
    with caplog.at_level(logging.WARNING, logger="socompile"):
        cmodel = torch.compile(model, backend=_backend())
        cmodel(torch.randn(4, 8)).sum().backward()
        opt.step()
    assert "graph break inside the compiled region" in caplog.text
    assert "test_errors.py:" in caplog.text and "torch._dynamo.graph_break()" in caplog.text
    assert "fullgraph=True" in caplog.text
    assert caplog.text.count("graph break inside") == 1   # once, not once per piece


def test_graph_break_is_an_error_when_asked():
    model = Broken()
    cmodel = torch.compile(model, backend=_backend(on_graph_break="error"))
    with pytest.raises(Exception, match=r"graph break inside the compiled region at .*test_errors.py"):
        cmodel(torch.randn(4, 8))


def test_parameter_used_on_both_sides_of_a_graph_break_is_an_error():
    model = Broken(share=True)
    opt = socompile.AdamW(model.parameters())
    cmodel = torch.compile(model, backend=_backend(on_graph_break="ignore"))
    with pytest.raises(RuntimeError, match="used by two different compiled graphs.*fullgraph=True"):
        cmodel(torch.randn(4, 8)).sum().backward()
    del opt


def test_recompile_storm_is_detected_and_advises_dynamic(caplog):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = socompile.AdamW(model.parameters())
    cmodel = torch.compile(model, backend=_backend(recompile_warn_after=2), dynamic=False)
    with caplog.at_level(logging.WARNING, logger="socompile"):
        for n in range(2, 6):   # a new batch size every step, static shapes: a recompile each time
            cmodel(torch.randn(n, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert caplog.text.count("recompile storm") == 1
    assert "compiled 3 times" in caplog.text
    assert "dynamic=True" in caplog.text and "mark_dynamic" in caplog.text


def test_infeasible_memory_budget_names_the_minimum_and_the_fix():
    model = build("tiny", n_layers=1)
    opt = socompile.AdamW(model.parameters())
    cmodel = torch.compile(model, backend=_backend(device_memory_budget="1KB"))
    x, y = batches(1)[0]
    # Planned when the forward is compiled (weight flow rewrites both graphs), so Dynamo wraps the PlanError.
    # Sizes in units that show them (a 1 KB budget, a minimum in MB), not "0.00 GB".
    with pytest.raises(Exception, match=r"no plan fits in 1\.0 KB of device memory.*needs at least [0-9.]+ MB .*"
                                        r"raise device_memory_budget to at least [0-9.]+ MB") as info:
        lm_loss(cmodel(x), y).backward()
    assert isinstance(info.value, PlanError) or isinstance(info.value.__cause__ or info.value.inner_exception,
                                                            PlanError)
    del opt


def test_optimizer_over_other_parameters_than_the_compiled_model_is_reported(caplog):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    opt = socompile.AdamW(model.parameters())
    copied = copy.deepcopy(model)   # the optimizer holds the original's parameters, not these
    with caplog.at_level(logging.WARNING, logger="socompile"):
        torch.compile(copied, backend=_backend())(torch.randn(2, 8)).sum().backward()
    assert "4 of 4 parameter(s) have no socompile optimizer" in caplog.text
    assert "copy.deepcopy" in caplog.text and "Build the optimizer from the parameters" in caplog.text
    del opt


def test_step_without_any_gradient_warns_once_naming_the_likely_cause(caplog):
    model = nn.Linear(8, 1)
    opt = socompile.AdamW(model.parameters())
    copied = copy.deepcopy(model)
    copied(torch.randn(2, 8)).sum().backward()   # gradients land on the copy, not on opt's parameters
    with caplog.at_level(logging.WARNING, logger="socompile"):
        opt.step()
        opt.step()
    assert caplog.text.count("none of its 2 parameter(s) has a gradient") == 1
    assert "Build the optimizer from the trained model's parameters" in caplog.text


def test_optimizer_whose_parameters_a_newer_one_took_over_refuses_use():
    # A second socompile.AdamW over a parameter takes it over (tests/test_multi_model.py trains with it); the
    # first one must say so wherever it is used again: step, zero_grad, or a backward whose forward ran before.
    model = nn.Linear(4, 4)
    first = socompile.AdamW(model.parameters())
    cmodel = torch.compile(model, backend=_backend())
    loss = cmodel(torch.randn(2, 4)).sum()   # its backward graph was compiled for ``first``
    socompile.AdamW([model.weight])
    cause = "parameters were taken over by a newer socompile.AdamW.*Use the new optimizer"
    for use in (first.step, first.zero_grad, loss.backward):
        with pytest.raises(RuntimeError, match=cause):
            use()


def test_two_socompile_optimizers_in_one_graph_is_an_error():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    first, second = socompile.AdamW(model[0].parameters()), socompile.AdamW(model[1].parameters())
    cmodel = torch.compile(model, backend=_backend())
    with pytest.raises(Exception, match="several socompile optimizers.*parameter groups"):
        cmodel(torch.randn(2, 4))
    del first, second


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameters_get_a_separate_master_but_shared_mode_is_refused_with_the_fix(dtype):
    # Accepted by default: a separate fp32 host master (tests/test_device_mirror.py trains such models).
    assert all(b.mirror for b in socompile.AdamW(nn.Linear(4, 4).to(dtype).parameters()).buckets)
    # Asked to alias the fp32 master, they cannot: the error names the option that works.
    with pytest.raises(TypeError, match=r"needs fp32 CPU parameters.*Use host_master='auto'"):
        socompile.AdamW(nn.Linear(4, 4).to(dtype).parameters(), host_master="shared")


@pytest.mark.parametrize("backend", ["superoffload", "object"])
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graphs_mode_is_refused(backend, mode):
    # The object form used to take mode=... silently (its __call__ swallowed keywords).
    backend = socompile.SuperOffload(compute="eager") if backend == "object" else backend
    cmodel = torch.compile(nn.Linear(4, 4), backend=backend, mode=mode)
    with pytest.raises(Exception, match="CUDA graphs.*cannot replay host-side optimizer steps"):
        cmodel(torch.randn(2, 4))


def test_options_given_to_torch_compile_beside_a_backend_object_are_refused_not_dropped():
    cmodel = torch.compile(nn.Linear(4, 4), backend=socompile.SuperOffload(compute="eager"),
                           options={"bucket_size": "1MB"})
    with pytest.raises(Exception, match=r"its options are the object's own.*SuperOffload\(options\)"):
        cmodel(torch.randn(2, 4))


def test_bad_on_graph_break_value_is_an_option_error():
    with pytest.raises(socompile.OptionError, match="on_graph_break must be 'warn', 'error' or 'ignore'"):
        socompile.Options.resolve({"on_graph_break": "explode"})


def test_non_contiguous_parameter_is_supported_and_matches_torch():
    # Not an error: the bucket stores the parameter contiguously; values, shape and training are unchanged.
    torch.manual_seed(0)
    weight = torch.randn(8, 6).t()
    assert not weight.is_contiguous()
    mine, ref = nn.Parameter(weight.clone()), nn.Parameter(weight.clone())
    opt = socompile.AdamW([mine], lr=1e-2)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2)
    torch.testing.assert_close(mine.detach(), weight, atol=0, rtol=0)
    for _ in range(3):
        for p, o in ((mine, opt), (ref, ref_opt)):
            (p.sin() * torch.arange(48.0).view(6, 8)).sum().backward()
            o.step()
            o.zero_grad()
    torch.testing.assert_close(mine.detach(), ref.detach(), atol=1e-6, rtol=0)


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    """Run ``python -m socompile <argv>`` in this process: (exit status, stderr). argparse exits by SystemExit."""
    from socompile import cli
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [(["plan", "--model", "tiny", "--seq", "-1"], "--seq"),
                                        (["plan", "--model", "tiny", "--batch", "0"], "--batch"),
                                        (["demo", "--steps", "-1"], "--steps"),
                                        (["dump", "--seq", "0"], "--seq"),
                                        (["plan", "--model", "tiny", "--dp", "0"], "--dp")])
def test_cli_out_of_range_argument_is_a_usage_error_without_traceback(argv, flag, capsys):
    code, err = _cli(argv, capsys)
    assert code == 2 and "Traceback" not in err, err
    assert f"argument {flag}: must be >= 1" in err.splitlines()[-1], err


def test_cli_bad_option_value_is_one_line_and_exit_2(capsys):
    code, err = _cli(["plan", "--model", "tiny", "--seq", "32", "--bucket-size", "lots"], capsys)
    assert code == 2 and "Traceback" not in err, err
    assert err.strip() == "socompile plan: bucket_size: cannot read 'lots' as a size; write e.g. '64MB', '2GiB' " \
                          "or 67108864", err


def test_cli_unwritable_output_names_the_path_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    for argv, flag in ((["dump", "--out", str(blocker / "dumps")], "--out"),
                       (["plan", "--model", "tiny", "--seq", "32", "--json", str(blocker / "plan.json")], "--json")):
        code, err = _cli(argv, capsys)
        assert code not in (0, None) and "Traceback" not in err, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and f"{flag} {blocker}" in lines[0] and "Not a directory" in lines[0], err
        assert "pass a" in lines[0]   # the fix
    assert blocker.read_text() == "not a folder"


def test_cli_error_from_a_fresh_interpreter_has_no_traceback(tmp_path):
    import os
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "a_file").write_text("")
    out_dir = tmp_path / "a_file" / "dumps"   # like /proc/forbidden: a folder that cannot be made (root too)
    out = subprocess.run([sys.executable, "-m", "socompile", "dump", "--out", str(out_dir)],
                         capture_output=True, text=True, timeout=120, cwd=repo, env={**os.environ, "PYTHONPATH": repo})
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith(f"socompile dump: --out {out_dir}: cannot write files into this folder"), out.stderr


def test_every_row_of_docs_errors_md_names_tests_that_exist():
    import ast
    import pathlib
    import re
    repo = pathlib.Path(__file__).resolve().parent.parent
    rows = [line for line in (repo / "docs" / "errors.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith(("| symptom", "| ---"))]
    assert len(rows) >= 15
    for row in rows:
        refs, current = [], None
        for path, name in re.findall(r"`(tests/[\w/]+\.py)?::(\w+)`", row.split(" | ")[-1]):
            current = path or current
            refs.append((current, name))
        assert refs, f"row without a test: {row[:80]}"
        for path, name in refs:
            tree = ast.parse((repo / path).read_text())
            assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, (path, name)
