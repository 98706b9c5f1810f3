"""int8 decode weights (``PICConfig.decode_weights="int8"``, ``pic.model.products``): decode steps read int8 copies
of the large matrices; compiles, links and every first token stay exact, so cache ids and prompt logits do not
change; the int8 products stay close to the float ones; bad uses fail clearly."""

from __future__ import annotations

import copy

import pytest
import torch

import pic
from pic.check import check
from pic.config import DecodeWeights
from pic.model import ModelRunner
from pic.model.products import INT8_MAX_ROWS, FloatProducts, Int8Products
from tests.conftest import make_engine
from tests.smollm2 import DOCS, QUERY, smollm2, variant  # noqa: F401  (the session fixture)


class _GatedMLP(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # Llama's MLP
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _linears(*shapes: tuple[int, int], bias: bool) -> tuple[torch.nn.ModuleList, torch.nn.Linear]:
    """A stand-in model for ``Int8Products``: one layer whose projections and MLP have the given ``(out, in)``
    shapes (q, k, v, o, gate, up, down in that order), and an LM head of the first shape."""
    torch.manual_seed(0)
    q, k, v, o, gate, up, down = (torch.nn.Linear(i, out, bias=bias) for out, i in shapes)
    attn = torch.nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj = q, k, v, o
    mlp = _GatedMLP()
    mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn = gate, up, down, torch.nn.SiLU()
    layer = torch.nn.Module()
    layer.self_attn, layer.mlp = attn, mlp
    return torch.nn.ModuleList([layer]), torch.nn.Linear(shapes[0][1], shapes[0][0], bias=False)


def test_int8_products_are_close_to_float_and_small_matrices_stay_float():
    shapes = ((640, 512), (128, 512), (128, 512), (512, 640), (1024, 512), (1024, 512), (512, 1024))  # q k v o g u d
    layers, lm_head = _linears(*shapes, bias=True)
    int8, exact = Int8Products(layers, lm_head), FloatProducts()
    attn, mlp = layers[0].self_attn, layers[0].mlp
    x = torch.randn(3, 512)
    with torch.no_grad():
        assert torch.equal(int8.linear(attn.k_proj, x), attn.k_proj(x))  # k alone is not packed: its float product
        pairs = [(exact.qkv(attn, x), int8.qkv(attn, x)), ((exact.mlp(mlp, x),), (int8.mlp(mlp, x),))]
        pairs += [
            ((exact.linear(m, i),), (int8.linear(m, i),))
            for m, i in ((lm_head, x), (attn.o_proj, x.repeat(1, 2)[:, :640]))
        ]
        for wants, gots in pairs:
            for want, got in zip(wants, gots, strict=True):
                assert got.shape == want.shape and not torch.equal(got, want)  # an int8 product ran
                assert (got - want).abs().max() <= 0.05 * want.abs().max()
    # The LM head, q k v packed together (896 x 512), o, gate and up together, down: a byte per weight.
    assert int8.num_bytes == 640 * 512 + 896 * 512 + 512 * 640 + 2048 * 512 + 512 * 1024
    small = ((64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (128, 64), (64, 128))
    layers, lm_head = _linears(*small, bias=False)
    tiny = Int8Products(layers, lm_head)  # nothing reaches INT8_MIN_WEIGHTS: every product is the float one
    x = torch.randn(2, 64)
    with torch.no_grad():
        attn = layers[0].self_attn
        assert all(torch.equal(a, b) for a, b in zip(tiny.qkv(attn, x), exact.qkv(attn, x), strict=True))
        assert torch.equal(tiny.mlp(layers[0].mlp, x), layers[0].mlp(x)) and tiny.num_bytes == 0


def test_int8_decode_weights_need_a_float32_or_bfloat16_cpu_model_and_a_known_name():
    with pytest.raises(pic.PicError, match="decode_weights='int4'"):
        pic.PICConfig(decode_weights="int4")
    engine = make_engine("llama")
    model = copy.deepcopy(engine.model).to(torch.float16)  # (a copy: the fixture's model is shared)
    with pytest.raises(pic.InvalidInputError, match="float32 or bfloat16 model on the CPU.*torch.float16"):
        pic.PIC(model, engine.tokenizer, config=pic.PICConfig(decode_weights="int8"))
    model.to(torch.bfloat16)  # issue 55: a bfloat16 model's decode steps read int8 copies too
    exact = pic.PIC(model, engine.tokenizer)
    fast = pic.PIC(model, engine.tokenizer, config=pic.PICConfig(decode_weights="int8"))
    ids = exact.compile(list(DOCS))
    first, out = exact.link(ids, QUERY).generate(8), fast.link(fast.compile(list(DOCS)), QUERY).generate(8)
    assert out.token_ids[0] == first.token_ids[0] and len(out.token_ids) == 8  # the link is exact
    odd = torch.nn.ModuleList([torch.nn.Module()])
    odd[0].self_attn, odd[0].mlp = torch.nn.Module(), torch.nn.Linear(2, 2)
    with pytest.raises(pic.UnsupportedModelError, match="gated MLPs.*Linear"):
        Int8Products(odd, torch.nn.Linear(4, 4))


@pytest.fixture
def int8_rows(monkeypatch) -> list[int]:
    """The rows of every int8 product the test's engines run (``Int8Products._run`` spied on)."""
    calls: list[int] = []
    run = Int8Products._run
    monkeypatch.setattr(Int8Products, "_run", lambda self, m, x: calls.append(x.shape[0]) or run(self, m, x))
    return calls


def test_int8_decode_keeps_the_link_exact_and_only_decode_steps_read_int8(smollm2, int8_rows):  # noqa: F811
    calls = int8_rows
    fast = variant(smollm2, decode_weights="int8")
    ids = fast.compile(list(DOCS))
    assert ids == smollm2.compile(list(DOCS))  # the same KV, so the same cache ids
    with smollm2.link(ids, QUERY, policy="full") as exact:
        want = exact.logits
        exact_tokens = exact.generate(max_new_tokens=8).token_ids
    with fast.link(ids, QUERY, policy="full") as linked:
        assert torch.equal(linked.logits, want)  # compile and link ran the float products
        assert not calls
        tokens = linked.generate(max_new_tokens=8).token_ids
    assert tokens[0] == exact_tokens[0]  # the first token is the exact link's
    # Every decode step after the first token: 4 int8 products in each of the 30 layers (q k v packed together, o,
    # gate and up together, down) and the LM head, one row each.
    num_steps = len(tokens) - 1
    assert num_steps >= 1, tokens
    assert len(calls) == num_steps * (30 * 4 + 1) and set(calls) == {1}


def test_int8_decode_reads_int8_only_in_small_batches(smollm2, int8_rows):  # noqa: F811
    """Issue 55: decode steps of more than ``INT8_MAX_ROWS`` sequences read the model's weights (int8 lost there)."""
    calls = int8_rows
    fast = variant(smollm2, decode_weights="int8")
    ids = fast.compile(list(DOCS))
    pic.generate_together([fast.link(ids, QUERY) for _ in range(INT8_MAX_ROWS + 2)], 4)
    assert not calls  # every step decoded 6 sequences together
    pic.generate_together([fast.link(ids, QUERY) for _ in range(2)], 4)
    assert calls and set(calls) == {2}


def test_int8_logits_are_close_to_float(smollm2):  # noqa: F811
    runner = ModelRunner(smollm2.model, decode_weights=DecodeWeights.INT8)
    hidden = torch.randn(4, smollm2.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    near, far = runner.logits(hidden, decode=True), runner.logits(hidden)
    assert not torch.equal(near, far)
    assert (near - far).abs().max() <= 0.05 * far.abs().max()  # 2.1-3.4% on five seeds (7-bit activations)
    assert torch.equal(near.argmax(-1), far.argmax(-1))


def test_check_passes_with_int8_decode_and_says_so(smollm2):  # noqa: F811
    result = check(variant(smollm2, decode_weights="int8"))
    assert result.passed and result.int8_decode, result.message
    assert "int8 decode weights" in result.message


def test_a_bfloat16_cpu_model_runs_packed_weights_bit_for_bit():
    """Issue 55: a bfloat16 model's products read oneDNN weights packed once (``PackedProducts``): the same values
    as its modules, bit for bit, in every forward (the same kernel without the per-call reorder); float32 keeps
    its modules (packing gained nothing there)."""
    from pic.model.products import FloatProducts, PackedProducts, model_products

    model = copy.deepcopy(make_engine("qwen2").model).to(torch.bfloat16)  # q/k/v with biases
    layers, head = model.model.layers, model.lm_head
    packed = model_products(layers, head)
    assert isinstance(packed, PackedProducts) and packed.num_bytes > 0
    wide = make_engine("qwen2").model
    assert type(model_products(wide.model.layers, wide.lm_head)) is FloatProducts
    torch.manual_seed(0)
    for rows in (1, 7, 300):
        x = torch.randn(rows, model.config.hidden_size, dtype=torch.bfloat16)
        with torch.no_grad():
            attn, mlp = layers[0].self_attn, layers[0].mlp
            assert all(
                torch.equal(a, b) for a, b in zip(packed.qkv(attn, x), FloatProducts().qkv(attn, x), strict=True)
            )
            assert torch.equal(packed.mlp(mlp, x), mlp(x))
            assert torch.equal(packed.linear(head, x), head(x))
    exact = pic.PIC(model, make_engine("qwen2").tokenizer)
    ids = exact.compile(list(DOCS))
    assert exact.link(ids, QUERY).generate(4).stats.num_generated_tokens == 4
