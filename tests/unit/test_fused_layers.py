"""Fused decoder layers (models/layers.py) == the eager per-projection formulation, bit for bit on
CPU; fused buffers stay views of the released parameters through .to() and loads."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from q3tts.config import DecoderLayerConfig
from q3tts.kernels.reference import rotary_ref
from q3tts.models.attention import DecodeContext, PagedKVCache, PrefillContext
from q3tts.models.layers import DecoderStack, _is_fused, rope_cos_sin, rope_tables


def _eager(stack: DecoderStack, x, positions, attn):
    """The pre-fusion forward: separate q/k/v and gate/up GEMMs, eager adds, per-call RoPE."""
    cos, sin = rope_cos_sin(positions, stack.cfg.head_dim, stack.cfg.rope_theta, x.dtype)
    for layer in stack.layers:
        a, m = layer.self_attn, layer.mlp
        h_in = layer.input_layernorm(x)
        n = h_in.shape[0]
        q = a.q_norm(a.q_proj(h_in).view(n, a.num_heads, a.head_dim))
        k = a.k_norm(a.k_proj(h_in).view(n, a.num_kv_heads, a.head_dim))
        v = a.v_proj(h_in).view(n, a.num_kv_heads, a.head_dim)
        out = attn.attend(a.layer_idx, rotary_ref(q, cos, sin), rotary_ref(k, cos, sin), v)
        h = x + a.o_proj(out.reshape(n, -1))
        hn = layer.post_attention_layernorm(h)
        x = h + m.down_proj(F.silu(m.gate_proj(hn)) * m.up_proj(hn))
    return stack.norm(x)


def _stack(dtype, h=64, inter=128, heads=4, kv=2, hd=16, layers=2):
    torch.manual_seed(0)
    stack = DecoderStack(DecoderLayerConfig(h, inter, layers, heads, kv, hd, 1e-6, 1e6), 256)
    with torch.no_grad():
        for p in stack.parameters():
            noise = torch.randn_like(p) * 0.05
            p.copy_(noise + 1.0 if p.dim() == 1 else noise)
    return stack.to(dtype).eval().fuse_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 9])
def test_fused_equals_eager(dtype, rows):
    stack = _stack(dtype)
    cfg = stack.cfg
    x = torch.randn(rows, cfg.hidden_size).to(dtype)
    xb = torch.randn(3, cfg.hidden_size).to(dtype)
    outs = []
    for fwd in (_eager, lambda s, *a: s(*a)):
        cache = PagedKVCache(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, dtype)
        with torch.no_grad():
            outs.append(fwd(stack, x, torch.arange(rows) + 5,
                            PrefillContext(cache, torch.arange(rows), stack.attn_scale)))
            ctx = DecodeContext(cache, torch.tensor([rows, -1, rows + 1]),
                                torch.zeros(3, 2, dtype=torch.int32),
                                torch.tensor([rows + 1] * 2 + [rows + 2], dtype=torch.int32),
                                stack.attn_scale)
            outs.append(fwd(stack, xb, torch.tensor([rows, rows, rows + 1]) + 5, ctx))
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])


def test_rope_table_rows_equal_per_call_math():
    cos, sin = rope_tables(4096, 128, 1e6, torch.float32, "cpu")
    pos = torch.tensor([0, 1, 15, 777, 4095])
    c, s = rope_cos_sin(pos, 128, 1e6, torch.float32)
    assert torch.equal(cos[pos], c) and torch.equal(sin[pos], s)


def test_fused_buffers_follow_to_and_loads():
    stack = _stack(torch.float32)
    keys = set(stack.state_dict())
    assert not any("qkv_weight" in k or "gate_up_weight" in k for k in keys)

    def fused(s):
        return all(_is_fused(l.self_attn.qkv_weight, l.self_attn._linears())
                   and _is_fused(l.mlp.gate_up_weight, l.mlp._linears()) for l in s.layers)

    stack.to(torch.bfloat16)
    assert fused(stack) and set(stack._rope) == {(torch.device("cpu"), torch.bfloat16)}
    stack.to(torch.float32)
    assert fused(stack)
    cos, _ = stack.rope(torch.device("cpu"), torch.float32)
    assert torch.equal(cos, rope_tables(256, 16, 1e6, torch.float32, "cpu")[0])  # not a bf16 cast
    sd = {k: v + 1 for k, v in stack.state_dict().items()}
    stack.load_state_dict(sd)  # copies write through the views
    assert fused(stack) and set(stack.state_dict()) == keys
    attn = stack.layers[0].self_attn
    q_rows = attn.q_proj.weight.shape[0]
    assert torch.equal(attn.qkv_weight[:q_rows], sd["layers.0.self_attn.q_proj.weight"])
    stack.load_state_dict({k: v.clone() for k, v in sd.items()}, assign=True)
    assert not fused(stack)  # stale: the next forward (or fuse_) re-fuses
    x = torch.randn(2, 64)
    cache = PagedKVCache(2, 4, 16, 2, 16, torch.float32)
    with torch.no_grad():
        stack(x, torch.arange(2), PrefillContext(cache, torch.arange(2), stack.attn_scale))
    assert fused(stack)


def test_talker_warm_kernels_warms_both_stacks_at_their_decode_shapes(monkeypatch):
    """The talker over the engine's pages, the code predictor over its one page of 16 slots per row."""
    from q3tts import kernels
    from q3tts.checkpoint import presets
    from q3tts.config import ModelConfig
    from q3tts.models.talker import Talker

    ids = dict(im_start=1, im_end=2, assistant=3, tts_pad=4, tts_bos=5, tts_eos=6)
    cfg = ModelConfig.from_dict(presets.model_config_dict("custom_voice", "0.6b", "tiny", ids, 64)).talker
    talker = Talker(cfg).to(torch.bfloat16)
    calls = []
    monkeypatch.setattr(kernels, "warmup", lambda **kw: calls.append(kw))
    talker.warm_kernels(page_size=32, max_pages=9, batch_sizes=[1, 4])
    tl, cp = cfg.layers, cfg.code_predictor
    want = [(tl.num_heads, tl.num_kv_heads, tl.head_dim, (tl.hidden_size,), 32, 9),
            (cp.num_heads, cp.num_kv_heads, cp.head_dim, (cp.hidden_size,), cfg.num_code_groups, 1)]
    got = [(c["num_heads"], c["num_kv_heads"], c["head_dim"], c["hidden_sizes"], c["page_size"],
            c["max_pages"]) for c in calls]
    assert got == want
    assert all(c["dtype"] == torch.bfloat16 and c["device"] == torch.device("cpu")
               and c["batch_sizes"] == (1, 4) for c in calls)
