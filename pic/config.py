"""Validated, frozen configuration models.

Configs are pydantic models so a typo or an out-of-range value fails at construction with an
``InvalidInputError`` (a ``PicError`` and a ``ValueError``) naming the field and the value, never later
with a KeyError deep inside a forward pass. Numbers are strict: ``"10"`` is not an int, ``True`` is
not a number, and infinities and NaN are refused.
"""

from __future__ import annotations

import difflib
import enum
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pic.errors import InvalidInputError
from pic.redis_url import CLUSTER, SENTINEL, check_single, parse

# Fields whose values an error never echoes.
_SECRET_FIELDS = frozenset({"store_key"})


def describe_validation_error(model: type[BaseModel], exc: ValidationError) -> str:
    """``"field=value: problem; ..."``, suggesting the nearest field name for a misspelled one."""
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        shown = "<secret>" if where in _SECRET_FIELDS else repr(err.get("input"))
        problem = f"{where}={shown}: {err['msg']}" if where else err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            near = difflib.get_close_matches(str(err["loc"][-1]), list(model.model_fields), n=1)
            problem = f"unknown field {where!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
        problems.append(problem)
    return "; ".join(problems)


def as_tuple(value: object) -> object:
    """A list or set given for a tuple field, as a tuple (strict mode accepts only tuples)."""
    return tuple(value) if isinstance(value, (list, set, frozenset)) else value


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise InvalidInputError(
                f"invalid {type(self).__name__}: {describe_validation_error(type(self), exc)}"
            ) from None


class CompileOptions(_Frozen):
    """How a chunk is prefilled; part of its cache id, so chunks compiled differently never mix.

    Attributes:
        add_bos: prefill the chunk after its own BOS token (kept in the cached KV and the linked
            prompt). Ignored when the tokenizer has no BOS token.
        num_extra_bos: extra leading BOS tokens prefilled before the chunk and dropped from the
            cached KV afterwards (EPIC's LegoLink-0); the chunk keeps its compile-time context.
        context: token ids prefilled before the chunk (after the extra BOS tokens) and dropped from the
            cached KV afterwards: *compile in context*. The chunk's KV is then what it is after that
            text (a system prompt, APE's shared prefix) rather than at the start of a sequence.
        namespace: the name of the namespace the chunk belongs to (``pic.namespaces``; ``""``: the default
            one): a label for ownership checks and quotas. The id hashes the namespace's secret salt (or, without
            one, this name), never stored; a chunk read from a shared tier is the namespace's whose salt
            reproduces its id, whatever label it was written with.
    """

    add_bos: bool = True
    num_extra_bos: int = Field(default=0, ge=0, le=64)
    context: tuple[int, ...] = ()
    namespace: str = Field(default="", pattern=r"^([A-Za-z0-9_.-]{1,64})?$")

    _context_tuple = field_validator("context", mode="before")(as_tuple)

    @field_validator("context")
    @classmethod
    def _context_ids(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(t < 0 for t in value):
            raise ValueError("token ids are >= 0")
        return value

    @property
    def num_dropped(self) -> int:
        """Tokens prefilled before the chunk whose KV is not kept (extra BOS tokens and the context)."""
        return self.num_extra_bos + len(self.context)

    def id_fields(self) -> dict[str, object]:
        """The fields a cache id hashes: every one but ``namespace`` (``chunk_id`` hashes the namespace's salt or
        name itself), ``context`` only when there is one (so the ids of chunks compiled without a context are
        those of the versions before it existed)."""
        return self.model_dump(exclude={"namespace"} if self.context else {"context", "namespace"})

    def policy_options(self) -> CompileOptions:
        """These options without a context or a namespace: what a policy needs of a chunk, compared at link time
        (a chunk of a shared namespace, or compiled after a context, still has the BOS tokens a policy needs)."""
        return self.model_copy(update={"context": (), "namespace": ""}) if self.context or self.namespace else self


class AttentionBackendName(enum.StrEnum):
    """An attention backend (``PICConfig.attention_backend``; a backend's ``name``): ``AUTO`` chooses (Triton on CUDA
    when it can run the model, else torch: ``pic.attention.select_backend``)."""

    AUTO = "auto"
    TORCH = "torch"  # pic.attention.torch_backend: torch ops, the CPU's path
    TRITON = "triton"  # pic.attention.triton_backend: the fused-RoPE paged kernel


class DecodeWeights(str, enum.Enum):
    """The weights a decode step's matrix products read (``PICConfig.decode_weights``, ``pic.model.products``)."""

    MODEL = "model"  # the model's own weights and dtype: exact (the default)
    INT8 = "int8"  # int8 copies of the large matrices (fbgemm's dynamic quantization): CPU, float32 or bfloat16 models


class PrefillOrder(str, enum.Enum):
    """Which prefill work a step's token budget goes to first (``PICConfig.prefill_order``)."""

    INTERACTIVE = "interactive"  # links' and generations' recompute passes, then compiles (the default)
    ARRIVAL = "arrival"  # first come first served: a request that arrives during a compile waits for it


class Quota(_Frozen):
    """What one namespace's requests and chunks may take of an engine shared by several (``PICConfig.quotas``).

    Attributes:
        kv_share: the share of the KV pool's blocks its chunks keep against other namespaces: while it holds no
            more than that, another namespace's work never evicts its chunks (its own work evicts its own chunks
            first). Beyond it, its least recently used chunks are evicted for anyone, as without quotas. ``0``
            (the default): no protection.
        store_share: the same for the CPU tier's bytes (the lower tier pic evicts in this process).
        max_num_seqs: the most of its requests that run at once (``None``: ``PICConfig.max_num_seqs``); the others
            wait while other namespaces' requests are admitted.
    """

    kv_share: float = Field(default=0.0, ge=0, le=1)
    store_share: float = Field(default=0.0, ge=0, le=1)
    max_num_seqs: int | None = Field(default=None, ge=1, le=4096)


class PICConfig(_Frozen):
    """Engine configuration.

    Attributes:
        block_size: tokens per KV block. Chunks are front-padded to whole blocks so that a chunk's
            blocks hold the same content in every request.
        add_bos: compile every chunk after its own BOS token (see ``CompileOptions``), and start the
            prompt with one. ``None`` (the default): exactly when the tokenizer writes a BOS into its
            own encodings (``tokenizer("x")`` starts with it), i.e. when the model's prompts start with
            one: Llama and Mistral tokenizers do, ChatML models (SmolLM2, Qwen) do not, so their
            chunks are compiled without one and Full Recompute over ``link_chat`` is the plain chat
            prompt. ``PIC.config`` holds the resolved value.
        kv_pool_tokens: capacity of the paged KV pool in tokens (rounded up to whole blocks). The pool
            holds the live requests' blocks and the resident compiled chunks (the store's device
            tier): one budget. ``None``: on CUDA, ``kv_memory_fraction`` of the device's free memory
            once the model is loaded; elsewhere 65536 tokens, at most a quarter of the available memory.
        kv_memory_fraction: the share of the free CUDA memory the default pool takes (the rest is
            left for activations); ignored when ``kv_pool_tokens`` is given or on the CPU.
        share_chunk_blocks: map the clean blocks of a linked chunk into the request without copying
            them (one physical copy serves every live request; only blocks holding recomputed tokens
            are copied). ``False`` gives each request its own copy of all its chunk blocks, as the
            EPIC and CacheBlend papers ran their baselines.
        eos_token_ids: token ids that end a generation; ``None`` takes the model's generation
            config (and the tokenizer's EOS).
        default_policy: the recompute policy ``link`` uses when none is given: ``auto`` (pic's own: the chunks in
            relevance order, the most relevant recomputed whole, at least 5% of the chunk tokens, within half of
            them; docs/policies.md).
        max_num_seqs: most requests the engine runs at once (one decode token each per step).
        max_num_batched_tokens: the token budget of one engine step (vLLM's): one token per running request,
            then recompute passes and chunk-prefill pieces (a compile's chunks run in pieces of what is left,
            so running streams wait at most a step's worth), and so does a static policy's recompute pass; one
            that cannot be split (a dynamic policy's, a probe) runs in a step with no other prefill work.
            ``None``: 8192 on CUDA, 256 on the CPU, where a step's time grows with its tokens (what a budget does
            to streams' gaps during a compile: docs/engine.md#scheduling-compiles-and-store-io). ``PIC.config``
            holds the resolved value.
        prefill_order: ``"interactive"`` (the default): each step's budget goes to the recompute passes of links
            and generations first, and compile prefills take what they leave, so a request that arrives during
            a bulk compile waits a step, not the compile (docs/engine.md). ``"arrival"``: first come first
            served, compiles and requests alike.
        compile_share: under ``"interactive"``, the share of each step's budget that waiting compile prefills
            get however many requests wait, so a stream of new requests slows a compile but never stops it
            (0: compiles only get what requests leave).
        attention_backend: ``"auto"``: the Triton fused-RoPE kernel on CUDA (when Triton is installed),
            the torch backend elsewhere; ``"torch"`` or ``"triton"`` force one (``"triton"`` on the CPU
            runs Triton's interpreter, for tests: ``TRITON_INTERPRET=1`` before Triton is imported).
        decode_weights: ``"model"`` (the default): every product reads the model's own weights, exactly.
            ``"int8"``: decode steps (and their LM head) read int8 copies of the large matrices, made when the
            engine is built (about a quarter more weight memory), for decode steps of up to 4 sequences; not exact, a
            float32 or bfloat16 model on the CPU only. Prompts, compiles and every first token stay exact, so cache
            ids do not change (``pic.model.products``; speed and accuracy in docs/cpu.md).
        cuda_graphs: replay the forwards of few rows (decode steps, a link's query pass: 64 rows at most) from CUDA
            graphs captured per bucket of rows and slots (``pic.model.graphs``). ``None`` (the default): on for a CUDA
            model on the Triton backend, off elsewhere; ``True``: on, and an error where they cannot run; ``False``:
            off. What they gained on an H200: docs/gpu.md#the-third-run-an-nvidia-h200-2026-11-28.
        quotas: namespace name -> its ``Quota`` (``pic.namespaces``; a namespace without one has none): shares of
            the KV pool and the CPU tier its chunks keep, and the requests it runs at once. Waiting requests of
            different namespaces are admitted in turn (round robin), so one namespace's many requests cannot hold
            another's first token. The ``kv_share``s and ``store_share``s each sum to at most 1.
    """

    block_size: int = Field(default=16, ge=1, le=4096)
    add_bos: bool | None = None
    kv_pool_tokens: int | None = Field(default=None, ge=1)
    kv_memory_fraction: float = Field(default=0.8, gt=0, le=1)
    share_chunk_blocks: bool = True
    eos_token_ids: tuple[int, ...] | None = None
    default_policy: str = "auto"
    max_num_seqs: int = Field(default=64, ge=1, le=4096)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    prefill_order: PrefillOrder = PrefillOrder.INTERACTIVE
    compile_share: float = Field(default=0.125, ge=0, lt=1)
    attention_backend: AttentionBackendName = AttentionBackendName.AUTO
    decode_weights: DecodeWeights = DecodeWeights.MODEL
    cuda_graphs: bool | None = None
    quotas: dict[str, Quota] = Field(default_factory=dict)

    _eos_tuple = field_validator("eos_token_ids", mode="before")(as_tuple)

    @field_validator("decode_weights", "prefill_order", "attention_backend", mode="before")
    @classmethod
    def _enum_name(cls, value: object, info) -> object:
        kind = {"decode_weights": DecodeWeights, "prefill_order": PrefillOrder}.get(
            info.field_name, AttentionBackendName
        )
        if isinstance(value, str) and not isinstance(value, kind):
            names = [w.value for w in kind]
            if value not in names:
                raise ValueError(f"{value!r} is not one of {names}")
            return kind(value)
        return value

    @field_validator("quotas")
    @classmethod
    def _quotas(cls, value: dict[str, Quota]) -> dict[str, Quota]:
        from pic.namespaces import NAME_PATTERN

        bad = next((name for name in value if not re.match(NAME_PATTERN, name)), None)
        if bad is not None:
            raise ValueError(f"namespace name {bad!r:.80} is not 1 to 64 of A-Z a-z 0-9 _ . -")
        for share in ("kv_share", "store_share"):
            total = sum(getattr(q, share) for q in value.values())
            if total > 1 + 1e-9:
                raise ValueError(f"the namespaces' {share}s sum to {total:g}, more than 1")
        return value

    @field_validator("eos_token_ids")
    @classmethod
    def _eos_nonnegative(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is not None and any(t < 0 for t in value):
            raise ValueError("token ids are >= 0")
        return value


class StoreConfig(_Frozen):
    """Where compiled chunks live: tiers from fastest to most shared.

    Attributes:
        cpu_bytes: capacity of the CPU tier (page-locked when CUDA is available, so copies to the
            GPU are asynchronous); ``0`` (default): no CPU tier; ``None``: unbounded. More than the physical
            memory of the machine that loads the engine is refused there (``InvalidInputError``).
        disk_path: a directory on a local disk where compiled chunks are kept as files (under a folder per
            model), so they survive a restart and are shared by the processes of one machine that name the
            same directory; ``None`` (default): no disk tier. Set ``disk_bytes`` with it.
        disk_bytes: the disk tier's capacity in bytes of chunk files; least recently used files are
            evicted (by whichever process writes) to stay within it.
        on_disk_error: as ``on_redis_error``, for a disk that fails (full, read-only, I/O errors).
        redis_url: a Redis shared by a fleet of workers (``redis://``, ``rediss://`` or ``unix://``,
            with a password as redis-py takes it; a Redis Cluster as
            ``redis-cluster://[:password@]host:port[,host:port...]``; a Sentinel-managed master as
            ``redis-sentinel://[:password@]host:port[,host:port...]/service_name``; a password is
            URL-quoted); ``None``: no Redis tier.
        redis_read_from_replicas: a cluster or sentinel setup also serves reads from replicas, which
            spreads the read load but may lag (a fresh chunk can read as a miss there, never a wrong one).
        namespace: prefix of every Redis key; keys also carry the model fingerprint, so two models
            never read each other's chunks.
        on_redis_error: ``"raise"``: an unreachable Redis is a ``StoreUnavailableError`` naming the
            URL; ``"miss"``: it is logged and the chunk is looked for in the upper tiers only.
        part_bytes: the KV payload is stored in parts of at most this many bytes (Redis refuses
            values over 512 MiB; redis-py reads 8 MiB values faster per byte than values of
            hundreds of MiB: ``benchmarks/store.py``, docs/store.md#a-fleet-on-one-redis-a-redis-cluster-or-sentinel).
        redis_timeout_s: socket timeout of Redis calls.
        tier_retry_s: a lower tier that failed (Redis timing out or refusing connections; a disk tier whose
            writes fail: full, read-only) is not called again for this many seconds: its calls fail at once
            (``"raise"``) or miss (``"miss"``), so a stall costs one timeout, not one per call. Then one call
            tries it again (a circuit breaker: ``pic.store.breaker``). Chunks a ``"miss"`` tier failed to take
            are written to it once it works again, if still resident in the pool.
        redis_parts_ttl_s: a chunk's parts are written with this time to live, cleared once its metadata
            lands: a writer that dies mid-write leaves nothing behind after it. Must exceed the time to
            write one chunk (a part that expires first makes that write store nothing).
        redis_lease_s: how long a worker's lease on a chunk it compiles lives without renewal (renewed
            while it compiles): a worker that dies mid-compile delays the fleet's others by at most this.
        store_key: the fleet's store key (at least 16 bytes; ``None``: none). With it, every chunk written to a shared
            tier (disk, Redis) carries a keyed MAC over its metadata and KV, and an entry whose MAC does not match
            (forged, altered, of another fleet, or written without the key) is a logged miss, never served. Without
            it the shared tiers are trusted as they are. Never shown in ``repr`` or an error.
        shared_recheck_s: a link of a chunk resident in the pool checks, at most once per this many seconds
            per chunk, that the shared tier (Redis) still holds it (one ``EXISTS``), and writes it back if
            not (Redis restarted without persistence, or the chunk was compiled while it was down under
            ``"miss"``), so the fleet gets its copy back without a ``compile``. A failure is logged, never
            the link's. ``0``: at every link; ``None``: never (``compile`` of the document still writes
            it back).

    The device tier is the KV pool itself (``PICConfig.kv_pool_tokens``): compiled chunks are resident
    there as canonical blocks, evicted least recently used first when requests need the blocks. The CPU
    and disk tiers evict least-recently-used chunks that are not pinned; a chunk evicted from one tier stays
    in the tiers below it. Without a lower tier, an evicted chunk is gone: ``compile`` it again.
    """

    cpu_bytes: int | None = Field(default=0, ge=0)
    disk_path: str | None = Field(default=None, min_length=1)
    disk_bytes: int | None = Field(default=None, ge=1)
    on_disk_error: Literal["raise", "miss"] = "raise"
    redis_url: str | None = Field(default=None, pattern=r"^(redis|rediss|unix|redis-cluster|redis-sentinel)://")
    redis_read_from_replicas: bool = False
    namespace: str = Field(default="pic", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    on_redis_error: Literal["raise", "miss"] = "raise"
    part_bytes: int = Field(default=8 * 2**20, ge=1, le=512 * 2**20)
    redis_timeout_s: float = Field(default=10.0, gt=0)
    tier_retry_s: float = Field(default=5.0, gt=0, le=3600)
    redis_parts_ttl_s: float = Field(default=60.0, ge=0.001, le=7 * 24 * 3600)
    redis_lease_s: float = Field(default=10.0, ge=0.1, le=3600)
    shared_recheck_s: float | None = Field(default=30.0, ge=0)
    store_key: bytes | None = Field(default=None, min_length=16, max_length=4096, repr=False)

    @model_validator(mode="after")
    def _disk_bytes_with_path(self) -> StoreConfig:
        """A disk tier needs a bound: an unbounded cache would fill the disk it shares with everything else."""
        if (self.disk_path is None) != (self.disk_bytes is None):
            given = f"disk_path={self.disk_path!r}" if self.disk_path is not None else f"disk_bytes={self.disk_bytes}"
            raise ValueError(f"{given} needs {'disk_bytes' if self.disk_path else 'disk_path'} too")
        return self

    @model_validator(mode="after")
    def _parse_redis_url(self) -> StoreConfig:
        """Check a Redis URL now, not when the engine first connects. An "after" check
        reports only its message, which masks the password (a field check would echo the raw URL)."""
        url = self.redis_url
        if url is not None and not url.startswith("unix://"):
            try:
                parse(url) if url.startswith((f"{CLUSTER}://", f"{SENTINEL}://")) else check_single(url)
            except InvalidInputError as exc:
                raise ValueError(str(exc)) from None
        return self
