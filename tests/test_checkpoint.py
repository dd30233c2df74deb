"""Checkpoints: torch.optim.AdamW's layout, bitwise resume in the middle of a compiled run, moves between
socompile and plain PyTorch, and atomic saves that survive kill -9.

Tolerances. socompile -> socompile resumes are compared bitwise: the same kernel on the same values.
Steps taken by torch.optim.AdamW in between differ from the kernel's by ulps (torch's CPU sqrt is not
correctly rounded; see test_backend_training.py), so those runs are compared at atol 1e-6, while the
*transfer* itself (state dict out of one optimizer, into the other, and back) is checked bitwise.
"""
import errno
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import socompile
from socompile.models import build
from training_helpers import assert_same_params, batches, lm_loss

OPT = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _make(seed=0, **opt_kwargs):
    torch.manual_seed(seed)
    model = build("tiny", n_layers=1)
    opt = socompile.AdamW(model.parameters(), bucket_size="128KB", **OPT, **opt_kwargs)
    cmodel = torch.compile(model, backend=socompile.SuperOffload(compute="eager", gpu_buckets=0,
                                                                 bucket_size="128KB"))
    return model, opt, cmodel


def _train(cmodel, opt, data):
    for x, y in data:
        lm_loss(cmodel(x), y).backward()
        opt.step()
        opt.zero_grad()


def _assert_states_equal(a: dict, b: dict) -> None:
    assert a["state"].keys() == b["state"].keys()
    for index in a["state"]:
        assert a["state"][index].keys() == b["state"][index].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key in a["state"][index]:
            torch.testing.assert_close(a["state"][index][key], b["state"][index][key], atol=0, rtol=0,
                                       msg=lambda m: f"state[{index}][{key}]: {m}")


def test_state_dict_layout_is_torch_adamw_and_loads_with_weights_only(tmp_path):
    model, opt, cmodel = _make()
    _train(cmodel, opt, batches(2))
    ref_model = build("tiny", n_layers=1)
    ref = torch.optim.AdamW(ref_model.parameters(), **OPT)
    lm_loss(ref_model(batches(1)[0][0]), batches(1)[0][1]).backward()
    ref.step()
    mine, theirs = opt.state_dict(), ref.state_dict()
    assert [set(g) for g in mine["param_groups"]] == [set(g) for g in theirs["param_groups"]]
    assert mine["param_groups"][0]["decoupled_weight_decay"] is True
    assert mine["state"].keys() == theirs["state"].keys()
    for index, state in mine["state"].items():
        for key, value in state.items():
            other = theirs["state"][index][key]
            assert (value.dtype, value.shape) == (other.dtype, other.shape), (index, key)
        assert state["step"].item() == 2.0
    torch.save(mine, tmp_path / "opt.pt")
    loaded = torch.load(tmp_path / "opt.pt", weights_only=True)
    _assert_states_equal(loaded, mine)


# With max_grad_norm steps are validated: speculated into the ping-pong spare and swapped in at commit (norm
# below the limit), or rolled back and redone clipped; the state must be read from whichever copy is current.
@pytest.mark.parametrize("opt_kwargs", [{}, {"max_grad_norm": 1e6}, {"max_grad_norm": 0.05}],
                         ids=["plain", "validated", "clipped"])
def test_resume_mid_run_is_bitwise_identical(tmp_path, opt_kwargs):
    data = batches(6)
    model, opt, cmodel = _make(**opt_kwargs)
    _train(cmodel, opt, data[:3])
    socompile.save(tmp_path / "ckpt.pt", cmodel, opt, step=3, note="mid-run")
    _train(cmodel, opt, data[3:])

    torch._dynamo.reset()
    fresh, fresh_opt, fresh_c = _make(seed=1, **opt_kwargs)   # other initial values: everything must come from the file
    extra = socompile.load(tmp_path / "ckpt.pt", fresh_c, fresh_opt)
    assert extra == {"step": 3, "note": "mid-run"}
    _train(fresh_c, fresh_opt, data[3:])

    assert_same_params(fresh, model, atol=0, rtol=0)
    _assert_states_equal(fresh_opt.state_dict(), opt.state_dict())


def test_socompile_to_torch_to_socompile_round_trip():
    data = batches(9)
    model, opt, cmodel = _make()
    _train(cmodel, opt, data[:3])
    saved = torch.load(_roundtrip_bytes(opt.state_dict()), weights_only=True)  # detached from the buckets

    # Into plain PyTorch: the state arrives bitwise, and torch trains on from it.
    torch_opt = torch.optim.AdamW(model.parameters(), **OPT)
    torch_opt.load_state_dict(saved)
    _assert_states_equal(torch_opt.state_dict(), saved)
    _train(model, torch_opt, data[3:6])
    after_torch = torch.load(_roundtrip_bytes(torch_opt.state_dict()), weights_only=True)

    # Back into socompile (a new process would build a new model and optimizer): bitwise again, then train
    # compiled.
    torch._dynamo.reset()
    model2 = build("tiny", n_layers=1)
    model2.load_state_dict(model.state_dict())
    opt2 = socompile.AdamW(model2.parameters(), bucket_size="128KB", **OPT)
    opt2.load_state_dict(after_torch)
    _assert_states_equal(opt2.state_dict(), after_torch)
    cmodel2 = torch.compile(model2, backend=socompile.SuperOffload(compute="eager", gpu_buckets=0,
                                                                   bucket_size="128KB"))
    _train(cmodel2, opt2, data[6:])
    assert opt2.state_dict()["state"][0]["step"].item() == 9.0

    # The whole journey equals nine steps of eager torch.optim.AdamW (ulp-level kernel differences only).
    torch.manual_seed(0)
    ref = build("tiny", n_layers=1)
    ref_opt = torch.optim.AdamW(ref.parameters(), **OPT)
    _train(ref, ref_opt, data)
    assert_same_params(model2, ref)


def _roundtrip_bytes(obj):
    import io
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def test_torch_adamw_checkpoint_resumes_in_socompile_file(tmp_path):
    data = batches(4)
    torch.manual_seed(0)
    model = build("tiny", n_layers=1)
    torch_opt = torch.optim.AdamW(model.parameters(), **OPT)
    _train(model, torch_opt, data[:2])
    socompile.save(tmp_path / "ckpt.pt", model, torch_opt, epoch=0)
    fresh = build("tiny", n_layers=1)
    opt = socompile.AdamW(fresh.parameters(), **OPT)
    assert socompile.load(tmp_path / "ckpt.pt", fresh, opt) == {"epoch": 0}
    _assert_states_equal(opt.state_dict(), torch_opt.state_dict())
    assert_same_params(fresh, model, atol=0, rtol=0)


def test_loading_amsgrad_state_is_refused_with_the_reason():
    model = build("tiny", n_layers=1)
    torch_opt = torch.optim.AdamW(model.parameters(), amsgrad=True)
    opt = socompile.AdamW(build("tiny", n_layers=1).parameters())
    with pytest.raises(ValueError, match="amsgrad=True, which socompile.AdamW does not implement"):
        opt.load_state_dict(torch_opt.state_dict())


def test_load_refuses_a_file_that_is_not_a_socompile_checkpoint(tmp_path):
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a socompile checkpoint"):
        socompile.load(tmp_path / "other.pt", build("tiny", n_layers=1))


def test_failed_save_leaves_the_previous_file_and_no_temporary(tmp_path):
    model = build("tiny", n_layers=1)
    socompile.save(tmp_path / "ckpt.pt", model, tag="old")

    def boom():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        socompile.save(tmp_path / "ckpt.pt", model, tag="new", _before_rename=boom)
    assert socompile.load(tmp_path / "ckpt.pt", model) == {"tag": "old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


_CHILD = textwrap.dedent("""
    import sys, time, torch, socompile
    from socompile.models import build
    path, mode = sys.argv[1], sys.argv[2]
    model = build("tiny", n_layers=1)
    opt = socompile.AdamW(model.parameters())
    socompile.save(path, model, opt, generation=1)
    print("saved-1", flush=True)
    if mode == "before-rename":   # data written and fsync'ed, rename not done: killed here
        socompile.save(path, model, opt, generation=2,
                       _before_rename=lambda: (print("written-2", flush=True), time.sleep(120)))
    else:                         # killed while torch.save is still writing a large file
        big = torch.randn(64 * 2**20)   # 256 MB of extra payload
        print("writing-2", flush=True)
        while True:
            socompile.save(path, model, opt, generation=2, big=big)
""")


@pytest.mark.parametrize("mode", ["before-rename", "while-writing"])
def test_kill_9_during_save_leaves_the_previous_checkpoint_loadable(tmp_path, mode):
    path = tmp_path / "ckpt.pt"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path), mode], stdout=subprocess.PIPE,
                             text=True, cwd=REPO)
    try:
        assert child.stdout.readline().strip() == "saved-1"
        assert child.stdout.readline().strip() in ("written-2", "writing-2")
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".ckpt.pt.tmp-*")) and time.monotonic() < deadline:
            time.sleep(0.01)
        temps = list(tmp_path.glob(".ckpt.pt.tmp-*"))
        assert temps, "the child never started its second save"
        if mode == "while-writing":   # let it get some way into the file, not to the end
            while temps[0].exists() and temps[0].stat().st_size < 1_000_000 and time.monotonic() < deadline:
                time.sleep(0.005)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    model = build("tiny", n_layers=1)
    opt = socompile.AdamW(model.parameters())
    extra = socompile.load(path, model, opt)
    # The first save, or (while-writing: the kill may land after a complete rename) a complete second one.
    assert extra["generation"] == 1 or (mode == "while-writing" and extra["generation"] == 2)
    # The next save of the same name cleans up what the killed one left behind.
    socompile.save(path, model, opt, generation=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
    assert socompile.load(path)["generation"] == 3


# ---------------------------------------------------------------------------------------------- integrity
# A checkpoint proves it is the one that was written (a crc32 per tensor) and that its values
# can be right; every refusal names the file and the entry, and nothing is loaded when the file is refused.

def _trained(tmp_path, compiled=False):
    """A tiny model after two steps of socompile.AdamW (every parameter has a state; eager unless
    ``compiled``: a compile costs seconds, the buckets are the same), saved to ckpt.pt; -> (path, model, opt).
    Tests that need a wrong state set it in torch.optim.AdamW before the save instead, so the file is intact
    and its checksums match."""
    model, opt, cmodel = _make()
    _train(cmodel if compiled else model, opt, batches(2))
    path = tmp_path / "ckpt.pt"
    socompile.save(path, model, opt, step=2)
    return path, model, opt


def _index_of(model, name):
    return [n for n, _ in model.named_parameters()].index(name)


def _fresh():
    torch.manual_seed(7)   # not the trained model's seed: values loaded from the file are told apart
    model = build("tiny", n_layers=1)
    return model, socompile.AdamW(model.parameters(), bucket_size="128KB", **OPT)


def _assert_untouched(model, opt):
    """A refused load changed nothing: the fresh model keeps its initial values, the optimizer has no state."""
    torch.manual_seed(7)
    assert_same_params(model, build("tiny", n_layers=1), atol=0, rtol=0)
    assert opt.state_dict()["state"] == {}


def _assert_load_refused(path, error: type[Exception], match: str):
    """Loading ``path`` into a fresh model and optimizer raises ``error`` matching ``match`` and changes
    nothing; -> the fresh optimizer (for checks of its own load_state_dict)."""
    fresh, fresh_opt = _fresh()
    with pytest.raises(error, match=match):
        socompile.load(path, fresh, fresh_opt)
    _assert_untouched(fresh, fresh_opt)
    return fresh_opt


def _assert_loads_as_saved(load, path, model, opt):
    """``load`` (socompile.load, or a sharded checkpoint's load) of a file saved after two steps gives a fresh
    model and optimizer the step count, weights and optimizer state that were saved, bit for bit."""
    fresh, fresh_opt = _fresh()
    assert load(path, fresh, fresh_opt) == {"step": 2}
    assert_same_params(fresh, model, atol=0, rtol=0)
    _assert_states_equal(fresh_opt.state_dict(), opt.state_dict())


def _saved_with_wrong_state(tmp_path, corrupt):
    """A tiny model after one step of torch.optim.AdamW whose state ``corrupt(model, opt)`` sets wrong before
    the save (an intact file, checksums matching, wrong values); -> (path, model, opt)."""
    model, _ = _fresh()
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    _train(model, opt, batches(1))
    corrupt(model, opt)
    return socompile.save(tmp_path / "ckpt.pt", model, opt), model, opt


def _state_of(model, opt, name: str) -> dict:
    return opt.state[dict(model.named_parameters())[name]]


def test_flipped_byte_inside_tensor_data_is_refused_naming_the_entry(tmp_path):
    path, model, opt = _trained(tmp_path, compiled=True)
    index = _index_of(model, "layers.0.attn.wk.weight")
    moment = opt.state_dict()["state"][index]["exp_avg"].contiguous()
    raw = bytearray(path.read_bytes())
    start = raw.find(moment.numpy().tobytes())   # torch.save stores storages uncompressed: the bytes are there
    assert start > 0
    raw[start + moment.numel() * 2 + 1] ^= 0x10   # one bit in the middle of this tensor's data
    path.write_bytes(bytes(raw))
    _assert_load_refused(path, RuntimeError, rf"{path}.*optimizer\.state\[{index}\]\.exp_avg do not match the "
                                             r"checksum.*Load an earlier checkpoint")


def test_transposed_moment_is_refused_naming_the_entry_and_parameter(tmp_path):
    def transpose(model, opt):   # wk is (64, 128): transposed has the same numel
        state = _state_of(model, opt, "layers.0.attn.wk.weight")
        state["exp_avg"] = state["exp_avg"].t().contiguous()
    path, model, opt = _saved_with_wrong_state(tmp_path, transpose)
    index = _index_of(model, "layers.0.attn.wk.weight")
    fresh_opt = _assert_load_refused(path, ValueError, rf"{path}: state\[{index}\]\.exp_avg \(parameter "
                                                       r"'layers.0.attn.wk.weight'\) has shape \(128, 64\), its "
                                                       r"parameter \(64, 128\)")
    with pytest.raises(ValueError, match=rf"state\[{index}\]\.exp_avg has shape"):   # the optimizer alone too
        fresh_opt.load_state_dict(opt.state_dict())


def test_negative_exp_avg_sq_is_refused(tmp_path):
    def make_negative(model, opt):   # would give NaN weights (sqrt of a negative) after one step
        _state_of(model, opt, "layers.0.attn.wq.weight")["exp_avg_sq"][3, 5] = -1e-3
    path, model, _ = _saved_with_wrong_state(tmp_path, make_negative)
    index = _index_of(model, "layers.0.attn.wq.weight")
    _assert_load_refused(path, ValueError, rf"{path}: state\[{index}\]\.exp_avg_sq \(parameter "
                                           r"'layers.0.attn.wq.weight'\) has 1 negative element")


def test_nan_step_count_is_refused(tmp_path):
    def make_nan(model, opt):
        opt.state[next(iter(model.parameters()))]["step"].fill_(float("nan"))
    path, _, _ = _saved_with_wrong_state(tmp_path, make_nan)
    _assert_load_refused(path, ValueError, rf"{path}: state\[0\]\.step \(parameter 'tok_emb.weight'\) is "
                                           r"nan; a step count must be a non-negative integer")


@pytest.mark.parametrize("missing", ["model", "param_groups"])
def test_missing_entry_is_refused_as_an_incomplete_file(tmp_path, missing):
    path, _, _ = _trained(tmp_path)
    data = torch.load(path, weights_only=True)
    del (data if missing == "model" else data["optimizer"])[missing]
    torch.save(data, path)
    fresh_opt = _assert_load_refused(path, RuntimeError, rf"checkpoint {path} is not complete: .*no '{missing}' entry")
    if missing == "param_groups":   # the optimizer's own load_state_dict names it too (torch: KeyError)
        with pytest.raises(ValueError, match="has no 'param_groups' entry, so it is not a complete optimizer"):
            fresh_opt.load_state_dict(data["optimizer"])


@pytest.mark.parametrize("edit, message", [
    ("add", r"extra\.added has no checksum"),
    ("remove", r"is not complete: model\.tok_emb\.weight has a checksum but is not in the file"),
    ("retype", r"model\.tok_emb\.weight is torch\.bfloat16 \[256, 128\], but was saved as torch\.float32"),
    ("no-sums", r"its 'checksums' entry is missing"),
], ids=["added-tensor", "removed-tensor", "changed-dtype", "no-checksums"])
def test_edited_file_does_not_pass_its_checksums(tmp_path, edit, message):
    path, _, _ = _trained(tmp_path)
    data = torch.load(path, weights_only=True)
    if edit == "add":
        data["extra"]["added"] = torch.zeros(3)
    elif edit == "remove":
        del data["model"]["tok_emb.weight"]
    elif edit == "retype":
        data["model"]["tok_emb.weight"] = data["model"]["tok_emb.weight"].bfloat16()
    else:   # the version says checksums, the file has none
        del data["checksums"]
    torch.save(data, path)
    _assert_load_refused(path, RuntimeError, rf"checkpoint {path} .*{message}")


@pytest.mark.parametrize("other, message", [
    (dict(n_layers=2), r"does not fit this model: missing keys \['layers\.1\."),
    (dict(n_layers=1, vocab_size=300), r"model entry 'tok_emb\.weight' has shape \(256, 128\), the model's "
                                       r"\(300, 128\)"),
], ids=["other-keys", "other-shape"])
def test_model_that_does_not_fit_is_refused_before_anything_is_copied(tmp_path, other, message):
    path, _, _ = _trained(tmp_path)
    torch.manual_seed(7)
    model = build("tiny", **other)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match=rf"checkpoint {path}:? {message}"):
        socompile.load(path, model)
    for name, p in model.named_parameters():   # torch's load_state_dict copies the entries that fit first
        assert torch.equal(p, before[name]), name


def test_truncated_file_is_refused_as_cut_short(tmp_path):
    path, _, _ = _trained(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[:len(raw) // 100])
    with pytest.raises(RuntimeError, match=rf"checkpoint {path} \(\d+ bytes\) cannot be read: .*cut short"):
        socompile.load(path, *_fresh())


def test_disk_full_during_save_says_so_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path, model, opt = _trained(tmp_path)
    real_fdopen = os.fdopen

    class FullDisk:   # a file whose device fills up after 4 KB
        def __init__(self, handle):
            self.handle, self.written = handle, 0

        def write(self, data):
            self.written += memoryview(data).nbytes
            if self.written > 4096:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.handle.write(data)

        def __getattr__(self, name):
            return getattr(self.handle, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

    monkeypatch.setattr(os, "fdopen", lambda fd, mode: FullDisk(real_fdopen(fd, mode)))
    with pytest.raises(OSError, match=rf"cannot write checkpoint {path}: No space left on device.*previous "
                                      "checkpoint .* is intact") as caught:
        socompile.save(path, model, opt, step=3)
    assert caught.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
    assert socompile.load(path, *_fresh()) == {"step": 2}


def test_checkpoint_without_checksums_loads_with_a_warning(tmp_path, caplog):
    path, model, opt = _trained(tmp_path)
    data = torch.load(path, weights_only=True)   # what the previous socompile wrote: version 1, no checksums
    del data["checksums"]
    data["version"] = 1
    torch.save(data, path)
    with caplog.at_level("WARNING", logger="socompile"):
        _assert_loads_as_saved(socompile.load, path, model, opt)
    assert f"checkpoint {path} was written by an older socompile without checksums" in caplog.text


def test_checksums_cover_every_tensor_and_a_good_file_round_trips_exactly(tmp_path):
    path, model, opt = _trained(tmp_path)
    data = torch.load(path, weights_only=True)
    names = set(data["checksums"]["tensors"])
    assert {f"model.{n}" for n in model.state_dict()} <= names
    assert {f"optimizer.state[{k}].{key}" for k in opt.state_dict()["state"]
            for key in ("step", "exp_avg", "exp_avg_sq")} <= names
    _assert_loads_as_saved(socompile.load, path, model, opt)


def _sharded_saved(tmp_path):
    """socompile.distributed.save in one process (no process group) after two steps -> (dir, model, opt)."""
    import socompile.distributed as sd
    model, opt = _fresh()
    _train(model, opt, batches(2))
    return sd.save(tmp_path / "sharded", model, opt, step=2), model, opt


def test_sharded_checkpoint_with_a_flipped_byte_is_refused_naming_the_entry(tmp_path):
    import socompile.distributed as sd
    path, model, opt = _sharded_saved(tmp_path)
    index = _index_of(model, "layers.0.attn.wk.weight")
    moment = opt.state_dict()["state"][index]["exp_avg_sq"].contiguous()
    data = next(path.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    start = raw.find(moment.numpy().tobytes())
    assert start > 0
    raw[start + moment.numel() * 2 + 1] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(RuntimeError, match=rf"sharded checkpoint {path} is corrupt: the bytes of "
                                           rf"optim\.state\.{index}\.exp_avg_sq@0 do not match the checksum"):
        sd.load(path, *_fresh())
    sd.save(path, model, opt, step=2)   # written again: it loads, and equals what was saved
    _assert_loads_as_saved(sd.load, path, model, opt)


def test_sharded_checkpoint_with_a_negative_exp_avg_sq_is_refused(tmp_path):
    import socompile.distributed as sd
    model, opt = _fresh()
    _train(model, opt, batches(1))
    index = _index_of(model, "layers.0.attn.wq.weight")
    opt.state_dict()["state"][index]["exp_avg_sq"][2, 7] = -1e-3   # a view of the bucket: the saved state
    path = sd.save(tmp_path / "sharded", model, opt)
    with pytest.raises(ValueError, match=rf"sharded checkpoint {path}: optim\.state\.{index}\.exp_avg_sq has 1 "
                                         "negative element"):
        sd.load(path, *_fresh())


def test_sharded_checkpoint_without_checksums_loads_with_a_warning(tmp_path, monkeypatch, caplog):
    import socompile.distributed.checkpoint as dcp_checkpoint
    monkeypatch.setattr(dcp_checkpoint, "_checksums", lambda state, whole: {})   # as version 1: none
    path, model, opt = _sharded_saved(tmp_path)
    monkeypatch.undo()
    fresh, fresh_opt = _fresh()
    with caplog.at_level("WARNING", logger="socompile"):
        assert dcp_checkpoint.load(path, fresh, fresh_opt) == {"step": 2}
    assert f"sharded checkpoint {path} was written by an older socompile without checksums" in caplog.text
    assert_same_params(fresh, model, atol=0, rtol=0)


def test_load_validates_the_optimizer_state_once(tmp_path, monkeypatch):
    # The value check is a pass over every moment (~20 s at 25B parameters): socompile.load runs it before it
    # touches the model, so socompile.AdamW.load_state_dict must not run it again.
    from socompile.optim import state_dict as optimizer_state
    path, _, _ = _trained(tmp_path)
    calls = []
    check = optimizer_state.check_state_dict
    monkeypatch.setattr(optimizer_state, "check_state_dict", lambda *a, **k: calls.append(1) or check(*a, **k))
    fresh, fresh_opt = _fresh()
    socompile.load(path, fresh, fresh_opt)
    assert len(calls) == 1
    fresh_opt.load_state_dict(fresh_opt.state_dict())   # used directly, the optimizer still checks
    assert len(calls) == 2


# ---------------------------------------------------------------------------------------------- unreadable files
# A file socompile.load cannot use is reported with its path and what it is, never with torch's advice to retry
# with weights_only=False: a file socompile.save wrote never needs it, and unpickling another can run code.

class _NotPlain:   # an object torch.load(weights_only=True) does not unpickle
    pass


def _write_empty(path):
    path.write_bytes(b"")


def _write_random(path):
    # seeded: every run is the same file. Its first byte is a valid pickle opcode often enough that torch's
    # legacy reader gets far (seed 0 gives the weights_only advice on torch 2.13)
    path.write_bytes(bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0),
                                         dtype=torch.uint8).tolist()))


def _write_pickle_of_a_dict(path):
    import pickle
    path.write_bytes(pickle.dumps({"step": 1}))   # not torch.save's format: torch advises weights_only=False


def _write_text(path):
    path.write_text("step,loss\n1,2.5\n")


def _write_torch_file_of_an_object(path):
    torch.save({"model": _NotPlain()}, path)


def _write_truncated(path):
    torch.save({"weights": torch.zeros(1000)}, path)
    path.write_bytes(path.read_bytes()[:300])


@pytest.mark.parametrize("write, error, cause", [
    (_write_empty, RuntimeError, r"is empty \(0 bytes\)"),
    (_write_random, RuntimeError, r"is not a torch checkpoint.* begins with b'"),
    (_write_pickle_of_a_dict, RuntimeError, r"is not a torch checkpoint.* begins with b'\\x80"),
    (_write_text, RuntimeError, r"is not a torch checkpoint.* begins with b'step,loss"),
    (_write_torch_file_of_an_object, ValueError, r"is not a socompile checkpoint.*test_checkpoint\._NotPlain"),
    (_write_truncated, RuntimeError, r"cannot be read.*cut short or corrupt"),
])
def test_an_unreadable_file_is_refused_naming_path_and_cause_without_advising_weights_only(tmp_path, write, error,
                                                                                          cause):
    path = tmp_path / "ckpt.pt"
    write(path)
    with pytest.raises(error, match=cause) as refused:
        socompile.load(path, *_fresh())
    message = str(refused.value)
    assert str(path) in message
    assert "weights_only" not in message and "unpickl" not in message.lower().replace("does not unpickle", "")
    # nor in the chained error a traceback would print after ours
    chained = refused.value.__cause__
    assert chained is None or "weights_only" not in str(chained)


def test_a_torch_file_of_something_else_says_what_it_holds(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2), "lr": 0.1}, path)
    with pytest.raises(ValueError, match=rf"{path} is not a socompile checkpoint .*a dict with keys \['weights', "
                                         r"'lr'\]"):
        socompile.load(path, *_fresh())
    torch.save([torch.zeros(2)], path)
    with pytest.raises(ValueError, match=rf"{path} is not a socompile checkpoint .*a list"):
        socompile.load(path, *_fresh())


def test_optimizer_load_state_dict_of_a_path_or_a_whole_checkpoint_says_what_to_pass(tmp_path):
    path, _, _ = _trained(tmp_path)
    _, opt = _fresh()
    with pytest.raises(TypeError, match=rf"a path \({path}\).*socompile.load"):
        opt.load_state_dict(path)
    with pytest.raises(ValueError, match=r"whole checkpoint.*\['optimizer'\] entry"):
        opt.load_state_dict(torch.load(path, weights_only=True))
