from __future__ import annotations

import os

# Off CUDA, the Triton kernels run in Triton's interpreter, which Triton chooses when it is first imported
# (transformers imports it): so before anything else is imported.
if os.environ.get("PIC_TEST_DEVICE", "cpu") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import pic
from pic.kv.memory import DEFAULT_CPU_POOL_TOKENS
from tests.device import target
from tests.full_disk import small_disk  # noqa: F401  (a 2 MiB tmpfs, for every test file)
from tests.models import FAMILIES, model, target_model, tokenizer
from tests.redis_server import paused_redis  # noqa: F401  (a redis-server a test may pause)
from tests.redis_server import redis_server as new_redis_server
from tests.smollm2 import smollm2  # noqa: F401  (the session's SmolLM2 engine, for every test file)


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread unless OMP_NUM_THREADS says otherwise: the tests run tiny models, for which
    more threads only add synchronisation, and on a busy 2-core machine two threads per process slow
    the suite several times over (docs/engine.md, "CPU threads"). Subprocesses the tests start inherit it."""
    torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", "1")))
    target()  # a bad PIC_TEST_DEVICE / PIC_TEST_DTYPE, or CUDA without a GPU, stops the run here: a usage error


def make_engine(family: str, **config) -> pic.PIC:
    """An engine over ``model(family)``: the CPU in float32, whatever the test target."""
    return pic.PIC(model(family), tokenizer(), config=pic.PICConfig(**config))


def make_target_engine(family: str, *, dtype: torch.dtype | None = None, **config) -> pic.PIC:
    """An engine over ``target_model(family)``: on ``PIC_TEST_DEVICE`` in ``PIC_TEST_DTYPE`` (or ``dtype``).

    On CUDA its KV pool defaults to the CPU's default size, not to 80% of the GPU for every test engine
    (``kv_pool_tokens=None`` asks for the CUDA default)."""
    if target().device.type == "cuda":
        config.setdefault("kv_pool_tokens", DEFAULT_CPU_POOL_TOKENS)
    return pic.PIC(target_model(family, dtype=dtype), tokenizer(), config=pic.PICConfig(**config))


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


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
