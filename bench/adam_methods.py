"""The CPU Adam implementations bench/adam.py times: each ``make_*`` builds a step function over one shared
``Problem`` (parameters, gradients, moments of one configuration); ``method_table`` lists the rows to time."""
from __future__ import annotations

import importlib

import torch

PREFETCH_ROW = 1024  # elements ahead for the "prefetch" rows (4 KiB of each fp32 stream)
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def chunks(n, k):
    base, extra = divmod(n, k)
    return [base + (1 if i < extra else 0) for i in range(k)]


def filled(numel, lo=-1.0, hi=1.0, dtype=torch.float32):
    return torch.empty(numel, dtype=dtype).uniform_(lo, hi)


class Problem:
    """Parameters, gradients and moments of one configuration, shared by every method (each method steps
    the same buffers; the values only drift, which does not change the timing)."""

    def __init__(self, n, ntensors, mode):
        sizes = chunks(n, ntensors)
        self.n, self.ntensors, self.mode = n, ntensors, mode
        gdt = torch.bfloat16 if mode == "bf16" else torch.float32
        self.p = [filled(s).requires_grad_() for s in sizes]
        self.g = [filled(s, -1e-2, 1e-2).to(gdt) for s in sizes]
        self.m = [torch.zeros(s) for s in sizes]
        self.v = [torch.zeros(s) for s in sizes]
        # bf16 moments (socompile.AdamW(moment_dtype=torch.bfloat16)) and their ping-pong state B, allocated on
        # first use by a "bf16 moments" row
        self._moments16 = None
        self._moments8 = None
        self.p16 = [torch.zeros(s, dtype=torch.bfloat16) for s in sizes] if mode == "bf16" else [None] * ntensors
        # state "B" for ping-pong, shared by ours and the ceiling; zero-filled so page faults are not timed
        self.alt = [(torch.zeros(s), torch.zeros(s), torch.zeros(s)) for s in sizes]
        # the fp32 .grad buffers torch and DeepSpeed read: the grads themselves, or buffers the casts fill
        self.g32 = self.g if mode == "fp32" else [torch.zeros(s) for s in sizes]


    def moments16(self):
        """(m, v, state B) with bf16 moments, made once for the rows that use them (zero-filled: no page
        faults timed)."""
        if self._moments16 is None:
            sizes = [p.numel() for p in self.p]
            half = lambda s: torch.zeros(s, dtype=torch.bfloat16)  # noqa: E731
            self._moments16 = ([half(s) for s in sizes], [half(s) for s in sizes],
                               [(torch.zeros(s), half(s), half(s)) for s in sizes])
        return self._moments16


    def moments8(self):
        """(m, v, state B) with int8 block-quantised moments (socompile.AdamW(moment_dtype="int8"): uint8 buffers
        of 20 B per 16 parameters), made once for the rows that use them (zero-filled: valid blocks of scale 0,
        and no page faults timed)."""
        if self._moments8 is None:
            sizes = [p.numel() for p in self.p]
            packed = lambda s: torch.zeros(-(-s // 16) * 20, dtype=torch.uint8)  # noqa: E731
            self._moments8 = ([packed(s) for s in sizes], [packed(s) for s in sizes],
                              [(torch.zeros(s), packed(s), packed(s)) for s in sizes])
        return self._moments8

    def moments(self, bf16_moments=False, int8_moments=False):
        """(m, v, state B) of the moment format a row uses: fp32, bf16 or int8."""
        if int8_moments:
            return self.moments8()
        return self.moments16() if bf16_moments else (self.m, self.v, self.alt)


# ------------------------------------------------------------------ the methods (each returns a step function)

def with_stores(policy, run):
    """Run a method under one store policy of the kernel (auto: streaming stores for separate outputs of at
    least 128K elements; regular; streaming: every output, in-place ones too), then restore auto."""
    import socompile_ext as se

    if policy == "auto":
        return run

    def wrapped():
        se.set_store_policy(policy)
        try:
            run()
        finally:
            se.set_store_policy("auto")

    return wrapped


def with_prefetch(elems, run):
    """Run a method with the AVX-512 path's software prefetch of the input streams `elems` elements ahead."""
    from socompile_ext import _adam

    def wrapped():
        before = _adam.get_prefetch()
        _adam.set_prefetch(elems)
        try:
            run()
        finally:
            _adam.set_prefetch(before)

    return wrapped


def with_static_schedule(run):
    """Run a method with the kernel's static block schedule (contiguous range per thread) instead of dynamic."""
    from socompile_ext import _adam

    def wrapped():
        _adam.set_dynamic_schedule(False)
        try:
            run()
        finally:
            _adam.set_dynamic_schedule(True)

    return wrapped


def make_ours(pr, pingpong, per_tensor_calls=False, bf16_moments=False, int8_moments=False):
    """One adam_step_multi call for all tensors (one parallel region), or, with per_tensor_calls, one
    adam_step call per tensor (what a loop over parameters does; None for one tensor: the same thing).
    bf16_moments: the moments stored in bf16 (stochastically rounded), 20 B per parameter with fp32 grads;
    int8_moments: int8 blocks (16 codes + an fp32 scale per 16 parameters), 17 B per parameter."""
    import socompile_ext as se

    if per_tensor_calls and pr.ntensors == 1:
        return None
    m, v, alt = pr.moments(bf16_moments, int8_moments)
    state = [[p.detach() for p in pr.p], list(m), list(v)]
    other = [[a[0] for a in alt], [a[1] for a in alt], [a[2] for a in alt]]
    step = [0]
    kw = dict(lr=HP["lr"], beta1=HP["betas"][0], beta2=HP["betas"][1], eps=HP["eps"], weight_decay=HP["weight_decay"])

    def run():
        step[0] += 1
        outs = dict(params_out=other[0], exp_avgs_out=other[1], exp_avg_sqs_out=other[2]) if pingpong else {}
        if per_tensor_calls:
            for i in range(pr.ntensors):
                pp = dict(param_out=other[0][i], exp_avg_out=other[1][i], exp_avg_sq_out=other[2][i]) if pingpong else {}
                se.adam_step(state[0][i], pr.g[i], state[1][i], state[2][i], step=step[0], **kw, **pp,
                             param_bf16_out=pr.p16[i])
        else:
            se.adam_step_multi(state[0], pr.g, state[1], state[2], step=step[0], **kw, **outs, params_bf16_out=pr.p16)
        if pingpong:  # validation passed: B becomes the current state
            state[:], other[:] = other[:], state[:]

    return run


def make_ceiling(pr, pingpong, bf16_moments=False, int8_moments=False):
    """The step's loads and stores without its arithmetic (with bf16 moments: their 2-byte loads and stores;
    int8 moments: their codes and scales, regular stores as the int8 step)."""
    import socompile_ext as se

    m, v, alt = pr.moments(bf16_moments, int8_moments)
    params = [p.detach() for p in pr.p]
    outs = [[a[j] for a in alt] for j in range(3)] if pingpong else [None, None, None]

    def run():
        se._copy_ceiling_multi(params, pr.g, m, v, *outs, params_bf16_out=pr.p16)

    return run


def _with_casts(pr, step_fn):
    """A torch user's mixed-precision step: bf16 grads -> fp32 .grad, fp32 step, fp32 params -> bf16 copy."""
    detached = [p.detach() for p in pr.p]

    def run():
        for p, g in zip(pr.p, pr.g32):
            p.grad = g
        with torch.no_grad():
            if pr.mode == "bf16":
                torch._foreach_copy_(pr.g32, pr.g)
            step_fn()
            if pr.mode == "bf16":
                torch._foreach_copy_(pr.p16, detached)

    return run


def make_torch(pr, impl):
    kw = {"fused": True} if impl == "fused" else {"foreach": True}
    return _with_casts(pr, torch.optim.AdamW(pr.p, **HP, **kw).step)


def make_deepspeed(pr):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    opt = DeepSpeedCPUAdam(pr.p, lr=HP["lr"], betas=HP["betas"], eps=HP["eps"], weight_decay=HP["weight_decay"],
                           adamw_mode=True)
    return _with_casts(pr, opt.step)


def deepspeed_status():
    """None when DeepSpeedCPUAdam can be used here, else the reason."""
    try:
        importlib.import_module("deepspeed.ops.adam")
        return None
    except Exception as e:  # noqa: BLE001 - any import failure means "not here"
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def store_choices(pr):
    """What the kernel's automatic store policy picks for this configuration's first tensor, within the one
    adam_step_multi call over all the configuration's tensors that "ours" makes."""
    import socompile_ext as se

    p, g, m, v = pr.p[0].detach(), pr.g[0], pr.m[0], pr.v[0]
    inpl = se.store_choice(p, g, m, v, param_bf16_out=pr.p16[0], call_numel=pr.n)
    pp = se.store_choice(p, g, m, v, param_out=pr.alt[0][0], exp_avg_out=pr.alt[0][1], exp_avg_sq_out=pr.alt[0][2],
                         param_bf16_out=pr.p16[0], call_numel=pr.n)
    word = lambda c: ("streaming" if c["state"] else "regular") + (  # noqa: E731
        f" (bf16 copy: {'streaming' if c['bf16'] else 'regular'})" if pr.p16[0] is not None else "")
    return f"in-place {word(inpl)}; ping-pong {word(pp)}"




def method_table(foreach: bool, deepspeed: bool, extra: bool) -> list:
    """(name, make) per method to time, make(problem) -> step function or None where it does not apply.
    ``foreach``: torch's foreach AdamW (slowest); ``deepspeed``: DeepSpeedCPUAdam (only where it imports);
    ``extra``: the rows of experiments that did not become defaults (see docs/kernel.md)."""
    # "ours"/"ceiling" rows use the kernel's automatic store choice (printed per configuration); the rows
    # marked "regular stores" / "streaming stores" force one policy, to show what the choice is worth
    ours = lambda pp, pol="auto": lambda pr: with_stores(pol, make_ours(pr, pp))  # noqa: E731
    ceil = lambda pp, pol="auto": lambda pr: with_stores(pol, make_ceiling(pr, pp))  # noqa: E731
    methods = [("ours in-place", ours(False)), ("ours in-place, streaming", ours(False, "streaming")),
               ("ours in-place, 1 call per tensor", lambda pr: make_ours(pr, False, per_tensor_calls=True)),

               ("ours in-place, regular", lambda pr: None if pr.mode == "fp32" else with_stores("regular", make_ours(pr, False))),
               ("ours ping-pong", ours(True)), ("ours ping-pong, regular", ours(True, "regular")),
               ("torch fused", lambda pr: make_torch(pr, "fused"))]
    if foreach:
        methods.append(("torch foreach", lambda pr: make_torch(pr, "foreach")))
    if deepspeed:
        methods.append(("deepspeed", make_deepspeed))
    methods += [("ceiling in-place", ceil(False)), ("ceiling in-place, streaming", ceil(False, "streaming")),

                ("ceiling ping-pong", ceil(True)), ("ceiling ping-pong, regular", ceil(True, "regular")),
                # bf16 moments: 4 bytes fewer read and 4 fewer written per parameter
                ("ours in-place, bf16 moments", lambda pr: make_ours(pr, False, bf16_moments=True)),
                ("ours ping-pong, bf16 moments", lambda pr: make_ours(pr, True, bf16_moments=True)),
                ("ceiling in-place, bf16 moments", lambda pr: make_ceiling(pr, False, bf16_moments=True)),
                ("ceiling ping-pong, bf16 moments", lambda pr: make_ceiling(pr, True, bf16_moments=True)),
                # int8 moments: 16 codes + one fp32 scale per 16 parameters, 1.25 B per moment instead of 4
                ("ours in-place, int8 moments", lambda pr: make_ours(pr, False, int8_moments=True)),
                ("ours ping-pong, int8 moments", lambda pr: make_ours(pr, True, int8_moments=True)),
                ("ceiling in-place, int8 moments", lambda pr: make_ceiling(pr, False, int8_moments=True)),
                ("ceiling ping-pong, int8 moments", lambda pr: make_ceiling(pr, True, int8_moments=True))]
    if extra:
        methods += [("ours in-place, static schedule", lambda pr: with_static_schedule(make_ours(pr, False))),
                    ("ours in-place, prefetch", lambda pr: with_prefetch(PREFETCH_ROW, make_ours(pr, False))),
                    ("ours ping-pong, prefetch", lambda pr: with_prefetch(PREFETCH_ROW, make_ours(pr, True))),
                    ("ceiling in-place, prefetch", lambda pr: with_prefetch(PREFETCH_ROW, make_ceiling(pr, False))),
                    ("ceiling ping-pong, prefetch", lambda pr: with_prefetch(PREFETCH_ROW, make_ceiling(pr, True)))]
    return methods
