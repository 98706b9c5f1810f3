"""``PicConnector``: pic's chunks inside vLLM, as a KV connector loaded out of tree (no fork, no patch)::

    vllm serve <model folder> --kv-transfer-config '{"kv_connector": "PicConnector",
        "kv_connector_module_path": "pic.vllm.connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": {"disk_path": "/srv/pic"}}}'

A request names its chunks by cache id (``kv_transfer_params={"pic": {"ids": [...]}}``, see
``pic.vllm.params``); the scheduler side checks the prompt holds their tokens and claims the prefix and the
chunks (less the suffix the policy leaves to vLLM) as an external hit; the worker side loads each chunk's NoPE
K and V from pic's tiers and writes them, K rotated to the chunk's positions in this prompt, into vLLM's
paged cache, layer by layer. ``{"pic": {"compile": true}}`` stores a prompt's KV as a pic chunk instead. A
request's ``cache_salt`` is its tenant: its pic namespace (``pic.vllm.tenants``), whose chunks alone it stores and
links.

vLLM builds one instance per role (scheduler, worker), in their own processes; each half lives in its own
module (``scheduler_side``, ``worker_side``), this class only routes vLLM's calls.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from pic.vllm.jobs import PicConnectorMetadata
from pic.vllm.kv_io import model_rope
from pic.vllm.scheduler_side import SchedulerSide
from pic.vllm.setup import build_setup
from pic.vllm.worker_side import Ranks, WorkerSide

# The vLLM release this connector is written and tested against; ``check_vllm_api`` names what changed.
TESTED_VLLM = "0.32.0"
_REQUIRED_HOOKS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
    "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_block_ids_with_load_errors",
)  # fmt: skip


class PicConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        check_vllm_api()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        setup = build_setup(vllm_config)
        self._scheduler = self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(setup)
        else:
            rope = model_rope(
                vllm_config.model_config.hf_config, max_positions=vllm_config.model_config.max_model_len,
                dtype=setup.expected.dtype, device=torch.device(vllm_config.device_config.device),
            )  # fmt: skip
            self._worker = WorkerSide(setup, rope, _ranks(setup.expected.num_kv_heads, rope.device))

    # Scheduler side.
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.num_new_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler.build_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, self._scheduler.finished(request)

    # Worker side.
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PicConnectorMetadata)
        self._worker.start(meta, forward_context.no_compile_layers)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        from vllm.forward_context import get_forward_context

        meta = self._get_connector_metadata()
        assert isinstance(meta, PicConnectorMetadata)
        self._worker.save_layer(layer_name, kv_layer, meta, get_forward_context().no_compile_layers[layer_name])

    def wait_for_save(self) -> None:
        self._worker.finish_saves()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks()

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()


def _ranks(num_kv_heads: int, device: torch.device) -> Ranks:
    """This tensor-parallel rank's KV heads of a chunk, and the gather that gives its saves every rank's heads."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
        tensor_model_parallel_all_gather,
    )

    size, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    if size == 1:
        return Ranks(slice(0, num_kv_heads))
    heads = local_heads(num_kv_heads, size, rank)
    firsts = [local_heads(num_kv_heads, size, r).start for r in range(size)]
    keep = [r for r in range(size) if r == 0 or firsts[r] != firsts[r - 1]]  # (copies: one rank's of each head)

    def gather(local: torch.Tensor) -> torch.Tensor:
        every = tensor_model_parallel_all_gather(local.to(device), dim=2).cpu()  # [L, T, size * len(heads), D]
        return every if len(keep) == size else every[:, :, keep]

    return Ranks(heads, gather, stores=rank == 0)


def local_heads(num_kv_heads: int, size: int, rank: int) -> slice:
    """Rank ``rank``'s KV heads of ``size`` ranks: an equal share, or a copy of one when there are fewer heads than
    ranks (vLLM's split: rank ``r`` holds head ``r * num_kv_heads // size``)."""
    if num_kv_heads >= size:
        per_rank = num_kv_heads // size
        return slice(rank * per_rank, (rank + 1) * per_rank)
    first = rank * num_kv_heads // size
    return slice(first, first + 1)


def check_vllm_api() -> None:
    """Raise, naming what is missing, when the installed vLLM's connector API is not the one pic implements
    (a vLLM upgrade that renamed or removed a hook must fail loudly, not leave pic's methods uncalled).

    Raises:
        ImportError: a hook pic implements is no longer part of ``KVConnectorBase_V1``.
    """
    import vllm

    missing = [name for name in _REQUIRED_HOOKS if not hasattr(KVConnectorBase_V1, name)]
    if missing:
        raise ImportError(
            f"vLLM {vllm.__version__}'s KV connector API lacks {missing}; pic's connector is written for vLLM "
            f"{TESTED_VLLM}: pin vllm=={TESTED_VLLM} or update pic"
        )
