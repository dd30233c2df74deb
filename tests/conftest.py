import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: Dynamo caches code objects across tests otherwise."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
