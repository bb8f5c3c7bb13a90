"""kernels/prefill_attention.py vs prefill_attention_ref (causal varlen attention over packed rows)."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, assert_close_3way, kernel_module
from q3tts.kernels.reference import PagedPrefix, causal_attention_ref, prefill_attention_ref

pf = kernel_module("prefill_attention")

# the interpreter evaluates tensor loop bounds through a deprecated numpy scalar conversion
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning")


def make_inputs(nh, kvh, d, lens, pad, dtype, seed=0, cu_dtype=torch.int32, seqs=None):
    """q, k, v as views of one fused [T, (NH + 2 KVH) * D] projection (as the model's qkv GEMM),
    the rows of `lens` back to back then `pad` padding rows holding NaN (a kernel that read them
    would spread NaN), cu_seqlens padded with empty sequences up to `seqs`."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    total = sum(lens)
    rows = total + pad
    fused = torch.randn(rows, (nh + 2 * kvh) * d, generator=gen)
    fused[total:] = float("nan")
    fused = fused.to(DEVICE, dtype)
    q, k, v = fused.split((nh * d, kvh * d, kvh * d), dim=-1)
    q, k, v = q.view(rows, nh, d), k.view(rows, kvh, d), v.view(rows, kvh, d)
    bounds = [0]
    for n in lens + [0] * ((seqs or len(lens)) - len(lens)):
        bounds.append(bounds[-1] + n)
    return q, k, v, torch.tensor(bounds, dtype=cu_dtype, device=DEVICE), d ** -0.5


CASES = [  # (nh, kvh, head_dim, lens, padding rows, sequence capacity S)
    (16, 8, 128, [1, 17, 40], 5, 3),            # talker heads; a 1-row prompt; rows straddle blocks
    (4, 1, 32, [33], 0, 1),                     # one sequence, GQA 4, no padding, several blocks
    (6, 2, 16, [3, 1, 1, 20, 7], 9, 8),         # group 3; several prompts in one block; empty slots
    (2, 2, 24, [5, 0, 12], 3, 4),               # MHA, head_dim 24; an empty sequence in the middle
    (4, 2, 16, [], 6, 2),                       # nothing but padding
    (2, 1, 16, [1, 2, 0, 3] * 17, 4, 70),       # more sequences than one step of the block search
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "h{}_kv{}_d{}_{}".format(
    c[0], c[1], c[2], "-".join(map(str, c[3])) or "none"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefill_attention_matches_reference(dtype, case):
    nh, kvh, d, lens, pad, seqs = case
    q, k, v, cu, scale = make_inputs(nh, kvh, d, lens, pad, dtype, seqs=seqs)
    total = sum(lens)
    poison = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    out = pf.prefill_attention(q, k, v, cu, scale, out=poison)
    assert out is poison
    assert torch.isnan(out[total:]).all(), "a padding row was written"
    assert not torch.isnan(out[:total]).any(), "a valid row was left unwritten (or read NaN padding)"
    out_ref = prefill_attention_ref(q.float(), k.float(), v.float(), cu, scale)
    out_pt = prefill_attention_ref(q, k, v, cu, scale)
    assert_close_3way(out[:total], out_pt[:total], out_ref[:total], dtype, f"prefill {dtype} {case}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_each_sequence_is_its_own_prefill(dtype):
    """Batch invariance: every sequence's rows are bit-equal to the kernel run on that sequence alone,
    and to the same sequence packed at another offset behind other prompts (int64 boundaries, default
    output): a program never straddles two prompts and its key blocks start at its prompt's first row."""
    lens = [7, 1, 30, 2]
    q, k, v, cu, scale = make_inputs(4, 2, 32, lens, 4, dtype, seed=5, cu_dtype=torch.int64)
    packed = pf.prefill_attention(q, k, v, cu, scale)
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        alone = pf.prefill_attention(q[sl], k[sl], v[sl], torch.tensor([0, n], device=DEVICE), scale)
        assert torch.equal(packed[sl], alone), f"a {n}-row prompt at row {start} differs from itself alone"
        start += n
    shift = 11  # the 30-row prompt again, behind an 11-row one whose rows are the packed tail
    qs, ks, vs = (torch.cat((t[-shift:], t[8:38])) for t in (q, k, v))
    moved = pf.prefill_attention(qs, ks, vs, torch.tensor([0, shift, shift + 30], device=DEVICE), scale)
    assert torch.equal(moved[shift:], packed[8:38]), "the 30-row prompt changed with its offset in the pack"


PREFIX_CASES = [  # (nh, kvh, head_dim, lens, padding rows, S, prefix length P, page size)
    (16, 8, 128, [21, 9], 3, 2, 37, 16),        # talker heads; P not a page multiple; a second prompt
    (6, 2, 16, [1, 20, 3], 4, 4, 50, 8),        # a one-row piece after 50 keys; blocks straddle sequences
    (4, 2, 32, [33], 0, 1, 0, 16),              # P = 0: a whole prompt through the prefix variant
]


@pytest.mark.parametrize("case", PREFIX_CASES, ids=lambda c: "p{}_{}".format(c[6], "-".join(map(str, c[3]))))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefix_matches_reference(dtype, case):
    """Chunked prefill: sequence 0 is a piece after P keys in a paged cache (pages out of order, the
    cache's other slots NaN: a kernel that read a wrong slot would spread NaN); the others unchanged."""
    nh, kvh, d, lens, pad, seqs, plen, page = case
    q, k, v, cu, scale = make_inputs(nh, kvh, d, lens, pad, dtype, seed=3, seqs=seqs)
    gen = torch.Generator(device="cpu").manual_seed(4)
    num_pages = 2 * (-(-plen // page)) + 2
    kc, vc = (torch.full((num_pages, page, kvh, d), float("nan")) for _ in range(2))
    table = torch.randperm(num_pages, generator=gen)[:max(1, -(-plen // page))]
    slots = table[torch.arange(plen) // page] * page + torch.arange(plen) % page
    for cache in (kc, vc):
        cache.view(-1, kvh, d)[slots] = torch.randn(plen, kvh, d, generator=gen)
    prefix = PagedPrefix(kc.to(DEVICE, dtype), vc.to(DEVICE, dtype), table.to(DEVICE),
                         torch.tensor([plen], device=DEVICE))
    total = sum(lens)
    out = pf.prefill_attention(q, k, v, cu, scale, prefix=prefix)
    assert not torch.isnan(out[:total]).any(), "a valid row read a slot outside its prefix"
    out_pt = prefill_attention_ref(q, k, v, cu, scale, prefix)
    f32 = PagedPrefix(prefix.k_cache.float(), prefix.v_cache.float(), prefix.block_table, prefix.length)
    out_ref = prefill_attention_ref(q.float(), k.float(), v.float(), cu, scale, f32)
    assert_close_3way(out[:total], out_pt[:total], out_ref[:total], dtype, f"prefix {dtype} {case}")
    # the piece's rows are the last rows of the prompt's causal attention, prefix keys first
    n0 = lens[0]
    keys = torch.cat((kc.view(-1, kvh, d)[slots], k[:n0].float().cpu()))
    values = torch.cat((vc.view(-1, kvh, d)[slots], v[:n0].float().cpu()))
    whole = causal_attention_ref(q[:n0].float().cpu(), keys.to(dtype).float(), values.to(dtype).float(), scale)
    torch.testing.assert_close(out_ref[:n0].cpu(), whole)


def test_contract_violations_raise():
    q, k, v, cu, scale = make_inputs(4, 2, 16, [3, 5], 0, torch.float32)
    with pytest.raises(AssertionError, match="kv heads"):
        pf.prefill_attention(q[:, :3], k, v, cu, scale)
    with pytest.raises(AssertionError, match="cu_seqlens"):
        pf.prefill_attention(q, k, v, cu.float(), scale)
    with pytest.raises(AssertionError, match="out"):
        pf.prefill_attention(q, k, v, cu, scale, out=torch.empty(8, 4, 8, device=DEVICE))
