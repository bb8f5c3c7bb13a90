"""kernels/ring_attention.py: the codec transformer's one-frame attention over a ring of its window.

The ring's meaning is checked against the codec's own position-ordered path (`sliding_window_attention`
over the window in order), then the kernel against the ring reference in fp32 and bf16 (three-way rule),
with every ring row state: early positions (rows not yet written), wrapped positions, GQA."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, assert_close_3way, kernel_module
from q3tts.codec.layers import sliding_window_attention
from q3tts.kernels.reference import ring_attention_ref

ring = kernel_module("ring_attention")


def _case(bsz: int, heads: int, kv_heads: int, window: int, dim: int, positions: list[int], dtype, seed: int = 0):
    """Random q, k, v [B, ., D] for one frame per stream at `positions`; rings of B + 2 streams holding random
    keys for every earlier position (rows of positions < 0 hold garbage: they must be ignored), the call's
    streams at rows in reverse order with gaps (the streaming decoder's pool: slots, not 0..B-1)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, heads, dim, generator=gen)
    k, v = (torch.randn(bsz, kv_heads, dim, generator=gen) for _ in range(2))
    k_ring, v_ring = (torch.randn(bsz + 2, window, kv_heads, dim, generator=gen) for _ in range(2))
    rows = torch.arange(bsz + 1, 1, -1)[:bsz]
    pos = torch.tensor(positions, dtype=torch.int64)
    return [t.to(DEVICE, dtype) for t in (q, k, v, k_ring, v_ring)] + [rows.to(DEVICE), pos.to(DEVICE)]


@pytest.mark.parametrize("group", [1, 2])
def test_ring_reference_is_the_sliding_window_over_the_positions_in_order(group):
    """The ring with the frame's key in row pos % W = the window's keys in position order (the codec's
    multi-frame path), for a stream still filling its window and ones past it (wrapped rows)."""
    window, dim, kv_heads = 6, 8, 2
    q, k, v, k_ring, v_ring, rows, pos = _case(4, kv_heads * group, kv_heads, window, dim, [0, 3, 5, 13],
                                               torch.float32)
    held = [[p - w for w in range(window - 1, -1, -1)] for p in pos.tolist()]  # the window, oldest first
    ring_rows = torch.tensor([[h % window for h in hs] for hs in held], device=DEVICE)
    k_seq, v_seq = k_ring[rows[:, None], ring_rows].clone(), v_ring[rows[:, None], ring_rows].clone()  # [B, W, ...]
    k_seq[:, -1], v_seq[:, -1] = k, v
    want = sliding_window_attention(q[:, None], k_seq.repeat_interleave(group, 2), v_seq.repeat_interleave(group, 2),
                                    pos[:, None], torch.tensor(held, device=DEVICE), window)[:, 0]
    untouched = [t[:2].clone() for t in (k_ring, v_ring)]  # rows 0 and 1 of B + 2: no stream of the call
    got = ring_attention_ref(q, k, v, k_ring, v_ring, rows, pos, dim ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    own = pos % window
    assert torch.equal(k_ring[rows, own], k) and torch.equal(v_ring[rows, own], v)  # the frame's key is kept
    assert torch.equal(k_ring[:2], untouched[0]) and torch.equal(v_ring[:2], untouched[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(3, 4, 4, 72, 16), (2, 4, 2, 5, 8), (1, 2, 1, 3, 64)],
                         ids=lambda s: "B{}H{}KV{}W{}D{}".format(*s))
def test_kernel_matches_reference(dtype, shape):
    bsz, heads, kv_heads, window, dim = shape
    positions = [0, window - 1, 3 * window + 2][:bsz]
    case = _case(bsz, heads, kv_heads, window, dim, positions, dtype, seed=window)
    q, k, v, k_ring, v_ring, rows, pos = case
    rings_pt = [t.clone() for t in (k_ring, v_ring)]
    rings_ref = [t.float() for t in (k_ring, v_ring)]
    out = ring.ring_attention(q, k, v, k_ring, v_ring, rows, pos, dim ** -0.5)
    out_pt = ring_attention_ref(q, k, v, *rings_pt, rows, pos, dim ** -0.5)
    out_ref = ring_attention_ref(q.float(), k.float(), v.float(), *rings_ref, rows, pos, dim ** -0.5)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close_3way(out, out_pt, out_ref, dtype, f"ring attention {dtype} {shape}")
    assert torch.equal(k_ring, rings_pt[0]) and torch.equal(v_ring, rings_pt[1])  # the same rows written


def test_kernel_reads_strided_rows_and_positions():
    """The engine hands the codec its slots as a strided column of its row metadata (the bug class of
    f8e4911): the kernel must read rows and positions by their stride."""
    q, k, v, k_ring, v_ring, rows, pos = _case(3, 2, 2, 5, 8, [0, 4, 11], torch.float32, seed=5)
    meta = torch.stack([pos, rows, rows], dim=1)  # [B, 3]: columns with stride 3
    want_rings = [k_ring.clone(), v_ring.clone()]
    want = ring_attention_ref(q, k, v, *want_rings, rows, pos, 8 ** -0.5)
    got = ring.ring_attention(q, k, v, k_ring, v_ring, meta[:, 1], meta[:, 0], 8 ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(k_ring, want_rings[0]) and torch.equal(v_ring, want_rings[1])


def test_kernel_reads_strided_ring_views():
    """The streaming decoder's states are views into packed rows: ring strides are not contiguous ones."""
    bsz, heads, window, dim = 2, 2, 4, 8
    q, k, v, _, _, rows, pos = _case(bsz, heads, heads, window, dim, [1, 9], torch.float32)
    packed = torch.randn(bsz + 2, 2 * window * heads * dim + 5, device=DEVICE)
    k_ring = packed[:, 5:5 + window * heads * dim].view(bsz + 2, window, heads, dim)
    v_ring = packed[:, 5 + window * heads * dim:].view(bsz + 2, window, heads, dim)
    want_rings = [k_ring.clone(), v_ring.clone()]
    want = ring_attention_ref(q, k, v, *want_rings, rows, pos, dim ** -0.5)
    got = ring.ring_attention(q, k, v, k_ring, v_ring, rows, pos, dim ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(k_ring, want_rings[0]) and torch.equal(v_ring, want_rings[1])


@pytest.mark.gpu
def test_kernel_at_the_released_shape_replayed_in_a_cuda_graph():
    """The released codec's shape (64 streams, 16 heads, window 72, head dim 64, bf16), positions on both
    sides of the window; captured in a CUDA graph (as the codec step is) and replayed: the same output."""
    if DEVICE != "cuda":
        pytest.skip("needs a CUDA device")
    positions = torch.randint(0, 300, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    q, k, v, k_ring, v_ring, rows, pos = _case(64, 16, 16, 72, 64, positions, torch.bfloat16, seed=3)
    rings = [t.clone() for t in (k_ring, v_ring)]
    out_pt = ring_attention_ref(q, k, v, *[t.clone() for t in rings], rows, pos, 0.125)
    out_ref = ring_attention_ref(q.float(), k.float(), v.float(), *[t.float() for t in rings], rows, pos, 0.125)
    graph = torch.cuda.CUDAGraph()
    ring.ring_attention(q, k, v, k_ring, v_ring, rows, pos, 0.125)  # compile outside the capture
    with torch.cuda.graph(graph):
        out = ring.ring_attention(q, k, v, k_ring, v_ring, rows, pos, 0.125)
    for ring_t, start in zip((k_ring, v_ring), rings):
        ring_t.copy_(start)
    graph.replay()
    assert_close_3way(out, out_pt, out_ref, torch.bfloat16, "ring attention, released shape")
