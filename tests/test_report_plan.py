import json
import pathlib
import shutil
import subprocess
import tempfile

import pytest

from test_plan_helpers import options, profile, traced
from socompile.plan.planner import plan_with_details
from socompile.perf.simulate import simulate
from socompile.report import plan_html, plan_json, plan_table

ARTIFACTS = pathlib.Path(__file__).resolve().parent.parent / "artifacts"


@pytest.fixture(scope="module")
def details():
    return plan_with_details(traced(bf16=True), profile(), options(gpu_buckets=2))


def test_table_collapses_identical_layers_into_one_row(details):
    text = plan_table(details.plan)
    assert "layers.1..3 x3" in text or "layers.0..3 x4" in text or "..3 x" in text
    assert "device peak" in text and "ZeRO-Offload" in text


def test_table_prints_the_link_traffic_the_plan_predicts_per_step(details):
    """One line: per direction, the bytes of the plan's transfer list (plan/transfers.py), as opt.traffic()
    counts them at run time."""
    from socompile.units import human_bytes
    line = next(x for x in plan_table(details.plan).splitlines() if x.startswith("link per step"))
    traffic = dict(details.plan.prediction("link_bytes_per_step"))
    d2h = sum(v for k, v in traffic.items() if k.startswith("d2h"))
    assert traffic["d2h bfloat16 gradients"] > 0 and f"d2h {human_bytes(d2h)} (gradients bfloat16" in line


def test_json_report_round_trips(details):
    data = json.loads(plan_json(details.plan))
    assert data["buckets"][0]["cast_reason"] and data["target"] == "gh200"


def test_html_report_is_self_contained_with_one_lane_per_resource(details):
    page = plan_html(details.plan, [details.simulation])
    assert "<svg" in page and "link host-&gt;device" in page and "CPU Adam" in page
    assert "src=" not in page and "<script" not in page


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name)
    try:
        subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], check=True, capture_output=True, timeout=900)
    except (OSError, subprocess.SubprocessError):
        return None
    return shutil.which("chromium")


def test_html_report_renders_in_headless_chromium(details):
    browser = _chromium()
    if browser is None:
        pytest.skip("chromium is not installed and apt-get install chromium failed (no root or no network)")
    ARTIFACTS.mkdir(exist_ok=True)
    sims = [details.simulation, details.zero_offload, simulate(details.plan, details.costs, details.cost,
                                                               "zero-infinity")]
    page = ARTIFACTS / "plan_report.html"
    page.write_text(plan_html(details.plan, sims, title="socompile plan: tiny on gh200"))
    shot = ARTIFACTS / "plan_report.png"
    shot.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as profile_dir:
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                        "--no-first-run", f"--user-data-dir={profile_dir}", f"--screenshot={shot}",
                        "--window-size=1200,1400", page.as_uri()], check=True, capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000


def test_cli_plans_a_parallel_job_with_an_activation_policy(capsys, tmp_path):
    from socompile.cli.plan_commands import cmd_plan
    out_json = tmp_path / "p.json"
    assert cmd_plan(["--model", "tiny", "--seq", "512", "--batch", "1", "--sp", "2", "--dp", "2", "--nodes", "1",
                     "--activations", "recompute", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "dp 2 x Ulysses sp 2 = 4 ranks on 1 node(s) of 4 GPU(s)" in text
    assert "all-to-all at 450 GB/s" in text and "Ulysses all-to-all" in text
    data = json.loads(out_json.read_text())
    assert {c for _, c in data["activations"]} == {"recompute"}
    pred = dict((k, v) for k, v in data["predicted"])
    assert pred["sp_degree"] == 2 and pred["dp_degree"] == 2 and pred["comm_ulysses_bytes"] > 0


@pytest.mark.parametrize("loss_in_graph", [False, True])
def test_a_graph_returning_logits_is_told_its_loss_outside_is_not_planned(loss_in_graph):
    """On an H200 a loss computed outside the compiled model peaked at 128% of the plan (docs/runtime.md): the
    plan names what the graph returns and the fix; a graph that returns its loss gets no such line."""
    import torch
    import socompile
    from socompile.models import WithLMLoss, build
    torch.manual_seed(0)
    model = build("tiny", n_layers=1)
    socompile.AdamW(model.parameters(), lr=1e-3)
    backend = socompile.SuperOffload(compute="eager")
    x = torch.randint(0, 256, (8, 128))   # logits 8 x 128 x 256 fp32: 1 MiB, the smallest that counts
    if loss_in_graph:
        torch.compile(WithLMLoss(model), backend=backend)(x, x).backward()
    else:
        torch.compile(model, backend=backend)(x).sum().backward()
    notes = [d for d in backend.compiled[0].plan.decisions if d.startswith("outputs:")]
    if loss_in_graph:
        assert notes == []
    else:
        assert len(notes) == 1 and "returns 1.0 MB" in notes[0] and "WithLMLoss" in notes[0], notes
