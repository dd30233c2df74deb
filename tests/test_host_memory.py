"""Optimizer-state host buffers on 2 MB pages (socompile/runtime/host_memory.py)."""
import pytest
import torch

from socompile.runtime import host_memory
from socompile.runtime.host_memory import HUGE_PAGE, MIN_BYTES, host_zeros


def _anon_huge_kb(ptr: int, nbytes: int) -> int:
    """AnonHugePages (kB) of the mappings of this process that overlap [ptr, ptr + nbytes)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < ptr + nbytes and hi > ptr
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


def test_small_buffers_are_plain_zeros():
    t = host_zeros(1000)
    assert t.dtype == torch.float32 and t.shape == (1000,) and t.is_contiguous()
    assert torch.count_nonzero(t) == 0


def test_large_buffers_are_zeroed_contiguous_and_2mb_aligned_where_huge_pages_exist():
    n = 3 * MIN_BYTES // 4 + 5                # not a whole number of huge pages
    t = host_zeros(n)
    assert t.shape == (n,) and t.is_contiguous() and torch.count_nonzero(t) == 0
    t.fill_(1.0)                              # the whole range is writable memory of its own
    assert float(t.sum()) == n
    if not host_memory.huge_pages_available():
        pytest.skip("transparent huge pages are off on this machine (or SOCOMPILE_HUGE_PAGES=0)")
    assert t.data_ptr() % HUGE_PAGE == 0


def test_the_kernel_backs_them_with_huge_pages_when_thp_is_on():
    if not host_memory.huge_pages_available():
        pytest.skip("transparent huge pages are off on this machine (or SOCOMPILE_HUGE_PAGES=0)")
    t = host_zeros(8 * HUGE_PAGE // 4)
    # The kernel may refuse (fragmented memory); on an idle test machine it grants most of them.
    assert _anon_huge_kb(t.data_ptr(), t.numel() * 4) >= 2048


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("SOCOMPILE_HUGE_PAGES", "0")
    host_memory.huge_pages_available.cache_clear()
    try:
        assert not host_memory.huge_pages_available()
        t = host_zeros(2 * MIN_BYTES // 4)
        assert torch.count_nonzero(t) == 0
    finally:
        monkeypatch.delenv("SOCOMPILE_HUGE_PAGES")
        host_memory.huge_pages_available.cache_clear()


def test_an_optimizer_bucket_on_huge_pages_steps_like_torch_adamw():
    # 2M parameters = one 8 MB bucket: large enough for host_zeros to use huge pages. Tolerance as in
    # tests/test_backend_training.py: torch's CPU sqrt is off by an ulp on some elements, ours is not.
    import socompile

    torch.manual_seed(0)
    ours, ref = torch.nn.Linear(1024, 2048, bias=False), torch.nn.Linear(1024, 2048, bias=False)
    ref.load_state_dict(ours.state_dict())
    opt = socompile.AdamW(ours.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for _ in range(3):
        x = torch.randn(16, 1024)
        for model, o in ((ours, opt), (ref, ref_opt)):
            model(x).square().mean().backward()
            o.step()
            o.zero_grad()
    torch.testing.assert_close(ours.weight, ref.weight, atol=1e-6, rtol=0)
    if host_memory.huge_pages_available():
        assert ours.weight.data_ptr() % HUGE_PAGE == 0     # the parameter aliases the bucket's master
