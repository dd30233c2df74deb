"""Several models of one class in one process: each trains with its own optimizer.

Dynamo compiles a model class's forward once and runs that code for every instance (parameters are graph
inputs, not guards). The backend must compile again for each model, so that its gradients step *its*
optimizer: a fresh model, a ``copy.deepcopy``, teacher and student trained in turn, and a model whose optimizer
was re-created (a newer socompile.AdamW takes the parameters over).

Reference: each model trained eagerly with its own torch.optim.AdamW on the same data. Tolerances: atol 1e-6
with compute="eager" (same aten ops, same gradients; the CPU kernel's correctly rounded sqrt differs from
torch's by an ulp now and then, ~1e-8 per step: see tests/test_backend_training.py). Routed to the wrong
optimizer, a model's parameters move by ~lr = 1e-3 per step or not at all.
"""
import copy
import gc

import pytest
import torch
from torch import nn

import socompile
from socompile.models import build
from training_helpers import assert_same_params, batches

OPT = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _mlp_data(steps: int, rows: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, 16, generator=gen) for _ in range(steps)]


def _mlp_loss(out):
    return out.square().mean()


class Trained:
    """A model trained by socompile (compiled with ``backend``) next to its eager torch.optim.AdamW twin."""

    def __init__(self, model: nn.Module, backend, **compile_kwargs):
        self.model, self.ref = model, copy.deepcopy(model)
        self.opt = socompile.AdamW(model.parameters(), **OPT)
        self.ref_opt = torch.optim.AdamW(self.ref.parameters(), **OPT)
        self.compiled = torch.compile(model, backend=backend, **compile_kwargs)

    def forward(self, x, loss=_mlp_loss):
        return loss(self.compiled(x)), loss(self.ref(x))

    def step(self):
        for opt in (self.opt, self.ref_opt):
            opt.step()
            opt.zero_grad()

    def train(self, data, loss=_mlp_loss):
        for x in data:
            for value in self.forward(x, loss):
                value.backward()
            self.step()

    def snapshot(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]

    def assert_matches_reference(self, atol: float = 1e-6):
        assert_same_params(self.model, self.ref, atol=atol)


def _train_each(pairs, data) -> None:
    """Train every (model, optimizer) pair in ``pairs`` on each batch of ``data``, the pairs in turn."""
    for x in data:
        for model, opt in pairs:
            _mlp_loss(model(x)).backward()
            opt.step()
            opt.zero_grad()


def _backend(**options):
    return socompile.SuperOffload({"compute": "eager", "gpu_buckets": 0, **options})


def _assert_unchanged(model: nn.Module, before: list[torch.Tensor]):
    for p, q in zip(model.parameters(), before):
        torch.testing.assert_close(p.detach(), q, atol=0, rtol=0)


def test_second_model_of_one_class_steps_its_own_optimizer_and_leaves_the_first_alone():
    backend = _backend(bucket_size="128KB")
    torch.manual_seed(0)
    a = Trained(build("tiny", n_layers=1), backend)
    a.train([x for x, _ in batches(2)], loss=lambda out: out.float().square().mean())
    a_after = a.snapshot()
    torch.manual_seed(1)
    b = Trained(build("tiny", n_layers=1), backend)
    b.train([x for x, _ in batches(3, seed=1)], loss=lambda out: out.float().square().mean())
    a.assert_matches_reference()
    b.assert_matches_reference()
    _assert_unchanged(a.model, a_after)
    assert len(backend.compiled) == 2   # compiled once more for B, not once per step


def test_deepcopy_trained_after_the_original():
    backend = _backend()
    torch.manual_seed(0)
    original = MLP()
    a = Trained(original, backend)
    a.train(_mlp_data(2))
    a_after = a.snapshot()
    b = Trained(copy.deepcopy(original), backend)
    b.train(_mlp_data(3, seed=1))
    a.assert_matches_reference()
    b.assert_matches_reference()
    _assert_unchanged(a.model, a_after)


@pytest.mark.parametrize("compute", ["eager", "inductor"])
def test_teacher_and_student_interleaved_each_match_their_reference(compute):
    # Both forwards run before either backward: each backward must still reach the optimizer of the model whose
    # forward saved it. Inductor: fused and reordered reductions change gradients in their last bits, which
    # Adam's normalised update turns into parameter differences far below lr; 5e-5 over 3 steps has more
    # headroom than tests/test_backend_training.py's Inductor test (10 steps of a larger model, ~2e-5 measured),
    # and is 20x below the ~lr step of a wrongly routed update.
    backend = _backend(compute=compute)
    torch.manual_seed(0)
    teacher, student = Trained(MLP(), backend), Trained(MLP(), backend)
    for x in _mlp_data(3):
        losses = [*teacher.forward(x), *student.forward(x)]
        for value in losses:
            value.backward()
        teacher.step()
        student.step()
    atol = 1e-6 if compute == "eager" else 5e-5
    teacher.assert_matches_reference(atol)
    student.assert_matches_reference(atol)


def test_graph_compiled_for_dynamic_shapes_is_compiled_again_with_dynamic_shapes():
    # B must get a graph that still takes every length (compiled again from Dynamo's symbolic inputs, not
    # specialised to the length of B's first call).
    backend = _backend()
    torch.manual_seed(0)
    a, b = Trained(MLP(), backend, dynamic=True), Trained(MLP(), backend, dynamic=True)
    a.train(_mlp_data(1, rows=8))
    b.train(_mlp_data(1, rows=8, seed=1) + _mlp_data(1, rows=5, seed=2) + _mlp_data(1, rows=11, seed=3))
    a.train(_mlp_data(1, rows=6, seed=4))
    a.assert_matches_reference()
    b.assert_matches_reference()
    assert len(backend.compiled) == 2


def test_evaluation_under_no_grad_runs_each_model_with_its_own_weights():
    backend = _backend()
    torch.manual_seed(0)
    a, b = Trained(MLP(), backend), Trained(MLP(), backend)
    a.train(_mlp_data(1))
    b.train(_mlp_data(1, seed=1))
    x = torch.randn(4, 16)
    with torch.no_grad():
        for trained in (a, b, a):
            torch.testing.assert_close(trained.compiled(x), trained.model(x), atol=0, rtol=0)


def test_model_without_socompile_optimizer_after_one_with_it_keeps_plain_grads():
    backend = _backend()
    torch.manual_seed(0)
    a = Trained(MLP(), backend)
    a.train(_mlp_data(1))
    plain = MLP()
    ref = copy.deepcopy(plain)
    x = _mlp_data(1, seed=1)[0]
    _mlp_loss(torch.compile(plain, backend=backend)(x)).backward()
    _mlp_loss(ref(x)).backward()
    for p, q in zip(plain.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=0, rtol=0)   # same aten ops: bitwise


def test_compiled_model_follows_its_parameters_to_a_newer_optimizer():
    # The cell that builds the optimizer is run again. The new optimizer starts fresh, as a new
    # torch.optim.AdamW would, and the compiled model's gradients must reach it, not the old one.
    backend = _backend()
    torch.manual_seed(0)
    a = Trained(MLP(), backend)
    a.train(_mlp_data(2))
    old = a.opt
    a.opt = socompile.AdamW(a.model.parameters(), **OPT)
    a.ref_opt = torch.optim.AdamW(a.ref.parameters(), **OPT)
    a.train(_mlp_data(2, seed=1))
    a.assert_matches_reference()
    with pytest.raises(RuntimeError, match="taken over by a newer socompile.AdamW"):
        old.step()


def _built_again(model, ref):
    """A second optimizer over the same parameters -> (first, second, torch reference)."""
    first = socompile.AdamW(model.parameters(), **OPT)
    second = socompile.AdamW(model.parameters(), **OPT)
    return first, second, torch.optim.AdamW(ref.parameters(), **OPT)


def _group_added(model, ref):
    """add_param_group is the other way a parameter reaches a newer optimizer: the older one must hand it over
    (retired, as when a whole optimizer is built again), else both would step it -> (first, second, reference)."""
    first = socompile.AdamW(model.fc2.parameters(), **OPT)
    second = socompile.AdamW(model.fc1.parameters(), **OPT)
    second.add_param_group({"params": list(model.fc2.parameters())})
    ref_opt = torch.optim.AdamW(ref.fc1.parameters(), **OPT)
    ref_opt.add_param_group({"params": list(ref.fc2.parameters())})
    return first, second, ref_opt


@pytest.mark.parametrize("take_over, steps, message", [
    (_built_again, 3, "taken over by a newer socompile.AdamW.*Use the new optimizer"),
    (_group_added, 2, "taken over by a newer socompile.AdamW"),
], ids=["optimizer-built-again", "param-group-added"])
def test_a_newer_optimizer_takes_the_parameters_over_and_trains_like_torch(take_over, steps, message):
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    first, second, ref_opt = take_over(model, ref)
    _train_each([(model, second), (ref, ref_opt)], _mlp_data(steps))
    assert_same_params(model, ref)
    with pytest.raises(RuntimeError, match=message):
        first.step()


def test_optimizer_deleted_then_built_again_gets_the_gradients():
    # The string backend keeps no compile contexts, so deleting the optimizer frees it and its buckets.
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    opt, ref_opt = socompile.AdamW(model.parameters(), **OPT), torch.optim.AdamW(ref.parameters(), **OPT)
    cmodel = torch.compile(model, backend="superoffload", options={"compute": "eager", "gpu_buckets": 0})
    first, second = _mlp_data(2)
    _train_each([(cmodel, opt), (ref, ref_opt)], [first])
    del opt
    gc.collect()
    with pytest.raises(RuntimeError, match="optimizer that this compiled graph was planned for was deleted. "
                                           "Create a new socompile.AdamW"):
        _mlp_loss(cmodel(second)).backward()
    model.zero_grad()
    opt, ref_opt = socompile.AdamW(model.parameters(), **OPT), torch.optim.AdamW(ref.parameters(), **OPT)
    _train_each([(cmodel, opt), (ref, ref_opt)], [second])
    assert_same_params(model, ref)
