"""The model runner: a layer-by-layer forward over a Hugging Face model's own modules, for a batch.

It differs from ``model.forward`` in four ways that make position-independent caching and batching
possible: tokens come with explicit logical positions and KV slots (so a pass may run any subset of
a request's tokens), several sequences run in one forward (their tokens concatenated, each attending
over its own paged KV), K is written to the pool *before* RoPE, and attention rotates Q and K
inside (``pic.attention``) with an exact causal mask by position. Run over every token of a prompt it
computes exactly what transformers computes; the tests hold it to that.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch
from torch import nn

from pic.attention import AttentionBackend, AttentionBatch, AttentionShape, RopeTable, make_batch, select_backend
from pic.config import AttentionBackendName, DecodeWeights
from pic.errors import InvalidInputError
from pic.kv import KVCache
from pic.model.graphs import GraphedForwards
from pic.model.inputs import AttentionObserver, ForwardObserver, LayerView, SeqInput
from pic.model.norm import norm_eps, rms_norm
from pic.model.products import INT8_MAX_ROWS, FloatProducts, model_products, products_for
from pic.model.spec import ModelSpec, inspect_model
from pic.model.stacked import stack_layers

_NO_OBSERVER = contextlib.nullcontext()  # (reusable: a layer's context when no forward observer is set)


class ModelRunner:
    """Runs a supported HF causal LM over paged NoPE KV, many sequences per forward.

    Args:
        model: a supported transformers causal LM (``inspect_model``).
        attention_backend: an ``AttentionBackendName`` or its value, ``"auto"``, ``"torch"`` or ``"triton"``
            (``select_backend``).
        decode_weights: what decode steps' matrix products read (``pic.model.products``): the model's own weights
            (exact), or int8 copies (CPU), with which decoding tokens also attend over a float16 copy of their K and
            V (the torch backend's ``decode_kv_dtype``). Every other forward runs the model's own.

    Attributes:
        attention_backend: the backend chosen (its ``name`` says which); every forward plans it once
            and every layer attends and stores through it.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        attention_backend: AttentionBackendName | str = AttentionBackendName.AUTO,
        decode_weights: DecodeWeights = DecodeWeights.MODEL,
    ) -> None:
        self.spec: ModelSpec = inspect_model(model)
        self.model = model.eval()
        inner = model.model
        self._embed = inner.embed_tokens
        self._layers = inner.layers
        self._norm = inner.norm
        self._lm_head = model.lm_head
        spec = self.spec
        self.rope = RopeTable(inner.rotary_emb, max_positions=spec.max_context, dtype=spec.dtype, device=spec.device)
        shape = AttentionShape(
            num_q_heads=spec.num_q_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            dtype=spec.dtype,
            sliding_windows=spec.sliding_windows,
        )
        self.attention_backend: AttentionBackend = select_backend(
            attention_backend, shape, device=spec.device, rope=self.rope,
            decode_kv_dtype=torch.float16 if decode_weights == DecodeWeights.INT8 else None,
        )  # fmt: skip
        self._observer: AttentionObserver | None = None
        self._forwards: ForwardObserver | None = None
        # q/k/v and gate/up as one product each; every Llama-form RMSNorm as one operation (``pic.model.norm``).
        self._float = model_products(self._layers, self._lm_head, stack_layers(self._layers))
        modules = [self._norm, *self._layers.modules()]
        self._norm_eps = {id(m): eps for m in modules if (eps := norm_eps(m)) is not None}
        self._decode = products_for(decode_weights, self._layers, self._lm_head, model=self._float)
        self.graphed: GraphedForwards | None = None

    def graphs_refused(self, *, capture: bool = True) -> str | None:
        """Why this runner cannot serve forwards through graphs (``use_graphs``), or ``None`` if it can."""
        if capture and self.spec.device.type != "cuda":
            return f"CUDA graphs need a CUDA model; this one is on {self.spec.device}"
        if self.attention_backend.name is not AttentionBackendName.TRITON:
            return (
                f"graphs replay the Triton backend's launches; this engine attends with '{self.attention_backend.name}'"
                " (attention_backend='triton')"
            )
        return None

    def use_graphs(self, *, capture: bool) -> GraphedForwards:
        """Serve the forwards of few rows through per-bucket graphs from now on (``pic.model.graphs``): captured
        CUDA graphs (``capture``, a CUDA runner), or their eager body on the same buffers (the CPU's check)."""
        if (why := self.graphs_refused(capture=capture)) is not None:
            raise InvalidInputError(why)
        self.graphed = GraphedForwards(self, capture=capture)
        return self.graphed

    @contextlib.contextmanager
    def observe_attention(self, observer: AttentionObserver) -> Iterator[None]:
        """Within the block, every layer of every forward calls ``observer`` with its attention's inputs
        (after its K and V are written), for analysis such as ``pic.evaluation.sinks``; serving never
        sets one. Not reentrant; restored on exit."""
        assert self._observer is None, "an attention observer is already installed"
        self._observer = observer
        try:
            yield
        finally:
            self._observer = None

    @contextlib.contextmanager
    def observe_forwards(self, observer: ForwardObserver) -> Iterator[None]:
        """Within the block, every forward runs inside ``observer.forward(seqs)`` and each of its layers inside
        ``observer.layer(index)`` (counters: ``pic.model.op_count``); forwards run eagerly (no CUDA graph replay)
        while one is set. Not reentrant; restored on exit."""
        assert self._forwards is None, "a forward observer is already installed"
        self._forwards = observer
        try:
            yield
        finally:
            self._forwards = None

    @torch.no_grad()
    def forward(self, seqs: Sequence[SeqInput]) -> list[torch.Tensor]:
        """Run the sequences' tokens through every layer in one batch, writing their K (NoPE) and V.

        Returns:
            per sequence, ``[m, hidden_size]``: the final (normed) hidden states of its ``output_rows``
            (``m = 0`` without). ``logits`` turns the rows to sample into logits.
        """
        forwards = self._forwards
        if forwards is None:
            return self._forward(seqs, None)
        with forwards.forward(seqs):
            return self._forward(seqs, forwards)

    def _forward(self, seqs: Sequence[SeqInput], forwards: ForwardObserver | None) -> list[torch.Tensor]:
        for seq in seqs:
            seq.kv.kv_positions[seq.slots] = seq.positions
        eager = self._observer is not None or forwards is not None
        bucket = self.graphed.bucket(seqs) if self.graphed is not None and not eager else None
        if bucket is not None:
            return self.graphed.forward(seqs, bucket)
        lens = [s.token_ids.shape[0] for s in seqs]
        starts = torch.tensor([0, *lens[:-1]]).cumsum(0).tolist()  # each sequence's first token in the batch
        positions = torch.cat([s.positions for s in seqs])  # [N]
        rows = torch.cat([s.kv.physical(s.slots) for s in seqs])  # [N] cache rows written
        alive = torch.arange(positions.shape[0], device=positions.device)  # [N'] tokens still running
        batch = self._batch(seqs, positions, lens)
        plan = self.attention_backend.plan(batch)  # once per forward, shared by every layer
        hidden = self._embed(torch.cat([s.token_ids for s in seqs]))  # [N, hidden_size]
        hooked = any(s.after_layer is not None for s in seqs)
        cache = seqs[0].kv.cache
        products = self._decode_products(len(seqs)) if all(s.decode for s in seqs) else self._float
        for index, layer in enumerate(self._layers):
            with forwards.layer(index) if forwards is not None else _NO_OBSERVER:
                hidden, q = self._layer(index, layer, hidden, cache, batch, plan, rows, products)
            if hooked:
                view = LayerView(
                    layer=index, alive=alive, rows=rows, q=q, k_cache=cache.k[index],
                    scaling=layer.self_attn.scaling, sliding_window=self.spec.sliding_windows[index], rope=self.rope,
                )  # fmt: skip
                keep = self._keep(view, seqs, starts, lens)
            else:
                keep = None
            if keep is not None:  # tokens dropped (CacheBlend, a probe's query): later layers attend for fewer
                hidden, positions, rows, alive = hidden[keep], positions[keep], rows[keep], alive[keep]
                lens = torch.stack([k.sum() for k in keep.split(lens)]).tolist()  # one host sync
                if not any(lens):  # (every token left: no sequence returns a row)
                    break
                batch = self._batch(seqs, positions, lens)
                plan = self.attention_backend.plan(batch)
        num_tokens = sum(s.token_ids.shape[0] for s in seqs)
        return [self._outputs(seq, start, hidden, alive, num_tokens) for seq, start in zip(seqs, starts, strict=True)]

    @torch.no_grad()
    def forward_rows(
        self,
        token_ids: torch.Tensor,
        rows: torch.Tensor,
        cache: KVCache,
        batch: AttentionBatch,
        plan: object,
        *,
        decode: bool,
    ) -> torch.Tensor:
        """Every layer over ``token_ids`` ``[R]`` int64, their K and V written to cache ``rows`` ``[R]`` int64 (``-1``:
        none, on the Triton backend), attending by ``plan`` (the backend's plan of ``batch``): no hook, no observer,
        every row kept; ``decode``: a decode step's products. Returns the final normed hidden states
        ``[R, hidden_size]``. What a CUDA graph replays (``pic.model.graphs``): tensors in, tensors out."""
        hidden = self._embed(token_ids)
        products = self._decode_products(token_ids.shape[0]) if decode else self._float
        for index, layer in enumerate(self._layers):
            hidden, _ = self._layer(index, layer, hidden, cache, batch, plan, rows, products)
        return self._normed(self._norm, hidden)

    def logits(self, hidden: torch.Tensor, *, decode: bool = False) -> torch.Tensor:
        """``[m, hidden_size]`` final hidden states -> ``[m, vocab_size]`` float32 logits; ``decode``: every row
        follows a decode step (the LM head reads what decode steps read)."""
        products = self._decode_products(hidden.shape[0]) if decode else self._float
        with torch.no_grad():
            return products.linear(self._lm_head, hidden).float()

    def _decode_products(self, num_rows: int) -> FloatProducts:
        """A decode step's products: int8 copies for ``INT8_MAX_ROWS`` sequences at most, the others' beyond."""
        return self._decode if num_rows <= INT8_MAX_ROWS else self._float

    def _outputs(
        self, seq: SeqInput, start: int, hidden: torch.Tensor, alive: torch.Tensor, alive_all: int
    ) -> torch.Tensor:
        if seq.output_rows is None or not seq.output_rows.numel():
            return hidden[:0]
        wanted = seq.output_rows + start
        if alive.shape[0] == alive_all:  # nothing was dropped: no search, no host sync
            return self._normed(self._norm, hidden[wanted])
        picked = torch.searchsorted(alive, wanted).clamp(max=alive.shape[0] - 1)
        assert torch.equal(alive[picked], wanted), "an output row was dropped from the pass"
        return self._normed(self._norm, hidden[picked])

    def _normed(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``norm(x)``: one ``pic::rms_norm`` for a Llama-form RMSNorm (the same arithmetic), the module otherwise."""
        eps = self._norm_eps.get(id(norm))
        return norm(x) if eps is None else rms_norm(x, norm.weight, eps)

    def _keep(
        self, view: LayerView, seqs: Sequence[SeqInput], starts: list[int], lens: list[int]
    ) -> torch.Tensor | None:
        """``[N']`` bool, the tokens that run the next layer (every hooked sequence asked, ``view`` being the
        whole batch's), or ``None``. One host sync when a hook answered (whether anything was dropped), none
        otherwise."""
        parts, asked = [], []
        pieces = zip(seqs, starts, view.alive.split(lens), view.rows.split(lens), view.q.split(lens), strict=True)
        for seq, start, alive_b, rows_b, q_b in pieces:
            if seq.after_layer is None:
                keep_b = None
            else:
                keep_b = seq.after_layer(replace(view, alive=alive_b - start, rows=rows_b, q=q_b))
            if keep_b is None:
                keep_b = torch.ones_like(alive_b, dtype=torch.bool)
            else:
                asked.append(keep_b.all())
            parts.append(keep_b)
        if not asked or bool(torch.stack(asked).all()):
            return None
        return torch.cat(parts)

    def _batch(self, seqs: Sequence[SeqInput], positions: torch.Tensor, lens: list[int]) -> AttentionBatch:
        """The forward's attention batch: the sequences' tables and slot positions, ``positions`` ``[N]`` int64
        of the tokens running, ``lens`` of them per sequence."""
        return make_batch(
            block_tables=[s.kv.block_table for s in seqs],
            kv_positions=[s.kv.kv_positions for s in seqs],
            q_positions=positions,
            seq_lens=lens,
            rope=self.rope,
            scratch=[s.kv.scratch for s in seqs],
            context=[s.kv.context for s in seqs],
            decoding=[s.decode for s in seqs],
        )

    def _layer(
        self,
        index: int,
        layer: nn.Module,
        hidden: torch.Tensor,
        cache: KVCache,
        batch: AttentionBatch,
        plan: object,
        rows: torch.Tensor,
        products: FloatProducts,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer; ``hidden`` ``[N, hidden_size]``, ``rows`` ``[N]`` cache rows to write, ``plan``
        the backend's plan of ``batch``, ``products`` its matrix products. Returns the new hidden states and the
        layer's NoPE queries ``[N, num_q_heads, head_dim]``."""
        attn = layer.self_attn
        num_tokens, head_dim = hidden.shape[0], self.spec.head_dim
        x = self._normed(layer.input_layernorm, hidden)
        q, k, v = products.qkv(attn, x)
        q = q.view(num_tokens, -1, head_dim)  # [N, Hq, D]
        k = k.view(num_tokens, -1, head_dim)  # [N, Hkv, D]
        v = v.view(num_tokens, -1, head_dim)  # [N, Hkv, D]
        if self.spec.has_qk_norm:
            q, k = self._normed(attn.q_norm, q), self._normed(attn.k_norm, k)
        backend = self.attention_backend
        backend.store(cache.k_rows[index], cache.v_rows[index], rows, k, v)
        window = self.spec.sliding_windows[index]
        if self._observer is not None:
            self._observer(index, q, cache.k[index], batch, attn.scaling, window)
        out = backend.attend(q, cache.k[index], cache.v[index], plan, scaling=attn.scaling, sliding_window=window)
        hidden = products.linear(attn.o_proj, out.reshape(num_tokens, -1), residual=hidden)
        return products.mlp(layer.mlp, self._normed(layer.post_attention_layernorm, hidden), residual=hidden), q
