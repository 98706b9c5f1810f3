from __future__ import annotations

import os

# Off CUDA, the Triton kernels run in Triton's interpreter, which Triton chooses when it is first imported
# (transformers imports it): so before anything else is imported.
if os.environ.get("PIC_TEST_DEVICE", "cpu") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import pic
from tests.models import FAMILIES, model, tokenizer
from tests.redis_server import redis_server as new_redis_server


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread unless OMP_NUM_THREADS says otherwise: the tests run tiny models, for which
    more threads only add synchronisation, and on a busy 2-core machine two threads per process slow
    the suite several times over (README, "CPU threads"). Subprocesses the tests start inherit it."""
    torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", "1")))


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


def make_engine(family: str, **config) -> pic.PIC:
    return pic.PIC(model(family), tokenizer(), config=pic.PICConfig(**config))


@pytest.fixture
def stories() -> pic.PIC:
    return make_engine("stories260K")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server for the whole session (function tests flush it through ``redis_url``)."""
    server = new_redis_server(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    redis_server.client().flushall()
    return redis_server.url
