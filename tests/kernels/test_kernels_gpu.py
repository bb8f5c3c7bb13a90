"""GPU-only: no recompiles across batch sizes after warmup; CUDA-graph replay equals eager."""

from __future__ import annotations

import contextlib

import pytest
import torch

import q3tts.kernels as K
from q3tts.kernels import reference as R

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not K.HAS_TRITON, reason="triton is not installed"),
]

NH, KVH, D, PAGE, MAX_PAGES, BF16 = 16, 8, 128, 16, 32, torch.bfloat16
INTER = 6144  # the talker's MLP width


def _step(bsz: int, cache_k, cache_v, table, seed: int = 0):
    """One talker-shaped decode step through every public wrapper; returns the attention output."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(bsz, 2048, device="cuda", dtype=BF16, generator=gen)
    h, _ = K.rms_norm(x, torch.ones(2048, device="cuda", dtype=BF16), 1e-6, residual=x)
    K.rms_norm(h[:, :1024].contiguous(), torch.ones(1024, device="cuda", dtype=BF16), 1e-6)
    K.silu_mul(torch.randn(bsz, 2 * INTER, device="cuda", dtype=BF16, generator=gen))
    qkv = torch.randn(bsz, (NH + 2 * KVH) * D, device="cuda", dtype=BF16, generator=gen)
    q = qkv[:, : NH * D].view(bsz, NH, D)
    k = qkv[:, NH * D: (NH + KVH) * D].view(bsz, KVH, D)
    v = qkv[:, (NH + KVH) * D:].view(bsz, KVH, D)
    w = torch.ones(D, device="cuda", dtype=BF16)
    positions = torch.arange(bsz, device="cuda") % 64
    q, k = K.apply_rotary(q, k, positions, table, table, norm=K.QKNorm(w, w, 1e-6))  # the layers' QK-norm + RoPE
    lens = (torch.arange(bsz, device="cuda", dtype=torch.int32) * 37) % (MAX_PAGES * PAGE)
    slots = torch.where(lens > 0, lens - 1, -1)
    tables = torch.arange(bsz * MAX_PAGES, device="cuda", dtype=torch.int32).view(bsz, MAX_PAGES)
    tables = tables % cache_k.shape[0]
    K.store_kv(k, v, cache_k, cache_v, slots)
    return K.paged_decode_attention(q, cache_k, cache_v, tables, lens, D ** -0.5)


@contextlib.contextmanager
def _compiles():
    """The names of the Triton kernels compiled inside the block (a list, filled as they compile)."""
    import triton

    compiled: list[str] = []

    def hook(*, fn, **kwargs):
        compiled.append(fn.name)
        return False

    old = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = hook
    try:
        yield compiled
    finally:
        triton.knobs.runtime.jit_cache_hook = old


def test_compile_count_constant_across_batch_sizes():
    K.warmup(num_heads=NH, num_kv_heads=KVH, head_dim=D, hidden_sizes=(2048, 1024),
             page_size=PAGE, dtype=BF16, max_pages=MAX_PAGES, batch_sizes=(1, 256), intermediate_sizes=(INTER,))
    cache_k = torch.zeros(64, PAGE, KVH, D, device="cuda", dtype=BF16)
    cache_v = torch.zeros_like(cache_k)
    table = torch.randn(64, D, device="cuda", dtype=BF16)
    with _compiles() as compiled:
        for bsz in (1, 2, 3, 8, 17, 64, 100, 256):
            _step(bsz, cache_k, cache_v, table)
        torch.cuda.synchronize()
    assert compiled == [], f"kernels compiled after warmup: {compiled}"


@pytest.mark.parametrize("bsz", [1, 8, 64])
def test_cuda_graph_replay_matches_reference(bsz):
    """Capture store_kv + paged attention once, replay with new context lengths and tables."""
    torch.manual_seed(bsz)
    num_pages = bsz * MAX_PAGES
    k_cache = torch.randn(num_pages, PAGE, KVH, D, device="cuda", dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(bsz, NH, D, device="cuda", dtype=BF16)
    k_new = torch.randn(bsz, KVH, D, device="cuda", dtype=BF16)
    tables = torch.randperm(num_pages, device="cuda").to(torch.int32).view(bsz, MAX_PAGES)
    lens = torch.ones(bsz, device="cuda", dtype=torch.int32)
    slots = torch.full((bsz,), -1, device="cuda", dtype=torch.int64)
    K.warmup(num_heads=NH, num_kv_heads=KVH, head_dim=D, hidden_sizes=(2048,), page_size=PAGE,
             dtype=BF16, max_pages=MAX_PAGES, batch_sizes=(bsz,))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # eager warm-up on the capture stream
        K.store_kv(k_new, k_new, k_cache, v_cache, slots)
        K.paged_decode_attention(q, k_cache, v_cache, tables, lens, D ** -0.5)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        K.store_kv(k_new, k_new, k_cache, v_cache, slots)
        out = K.paged_decode_attention(q, k_cache, v_cache, tables, lens, D ** -0.5)
    for trial in range(3):
        new_lens = torch.randint(0, MAX_PAGES * PAGE + 1, (bsz,), device="cuda", dtype=torch.int32)
        new_lens[0] = 0 if trial == 1 else new_lens[0]
        lens.copy_(new_lens)
        new_slots = tables[:, 0].long() * PAGE  # first slot of each row's first page
        slots.copy_(torch.where(new_lens > 0, new_slots, -1))
        q.copy_(torch.randn_like(q))
        k_new.copy_(torch.randn_like(k_new))
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        R.store_kv_ref(k_new, k_new, k_ref, v_ref, slots)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
        ref = R.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, D ** -0.5)
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("ctx", [128, 1000, 4096])
def test_real_shape_attention_accuracy(ctx):
    torch.manual_seed(ctx)
    bsz, max_pages = 4, 4096 // PAGE
    k_cache = torch.randn(bsz * max_pages, PAGE, KVH, D, device="cuda", dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(bsz, NH, D, device="cuda", dtype=BF16)
    tables = torch.randperm(bsz * max_pages, device="cuda").to(torch.int32).view(bsz, max_pages)
    lens = torch.tensor([ctx, ctx // 2, 1, 0], device="cuda", dtype=torch.int32)
    out = K.paged_decode_attention(q, k_cache, v_cache, tables, lens, D ** -0.5)
    ref = R.paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), tables, lens,
                                       D ** -0.5)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=1e-2)
    assert torch.equal(out[3], torch.zeros_like(out[3]))


def test_conv1d_choice_is_tuned_only_inside_tuning():
    """Shapes seen inside `tuning()` get a timed kernel-vs-cuDNN choice (cached); others run cuDNN."""
    from q3tts.kernels.autotune import tuned_configs
    from q3tts.kernels.conv1d import causal_conv1d

    w = torch.randn(96, 96, 7, device="cuda", dtype=BF16) / 25
    x_tuned = torch.randn(3, 96, 1926, device="cuda", dtype=BF16)
    x_plain = torch.randn(5, 96, 1926, device="cuda", dtype=BF16)
    with K.tuning():
        got = causal_conv1d(x_tuned, w, None)
    outside = causal_conv1d(x_plain, w, None)
    keys = [k for k in tuned_configs() if k[0] == "conv1d"]
    assert any(k[1] == (3, 96, 1926) for k in keys) and not any(k[1] == (5, 96, 1926) for k in keys)
    assert torch.equal(outside, R.causal_conv1d_ref(x_plain, w, None))
    torch.testing.assert_close(got.float(), R.causal_conv1d_ref(x_tuned.double(), w.double(), None).float(),
                               atol=2e-2, rtol=2e-2)


def test_stack_warm_kernels_settles_every_decode_kernel_before_capture():
    """`DecoderStack.warm_kernels` (called before CUDA-graph capture) compiles every kernel of a decode
    forward at any batch size and tunes paged attention for the stack's shape class."""
    from q3tts.config import DecoderLayerConfig
    from q3tts.kernels.autotune import tuned_configs
    from q3tts.models.attention import DecodeContext, PagedKVCache
    from q3tts.models.layers import DecoderStack

    heads, kv, hd, pages = 4, 2, 80, 4  # head_dim 80: a shape class no other test tunes
    cfg = DecoderLayerConfig(256, 512, 2, heads, kv, hd, 1e-6, 1e6)
    stack = DecoderStack(cfg, 64).to("cuda", BF16).eval().fuse_()
    key = ("paged_decode", hd, PAGE, heads // kv, BF16, BF16, pages * PAGE)
    assert key not in tuned_configs()
    stack.warm_kernels(PAGE, pages, (1, 4))
    assert key in tuned_configs()
    cache = PagedKVCache(cfg.num_layers, 8 * pages, PAGE, kv, hd, BF16, "cuda")
    with _compiles() as compiled, torch.no_grad():
        for bsz in (1, 3, 8):
            pos = torch.arange(bsz, device="cuda") + 7
            tables = torch.arange(bsz * pages, device="cuda", dtype=torch.int32).view(bsz, pages)
            ctx = DecodeContext(cache, tables[:, 0].long() * PAGE + pos, tables, (pos + 1).int(),
                                stack.attn_scale)
            stack(torch.randn(bsz, 256, device="cuda", dtype=BF16), pos, ctx)
        torch.cuda.synchronize()
    assert compiled == [], f"kernels compiled after warm_kernels: {compiled}"
