"""``ChunkPrefill``: one chunk's compile, prefilled alone at positions 0..L-1 straight into its canonical
blocks, in pieces that the engine's scheduler fits into its steps (chunked prefill).

A piece attends to the pieces before it through the chunk's own blocks (their slots hold their logical
positions; unwritten slots are masked), so a chunk prefilled in pieces has the KV of one prefilled whole.
"""

from __future__ import annotations

import torch

from pic.config import CompileOptions
from pic.kv import ChunkInfo, KVCache, RequestKV, blocks_for
from pic.model import SeqInput


def lead_tokens(options: CompileOptions, bos_token_id: int | None) -> list[int]:
    """What a chunk's content is prefilled after: the extra BOS tokens and the context (both dropped from
    the cached KV), then the chunk's own BOS (kept). No BOS at all when the model has none."""
    bos = [] if bos_token_id is None else [bos_token_id]
    return bos * options.num_extra_bos + list(options.context) + bos * options.add_bos


def prefill_blocks(num_tokens: int, *, num_dropped: int, block_size: int) -> tuple[int, int]:
    """Blocks a chunk prefill takes: ``(canonical blocks kept, lead blocks freed afterwards)``."""
    return blocks_for(num_tokens - num_dropped, block_size), blocks_for(num_dropped, block_size)


class ChunkPrefill:
    """The compile of chunk ``cache_id``: ``lead_tokens`` then its ``content`` run through the model.

    The kept tokens fill their blocks front-padded (MEPIC's canonical layout: the last slots of the last
    block are the chunk's last tokens), so the blocks can be mapped into any linked request as they are.
    Dropped tokens (extra BOS tokens, a context) run in lead blocks of their own, freed at the end.

    Life: ``start`` (takes the blocks) -> ``piece`` per step until ``is_done`` -> ``finish`` (the chunk's
    info and canonical blocks, one reference each for the caller); ``abort`` frees what it took.

    Args:
        cache_id: the chunk's id.
        content: its content tokens (without BOS).
        options: its compile options.
        bos_token_id: the model's BOS token (``None``: none).
        order: its place in the engine's first-come-first-served order of prefill work.
    """

    def __init__(
        self, cache_id: str, content: list[int], options: CompileOptions, *, bos_token_id: int | None, order: float
    ) -> None:
        self.cache_id, self.options, self.order = cache_id, options, order
        self.token_ids = lead_tokens(options, bos_token_id) + list(content)
        self.num_dropped = options.num_dropped
        self.num_done = 0  # tokens run so far
        self.kv: RequestKV | None = None
        self._num_lead = 0
        self._slots: torch.Tensor | None = None  # [L] int64, each token's slot in ``kv``
        # Who waits for the chunk: the engine's compile calls and its requests. Each says ``is_finished`` (it no
        # longer needs the chunk); a call also says ``interactive`` (a request waits for it).
        self.calls: list[object] = []
        self.requests: list[object] = []

    @property
    def num_left(self) -> int:
        return len(self.token_ids) - self.num_done

    @property
    def waiters(self) -> list[object]:
        return self.calls + self.requests

    @property
    def is_interactive(self) -> bool:
        """Whether a request waits for this chunk (not only bulk compiles): it goes before bulk compiles."""
        return bool(self.requests) or any(call.interactive for call in self.calls)

    @property
    def is_started(self) -> bool:
        return self.kv is not None

    @property
    def is_done(self) -> bool:
        return self.num_left == 0

    def num_blocks(self, block_size: int) -> int:
        """Blocks ``start`` takes (canonical plus lead)."""
        return sum(prefill_blocks(len(self.token_ids), num_dropped=self.num_dropped, block_size=block_size))

    def start(self, blocks: list[int], cache: KVCache) -> None:
        """Prefill into ``blocks`` (``num_blocks`` of them, taken for it by the KV manager: charged to the chunk's
        namespace, ``options.namespace``)."""
        bs = cache.block_size
        num_canonical, self._num_lead = prefill_blocks(len(self.token_ids), num_dropped=self.num_dropped, block_size=bs)
        assert len(blocks) == self._num_lead + num_canonical, (len(blocks), self._num_lead, num_canonical)
        self.kv = RequestKV(cache, blocks, num_slots=len(blocks) * bs)
        num_kept, lead_end = len(self.token_ids) - self.num_dropped, self._num_lead * bs
        kept_start = len(blocks) * bs - num_kept  # after the front padding
        self._slots = torch.cat(
            (torch.arange(lead_end - self.num_dropped, lead_end), torch.arange(kept_start, kept_start + num_kept))
        )

    def piece(self, max_tokens: int) -> SeqInput:
        """The next ``min(max_tokens, num_left)`` tokens' part of a forward (no hidden states returned)."""
        start, end = self.num_done, self.num_done + min(max_tokens, self.num_left)
        device = self.kv.cache.device
        self.num_done = end
        return SeqInput(
            kv=self.kv,
            token_ids=torch.tensor(self.token_ids[start:end], dtype=torch.long, device=device),
            positions=torch.arange(start, end, device=device),
            slots=self._slots[start:end].to(device),
        )

    def finish(self) -> tuple[ChunkInfo, list[int], list[int]]:
        """After the last piece: the chunk's info, its canonical blocks and its lead blocks (the caller frees those)."""
        assert self.is_done and self.kv is not None
        blocks = self.kv.release().tolist()  # (it holds no chunk blocks: its own, in order)
        kept = torch.tensor(self.token_ids[self.num_dropped :], dtype=torch.long)
        info = ChunkInfo(cache_id=self.cache_id, token_ids=kept, options=self.options)
        return info, blocks[self._num_lead :], blocks[: self._num_lead]

    def abort(self) -> list[int]:
        """The blocks it took, to free (once; then ``[]``)."""
        return [] if self.kv is None else self.kv.release().tolist()

    def __repr__(self) -> str:
        return f"ChunkPrefill({self.cache_id[:12]}, {self.num_done}/{len(self.token_ids)} tokens)"
