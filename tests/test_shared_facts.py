"""Facts several layers share have one definition: the activation choices and the dtype names."""
import pytest
import torch

from socompile import dtypes
from socompile.options import ACTIVATION_CHOICES, OFFLOADED_CHOICES, OptionError, Options


def test_activation_choices_have_one_definition_that_options_plan_and_passes_use():
    import importlib

    from socompile.passes import activations
    plan = importlib.import_module("socompile.plan.plan")   # (socompile.plan.plan is also the function plan())
    assert plan.ACTIVATION_CHOICES is ACTIVATION_CHOICES and activations.CHOICES is ACTIVATION_CHOICES
    assert activations.OFFLOADED is OFFLOADED_CHOICES and set(OFFLOADED_CHOICES) < set(ACTIVATION_CHOICES)
    for choice in ("auto", *ACTIVATION_CHOICES):
        assert Options(activations=choice).activations == choice
    with pytest.raises(OptionError) as err:
        Options(activations="sometimes")
    assert str(err.value) == ("activations must be 'auto', 'keep', 'recompute', 'selective', 'selective_offload' "
                              "or 'offload', got 'sometimes'")


def test_dtype_names_sizes_and_torch_dtypes_agree_with_torch():
    for name, dtype in dtypes.TORCH_DTYPES.items():
        assert dtype == getattr(torch, name) and dtypes.dtype_bytes(name) == dtype.itemsize
    assert dtypes.dtype_name(torch.bfloat16.itemsize) == "bfloat16" and dtypes.dtype_name(4) == "float32"
    with pytest.raises(TypeError):   # a read-only table: nobody can add or change a name at run time
        dtypes.TORCH_DTYPES["float64"] = torch.float64


def test_no_module_keeps_its_own_dtype_map():
    from socompile.passes import cast_gradients, weight_flow
    from socompile.runtime import offload
    for module in (cast_gradients, weight_flow, offload):
        assert not hasattr(module, "_DTYPES") and module.TORCH_DTYPES is dtypes.TORCH_DTYPES
