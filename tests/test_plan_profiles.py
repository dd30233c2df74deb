import json

import pytest

from socompile.hardware.calibrate import calibrate
from socompile.hardware import PROFILES, get_profile, load_profile, save_profile


def test_shipped_profiles_have_positive_numbers_and_a_source():
    for name, hw in PROFILES.items():
        assert hw.name == name
        assert hw.device_memory > 0 and hw.link_bandwidth > 0 and hw.cpu_adam_params_per_s > 0
        assert hw.source


def test_gh200_link_is_c2c_450_gb_per_direction_and_cpu_adam_the_measured_share_of_500_gb():
    from socompile.hardware.cpu_adam import MEASURED
    hw = PROFILES["gh200"]
    assert hw.link_bandwidth == 450e9
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


def test_calibrate_measures_this_machine_and_writes_a_loadable_profile(tmp_path):
    hw = calibrate(quick=True)
    assert hw.host_bandwidth > 1e8 and hw.cpu_adam_bandwidth > 1e8 and hw.link_bandwidth > 1e8
    assert "measured" in hw.source
    assert load_profile(save_profile(hw, tmp_path / "me.json")) == hw


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
