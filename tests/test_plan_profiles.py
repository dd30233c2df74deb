import dataclasses
import json

import pytest

from socompile.calibrate import calibrate
from socompile.hardware import PROFILES, get_profile, load_profile, save_profile


def test_shipped_profiles_have_positive_numbers_and_a_source():
    for name, hw in PROFILES.items():
        assert hw.name == name
        assert hw.device_memory > 0 and hw.link_bandwidth > 0 and hw.cpu_adam_params_per_s > 0
        assert hw.source


def test_gh200_link_is_c2c_as_measured_per_direction_and_cpu_adam_the_measured_share_of_500_gb():
    from socompile.hardware.cpu_adam import MEASURED
    hw = PROFILES["gh200"]
    # nvbandwidth on GH200 (Megatron-LM issue 6491): ~411-421 GB/s host-to-device, ~170 device-to-host; the
    # datasheet's 450 each way holds for one direction at a time only
    assert hw.h2d_bandwidth == 415e9 and hw.d2h_bandwidth == 170e9
    assert "nvbandwidth" in hw.source
    assert hw.adam_bandwidth == pytest.approx(MEASURED.ours_of_ceiling * 500e9)   # not the blog's 368 GB/s


def test_user_profile_loads_from_toml(tmp_path):
    path = tmp_path / "box.toml"
    path.write_text('[profile]\nname = "box"\ndevice_memory = 24e9\ndevice_bandwidth = 1e12\n'
                    'device_bf16_flops = 1e14\nhost_memory = 64e9\nhost_bandwidth = 5e10\nhost_cores = 8\n'
                    'link_bandwidth = 2.5e10\nlink_latency = 1e-5\n')
    hw = get_profile(str(path))
    assert hw.name == "box" and hw.device_memory == 24 * 10**9 and hw.host_cores == 8


def test_user_profile_round_trips_through_json(tmp_path):
    path = save_profile(PROFILES["h100-pcie"], tmp_path / "h.json")
    assert load_profile(path) == PROFILES["h100-pcie"]


def test_unknown_profile_key_is_rejected_with_the_closest_name(tmp_path):
    data = PROFILES["gh200"].to_dict()
    data["link_bandwith"] = data.pop("link_bandwidth")
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="link_bandwidth"):
        load_profile(path)


def test_unknown_target_names_the_known_ones():
    with pytest.raises(ValueError, match="gh200"):
        get_profile("gh2000")


@pytest.fixture(scope="module")
def calibrated():
    """One quick calibration of this machine for the tests that read it (~20-30 s each on 2 cores)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as bench/sim_vs_real.py calibrates: OpenMP kernels on cores the other test
    try:                       # process also runs on take many times longer
        return calibrate(quick=True)
    finally:
        torch.set_num_threads(threads)


def test_calibrate_measures_this_machine_and_writes_a_loadable_profile(calibrated, tmp_path):
    import torch
    hw = calibrated
    assert hw.host_bandwidth > 1e8 and hw.cpu_adam_bandwidth > 1e8 and hw.link_bandwidth > 1e8
    assert "measured" in hw.source
    assert load_profile(save_profile(hw, tmp_path / "me.json")) == hw
    if not torch.cuda.is_available():   # a CPU "device": the kernels one FLOP rate and bandwidth do not describe
        kinds = {(r.kernel, r.dtype) for r in hw.device_kernel_rates if r.rate > 0}
        assert {(k, d) for k in ("matmul", "attention", "attention_backward", "elementwise")
                for d in ("torch.float32", "torch.bfloat16")} <= kinds


def test_calibrate_measures_the_runtimes_work_and_the_elementwise_families_on_a_cpu_device(calibrated):
    """The terms the simulator charges a CPU "device" beyond its kernels' bytes and FLOPs: the runtime's work
    per bucket, per gradient tensor and per flow fetch, elements/s per elementwise family and dtype, and the
    matmuls of a linear layer's step at the squares and at the tall shapes of the same FLOPs."""
    import torch

    from socompile.calibrate import MATMUL_SIDES
    if torch.cuda.is_available():
        pytest.skip("a GPU's profile charges none of these (launches and the runtime's work are hidden)")
    hw = calibrated
    for dtype in ("torch.float32", "torch.bfloat16"):
        shapes = {r.shape for r in hw.device_kernel_rates if r.kernel == "matmul" and r.dtype == dtype and r.rate > 0}
        assert {(s, s) for s in MATMUL_SIDES} < shapes and any(hi >= 8 * lo for lo, hi in shapes), shapes
    # > 0: each is Python work of at least one call (microseconds); a broken measurement clamps to 0
    assert hw.cpu_bucket_overhead > 0 and hw.cpu_grad_overhead > 0 and hw.weight_fetch_overhead > 0
    for family in ("binary", "math", "reduction"):
        for dtype in ("torch.float32", "torch.bfloat16"):
            assert hw.elementwise_rate(family, dtype) > 0
    assert PROFILES["gh200"].elementwise_rate("binary", "torch.float32") is None
    assert PROFILES["gh200"].cpu_grad_overhead == PROFILES["gh200"].weight_fetch_overhead == 0


def test_target_this_machine_without_a_cached_profile_calibrates_on_real_tensors_and_caches_it(tmp_path,
                                                                                                monkeypatch):
    """The first compile for ``this-machine`` measures the machine from inside the compile, where AOTAutograd's
    fake mode is active: the measurement must still time real buffers, and be cached where
    ``python -m socompile calibrate`` caches it (SOCOMPILE_PROFILE_DIR points that cache at tmp_path)."""
    import torch

    import socompile
    from socompile.hardware.profiles import THIS_MACHINE, profile_cache_path
    monkeypatch.setenv("SOCOMPILE_PROFILE_DIR", str(tmp_path))
    assert not profile_cache_path().exists()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt = socompile.AdamW(model.parameters(), lr=1e-3)
    backend = socompile.SuperOffload({"compute": "eager", "gpu_buckets": 0, "target": THIS_MACHINE})
    torch.compile(model, backend=backend)(torch.randn(2, 8)).sum().backward()
    opt.step()
    assert backend.compiled[0].plan.target == THIS_MACHINE
    cached = load_profile(profile_cache_path())
    assert cached.name == THIS_MACHINE and "measured by socompile calibrate (quick" in cached.source
    assert cached.host_bandwidth > 1e8 and cached.cpu_adam_bandwidth > 1e8
    assert get_profile(THIS_MACHINE) == cached   # later compiles read the cache


def test_reading_this_machine_with_no_cached_profile_names_the_command_that_measures_it(tmp_path, monkeypatch):
    """The hardware layer only reads the cache (measuring needs the runtime, a layer above): with none cached,
    ``get_profile`` says where it looked and how to measure, instead of planning for a made-up machine."""
    from socompile.hardware.profiles import THIS_MACHINE
    monkeypatch.setenv("SOCOMPILE_PROFILE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=r"no measured profile of this machine at .*python -m socompile calibrate"):
        get_profile(THIS_MACHINE)


def test_interconnect_numbers_and_which_fabric_a_group_uses():
    hw = PROFILES["gh200"]
    assert hw.inter_node_bandwidth == 400e9 / 8           # NDR 400 Gb/s per Superchip, per direction
    assert hw.intra_node_bandwidth == 450e9               # NVLink 4: 900 GB/s bidirectional per GPU
    assert hw.group_bandwidth(8) == hw.inter_node_bandwidth          # one GH200 per node: the NIC
    import dataclasses
    nvl = dataclasses.replace(hw, gpus_per_node=8)
    assert nvl.group_bandwidth(8) == 450e9 and nvl.group_bandwidth(16) == hw.inter_node_bandwidth
    assert nvl.group_bandwidth(2, stride=8) == hw.inter_node_bandwidth   # dp peers 8 ranks apart: other nodes
    for name, p in PROFILES.items():
        assert p.gpus_per_node >= 1 and p.intra_node_bandwidth > 0 and p.inter_node_bandwidth > 0, name


def test_measured_kernel_rates_round_trip_through_a_profile_file_and_bad_entries_are_named(tmp_path):
    from socompile.hardware.profiles import KernelRate
    hw = dataclasses.replace(PROFILES["gh200"], device_kernel_rates=(
        KernelRate("attention_backward", "torch.bfloat16", 8e9, (128, 32)),
        KernelRate("elementwise", "torch.float32", 9e10)))
    assert load_profile(save_profile(hw, tmp_path / "rates.json")) == hw
    data = json.loads((tmp_path / "rates.json").read_text())
    data["device_kernel_rates"] = [{"kernel": "matmul", "rate": 1e11}]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="device_kernel_rates entry .* kernel, dtype, rate"):
        load_profile(tmp_path / "bad.json")


def test_calibration_streams_from_memory_past_the_last_level_cache(tmp_path):
    """Two CPUs with their own L2 sharing one L3, and two more on a second L3: the last level counts each
    distinct cache once, and calibration's working sets are at least 4x it (a quick calibration's 64 MB fitted
    in a 16-core server's caches and measured CPU Adam at cache speed)."""
    from socompile import calibrate as cal

    def cache(cpu, index, level, size, shared):
        d = tmp_path / f"cpu{cpu}" / "cache" / f"index{index}"
        d.mkdir(parents=True)
        for name, value in (("level", level), ("size", size), ("shared_cpu_list", shared)):
            (d / name).write_text(f"{value}\n")

    for cpu in range(4):
        cache(cpu, 2, 2, "1024K", str(cpu))
        cache(cpu, 3, 3, "32768K", "0-1" if cpu < 2 else "2-3")
    assert cal.last_level_cache_bytes(str(tmp_path)) == 2 * 32 * 2**20
    assert cal.last_level_cache_bytes(str(tmp_path / "missing")) == 0
    assert cal.streaming_bytes(64 * 2**20) >= max(64 * 2**20, 4 * cal.last_level_cache_bytes())
