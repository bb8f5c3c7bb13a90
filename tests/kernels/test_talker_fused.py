"""The talker's fused decode forward (models/talker_fused.py) and its new kernels
(kernels/talker_qkv.py, kernels/talker_attention.py) vs the eager decode forward and the torch
references (talker_reference.py, reference.paged_decode_attention_ref).

Interpreter tests at the tiny shapes (on CPU through the Triton interpreter; compiled on CUDA).
Tolerance: kernel_checks.assert_close_3way, from the dtype: |out - fp32 ref| <= 2 |same-dtype torch
- fp32 ref| + atol(dtype) * max(1, |ref|). In float32 the eager forward is its own fp32 reference,
so the bound is atol = 1e-5 relative to the largest |value| (~84 float32 epsilons: only the fp32
accumulation order differs); in bf16, 2x the eager bf16 error + 1e-2.
Outputs are poisoned (NaN) before the kernels write them; every launch leaves its tickets at zero.
Deliberate mutations these tests catch (each run by hand when written):
  talker_qkv        k stored unrotated (cos 1, sin 0 for the k head in _store_heads_in_turn): the cache
                    check of test_qkv_rope_store_matches_its_reference fails
  talker_attention  the merge's ticket count used - 1 (a merge before the last used split has
                    stored its partial): test_decode_attention_matches_the_reference fails
  talker_fused      the attention's residual add dropped (h = o_proj(out)):
                    test_fused_talker_decode_equals_eager fails
GPU tests (marked gpu) at the real 1.7B talker widths in bf16: the kernels vs their references with
tuned configs, the fused forward vs the eager one (3-way, fp32 reference), graph replay == eager,
and the launches per layer.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from code_predictor_cases import Inputs, row_stats
from kernel_checks import DEVICE, assert_close_3way, kernel_module
from q3tts.checkpoint.maker import _init_tensor, make_checkpoint
from q3tts.checkpoint.presets import model_config_dict
from q3tts.config import DecoderLayerConfig, TalkerConfig
from q3tts.core import SamplingParams, VoiceSpec
from q3tts.engine.config import EngineConfig
from q3tts.engine.engine import Engine
from q3tts.kernels.reference import paged_decode_attention_ref, rope_cos_sin
from q3tts.kernels.talker_reference import qkv_rope_store_ref
from q3tts.models.attention import DecodeContext, PagedKVCache, PrefillContext
from q3tts.models.layers import DecoderStack

tq = kernel_module("talker_qkv")  # skips the module without triton
ta = kernel_module("talker_attention")
from q3tts.kernels.code_predictor_gemm import GemmConfig  # noqa: E402 (imports triton)
from q3tts.models.talker import Talker  # noqa: E402
from q3tts.models.talker_fused import LAUNCHES_PER_LAYER, FusedTalker  # noqa: E402

TEXT_IDS = dict(im_start=1, im_end=2, assistant=3, tts_pad=4, tts_bos=5, tts_eos=6)
TINY = TalkerConfig.from_dict(
    model_config_dict("custom_voice", "1.7b", "tiny", TEXT_IDS, 100)["talker_config"]).layers
REAL = DecoderLayerConfig(2048, 6144, 4, 16, 8, 128, 1e-6, 1e6)  # 4 of the 1.7B talker's 28 layers
BF16, FP32 = torch.bfloat16, torch.float32
EPS = 1e-6
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _column(values: torch.Tensor, dtype=torch.int64) -> torch.Tensor:
    """values [N] as a strided column (the engine passes columns of its row metadata)."""
    return values.to(dtype)[:, None].repeat(1, 3)[:, 1]


class Rows:
    """B decode rows over a paged cache holding random history: row b sees context_lens[b] keys
    (its new token's included) and writes its token at position context_lens[b] - 1 of its pages;
    rows in `padding` have slot -1 and context length 1 over a spare page (the engine's padding)."""

    def __init__(self, cfg: DecoderLayerConfig, bsz: int, max_context: int, page_size: int,
                 dtype: torch.dtype, inp: Inputs, padding: tuple[int, ...] = ()):
        pages_per_row = -(-max_context // page_size)
        spare = bsz * pages_per_row
        gen, dev = inp.gen, inp.device
        self.context_lens = torch.randint(1, max_context + 1, (bsz,), generator=gen, device=dev)
        perm = torch.randperm(spare, generator=gen, device=dev)
        self.block_tables = perm.view(bsz, pages_per_row).int()  # [B, max_pages]
        self.positions = self.context_lens - 1
        page = self.block_tables.long().gather(1, (self.positions // page_size)[:, None])[:, 0]
        self.slots = page * page_size + self.positions % page_size
        for b in padding:
            self.context_lens[b], self.positions[b], self.slots[b] = 1, 0, -1
            self.block_tables[b] = spare
        self.cache = PagedKVCache(cfg.num_layers, spare + 1, page_size, cfg.num_kv_heads,
                                  cfg.head_dim, dtype, dev)
        self.cache.k.copy_(inp.randn(*self.cache.k.shape))
        self.cache.v.copy_(inp.randn(*self.cache.v.shape))

    def context(self, cache: PagedKVCache, scale: float) -> DecodeContext:
        return DecodeContext(cache, _column(self.slots), self.block_tables,
                             _column(self.context_lens, torch.int32), scale)


def _cache_copy(cache: PagedKVCache, dtype: torch.dtype) -> PagedKVCache:
    out = copy.deepcopy(cache)
    out.k, out.v = out.k.to(dtype), out.v.to(dtype)
    return out


def _f32(*ts):
    return [t.float() for t in ts]


# ------------------------------------------------------------------------------------ kernels

def check_qkv(cfg: DecoderLayerConfig, rows: int, dtype: torch.dtype, inp: Inputs, config,
              page_size: int = 4, max_context: int = 40, padding: tuple[int, ...] | None = None,
              stats: bool = False) -> None:
    """Rotated q and the whole cache after the store vs the references; every third row pads (default).
    stats: the norm reads the rows' statistics (`row_stats`), as a layer after the first does."""
    padding = tuple(range(2, rows, 3)) if padding is None else padding
    r = Rows(cfg, rows, max_context, page_size, dtype, inp, padding=padding)
    h, d, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    weights = (inp.norm_weight(h, dtype), inp.weight((nh + 2 * nkv) * d, h, dtype),
               inp.norm_weight(d, dtype), inp.norm_weight(d, dtype))
    rope = rope_cos_sin(torch.arange(max_context, device=inp.device), d, cfg.rope_theta, dtype)
    x = inp.randn(rows, h, scale=2, dtype=dtype)
    ids = (_column(r.positions), _column(r.slots))
    caches = [r.cache.k[0], r.cache.v[0]]
    ref, ref32 = [c.clone() for c in caches], [c.to(FP32, copy=True) for c in caches]
    counters = inp.counters()
    out = tq.qkv_rope_store(x, *weights, *rope, *ids, *caches, EPS, counters, config=config,
                            out=inp.poisoned(rows, nh * d, dtype=dtype), stats=row_stats(x) if stats else None)
    want = qkv_rope_store_ref(x, *weights, *rope, *ids, *ref, EPS)
    want32 = qkv_rope_store_ref(*_f32(x, *weights, *rope), *ids, *ref32, EPS)
    assert_close_3way(out, want, want32, dtype, f"q ({rows} rows)")
    for got, w, w32, name in zip(caches, ref, ref32, "kv"):
        assert_close_3way(got, w, w32, dtype, f"{name} cache ({rows} rows)")
    assert not counters.any(), "qkv_rope_store: counters left non-zero"


def check_attention(cfg: DecoderLayerConfig, bsz: int, dtype: torch.dtype, inp: Inputs,
                    page_size: int, max_context: int) -> None:
    """vs the reference: row 0 sees every key (its last split is not empty), the last row pads,
    row 1 (of 3 or more) has no key (zeros)."""
    r = Rows(cfg, bsz, max_context, page_size, dtype, inp, padding=(bsz - 1,) if bsz > 1 else ())
    r.context_lens[0] = max_context
    if bsz > 2:
        r.context_lens[1] = 0
    q = inp.randn(bsz, cfg.num_heads, cfg.head_dim, dtype=dtype)
    k, v = r.cache.k[0], r.cache.v[0]
    args = (r.block_tables, _column(r.context_lens, torch.int32), cfg.head_dim ** -0.5)
    counters = inp.counters()
    out = ta.decode_attention(q, k, v, *args, counters, out=inp.poisoned(*q.shape, dtype=dtype))
    want = paged_decode_attention_ref(q, k, v, *args)
    want32 = paged_decode_attention_ref(*_f32(q, k, v), *args)
    assert_close_3way(out, want, want32, dtype, f"attention ({bsz} rows)")
    assert not counters.any(), "decode_attention: counters left non-zero"


@pytest.mark.parametrize("config", [None, GemmConfig(16, 32, 2, 1, 1)], ids=["default", "split2"])
@pytest.mark.parametrize("rows", [1, 19])
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=str)
def test_qkv_rope_store_matches_its_reference(dtype, rows, config):
    """19 rows span two row blocks; split2: the K slices' partials summed by the last program."""
    check_qkv(TINY, rows, dtype, Inputs(DEVICE, 1, rows, dtype.itemsize, config is None), config)


@pytest.mark.parametrize("rows", [1, 19])
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=str)
def test_qkv_rope_store_norms_from_row_statistics(dtype, rows):
    """The rows' statistics given (`row_stats`) make the references' q and cache; 4x those statistics halve
    the v written (v has no QK-norm to undo it), so the kernel reads them."""
    check_qkv(TINY, rows, dtype, Inputs(DEVICE, 2, rows, dtype.itemsize), None, stats=True)
    inp, cfg = Inputs(DEVICE, 3, rows), TINY
    r = Rows(cfg, rows, 40, 4, FP32, inp, padding=())
    h, d, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    weights = (inp.norm_weight(h, FP32), inp.weight((nh + 2 * nkv) * d, h, FP32),
               inp.norm_weight(d, FP32), inp.norm_weight(d, FP32))
    rope = rope_cos_sin(torch.arange(40, device=inp.device), d, cfg.rope_theta, FP32)
    x, ids = inp.randn(rows, h, scale=2), (_column(r.positions), _column(r.slots))
    v = []
    for scale in (1, 4):
        cache = _cache_copy(r.cache, FP32)
        tq.qkv_rope_store(x, *weights, *rope, *ids, cache.k[0], cache.v[0], EPS, inp.counters(),
                          stats=scale * row_stats(x))
        v.append(cache.v[0].flatten(0, 1)[r.slots])  # the rows' entries [M, KVH, D]
    assert (v[0] - v[1]).abs().max() > 0.2 * v[0].abs().max(), "the statistics were not read"


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=str)
def test_a_one_row_launch_of_a_padding_row_stores_nothing(dtype):
    """One row (the epilogue of FEW_ROWS rows, its heads loaded at once) whose slot is -1: its q is made, the
    cache is left as it was."""
    check_qkv(TINY, 1, dtype, Inputs(DEVICE, 3, dtype.itemsize), None, padding=(0,))


@pytest.mark.parametrize("bsz", [1, 5])
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=str)
def test_decode_attention_matches_the_reference(dtype, bsz):
    """64 keys at most over pages of 8: 4 splits of 16 keys at batch 1, 2 at batch 5."""
    check_attention(TINY, bsz, dtype, Inputs(DEVICE, 2, bsz, dtype.itemsize), 8, 64)


def test_kernel_contract_violations_raise():
    inp = Inputs(DEVICE, 3)
    r = Rows(TINY, 2, 8, 4, FP32, inp)
    d, nh, h = TINY.head_dim, TINY.num_heads, TINY.hidden_size
    w = (torch.ones(h), inp.weight((nh + 2 * TINY.num_kv_heads) * d, h, FP32), torch.ones(d),
         torch.ones(d))
    w = [t.to(DEVICE) for t in w]
    rope = rope_cos_sin(torch.arange(8, device=DEVICE), d, 1e6, FP32)
    x, caches = inp.randn(2, h), (r.cache.k[0], r.cache.v[0])
    with pytest.raises(AssertionError, match="slot_mapping must be int"):
        tq.qkv_rope_store(x, *w, *rope, r.positions, r.slots.float(), *caches, EPS, inp.counters())
    with pytest.raises(AssertionError, match="caches"):
        tq.qkv_rope_store(x, *w, *rope, r.positions, r.slots, caches[0].bfloat16(), caches[1], EPS,
                          inp.counters())
    q = inp.randn(2, nh, d)
    with pytest.raises(AssertionError, match="counters"):
        ta.decode_attention(q, *caches, r.block_tables, r.context_lens.int(), 0.25,
                            inp.counters()[:1])


# ----------------------------------------------------------------------------- the fused talker

def _init(module: torch.nn.Module, seed: int = 0) -> None:
    """The checkpoint maker's random weights (norms near 1, fan-in scaled matrices)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(_init_tensor(name, p.shape, gen))


def _stack(cfg: DecoderLayerConfig, device: str) -> DecoderStack:
    """A fp32 talker-shaped decoder stack, projections fused."""
    stack = DecoderStack(cfg, max_positions=4096)
    _init(stack)
    return stack.to(device).eval().fuse_()


@pytest.fixture
def fused_calls(monkeypatch) -> list[int]:
    """Grows by one at each FusedTalker.forward call."""
    calls: list[int] = []
    forward = FusedTalker.forward
    monkeypatch.setattr(FusedTalker, "forward", lambda self, *a: calls.append(1) or forward(self, *a))
    return calls


@torch.no_grad()
def test_fused_talker_decode_equals_eager(fused_calls, monkeypatch):
    """fp32, the tiny 1.7B talker, 5 rows (one padding row) over caches with history: after
    use_fused(5) a decode forward runs the fused kernels and gives the eager hidden and caches
    (every slot: the padding row stores nothing); a prefill forward stays eager; use_fused(4) (a
    bound below the 5 rows) and use_fused(0) keep the decode forward eager."""
    talker = Talker(TalkerConfig.from_dict(
        model_config_dict("custom_voice", "1.7b", "tiny", TEXT_IDS, 100)["talker_config"]))
    _init(talker)
    talker = talker.to(DEVICE).eval().fuse_()
    inp = Inputs(DEVICE, 4)
    r = Rows(TINY, 5, 40, 4, FP32, inp, padding=(3,))
    x = inp.randn(5, TINY.hidden_size)
    eager = _cache_copy(r.cache, FP32)
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "0")  # the eager forward on the torch references
    want = talker(x, r.positions, r.context(eager, talker.attn_scale))
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "1")
    talker.use_fused(5)
    got = talker(x, r.positions, r.context(r.cache, talker.attn_scale))
    assert fused_calls == [1]
    assert_close_3way(got, want, want, FP32, "hidden")
    assert_close_3way(r.cache.k, eager.k, eager.k, FP32, "k cache")
    assert_close_3way(r.cache.v, eager.v, eager.v, FP32, "v cache")
    talker(x, r.positions, PrefillContext(eager, r.slots, talker.attn_scale))
    for bound in (4, 0):
        talker.use_fused(bound)
        talker(x, r.positions, r.context(eager, talker.attn_scale))
    assert fused_calls == [1]


@torch.no_grad()
def check_fused_forward(stack32: DecoderStack, r: Rows, dtype: torch.dtype, inp: Inputs, monkeypatch,
                        what: str) -> None:
    """The fused decode forward over r's rows vs the eager stack at `dtype` and in fp32 (3-way): the hidden
    of every row, K/V in every page."""
    cfg, rows = stack32.cfg, r.positions.shape[0]
    stack = copy.deepcopy(stack32).to(dtype)
    x = inp.randn(rows, cfg.hidden_size, dtype=dtype)
    scale = cfg.head_dim ** -0.5
    eager, eager32 = _cache_copy(r.cache, dtype), _cache_copy(r.cache, FP32)
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "0")  # the eager forwards on the torch references
    want = stack(x, r.positions, r.context(eager, scale))
    want32 = stack32(x.float(), r.positions, r.context(eager32, scale))
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "1")
    got = FusedTalker(stack).forward(x, r.positions, r.context(r.cache, scale))
    assert_close_3way(got, want, want32, dtype, f"hidden ({what})")
    assert_close_3way(r.cache.k, eager.k, eager32.k, dtype, f"k cache ({what})")
    assert_close_3way(r.cache.v, eager.v, eager32.v, dtype, f"v cache ({what})")


def check_bf16_forward(stack32: DecoderStack, bsz: int, max_context: int, page_size: int,
                       inp: Inputs, monkeypatch) -> None:
    """The fused bf16 decode forward (one padding row) vs the eager bf16 and fp32 forwards."""
    r = Rows(stack32.cfg, bsz, max_context, page_size, BF16, inp, padding=(bsz // 2,))
    check_fused_forward(stack32, r, BF16, inp, monkeypatch, f"{bsz} rows")


def test_fused_talker_bf16_rounds_like_the_eager_forward(monkeypatch):
    """bf16, tiny widths, 9 rows: no further from the fp32 forward than the eager bf16 one."""
    check_bf16_forward(_stack(TINY, DEVICE), 9, 40, 4, Inputs(DEVICE, 5), monkeypatch)


def test_engine_config_fused_talker_bound():
    """A batch bound (an int >= 0); batch_invariant keeps every bucket on the eager stack."""
    assert EngineConfig(fused_talker=16).fused_talker_batch == 16
    assert EngineConfig(fused_talker=16, batch_invariant=True).fused_talker_batch == 0
    for bad in ("yes", True, -1):
        with pytest.raises(ValueError, match="fused_talker must be an int >= 0"):
            EngineConfig(fused_talker=bad)


def _engine_frames(ckpt_dir, fused: int) -> dict[str, list[list[int]]]:
    config = EngineConfig(device=DEVICE, dtype="float32", num_pages=32, max_slots=3, max_frames=8,
                          max_prompt_tokens=128, max_text_tokens=64, graph_batch_sizes=(2, 4),
                          use_cuda_graphs=False, fused_talker=fused)
    engine = Engine(str(ckpt_dir), config, with_codec=False)
    speaker = sorted(engine.checkpoint.config.talker.speaker_ids)[0]
    for i, text in enumerate(["Hello there.", "Another one, a little longer.", "Three."]):
        engine.add(f"s{i}", VoiceSpec(speaker=speaker),
                   SamplingParams(greedy=i == 0, seed=i, max_frames=3), text, True)
    frames: dict[str, list[list[int]]] = {}
    while engine.has_work():
        for out in engine.step():
            frames.setdefault(out.seq_id, []).append(out.codes.tolist())
    return frames


def test_engine_decode_steps_through_the_fused_talker(tmp_path, fused_calls, monkeypatch):
    """The engine's decode step (its metadata columns, a padding row in the bucket of 4) with the
    talker's decode forward fused up to bucket 4: a greedy and two sampled sequences make the frames
    of the eager forward (fp32, tiny 1.7B checkpoint); with the bound at 2 their bucket stays eager."""
    ckpt_dir = make_checkpoint(tmp_path / "cv", "custom_voice", "1.7b", "tiny", seed=0)
    # the rest of the engine on the torch references (fast on CPU), the fused talker's kernels
    # through the interpreter (or compiled on CUDA)
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "0")
    monkeypatch.setattr(FusedTalker, "serves", staticmethod(lambda x: True))
    want = _engine_frames(ckpt_dir, fused=0)
    assert _engine_frames(ckpt_dir, fused=2) == want and fused_calls == []  # 3 rows: bucket 4 > 2
    got = _engine_frames(ckpt_dir, fused=4)
    assert len(fused_calls) >= 2 and sorted(got) == ["s0", "s1", "s2"]
    assert got == want


# ------------------------------------------------------------------------- GPU, real 1.7B widths

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 64])
def test_talker_kernels_at_real_shapes(rows):
    """Tuned launch configs, pages of 16 (the engine's), contexts up to 1,000 keys."""
    check_qkv(REAL, rows, BF16, Inputs("cuda", 6, rows), None, page_size=16, max_context=1000)
    check_attention(REAL, rows, BF16, Inputs("cuda", 7, rows), 16, 1000)


@pytest.fixture(scope="module")
def real_stack():
    return _stack(REAL, "cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("bsz", [1, 64])
def test_fused_talker_bf16_at_real_shapes(real_stack, bsz, monkeypatch):
    check_bf16_forward(real_stack, bsz, 600, 16, Inputs("cuda", 8, bsz), monkeypatch)


def _bench():
    """perf/bench_code_predictor.py: graph capture with outputs, kernels launched."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
    import bench_code_predictor

    return bench_code_predictor


def _check_replays(real_stack, seed: int, padding: tuple[int, ...], replays: int, pdl: bool = False):
    """bf16, 16 rows: the fused forward captured in a graph (with programmatic dependent launch when pdl) and
    replayed with new inputs gives the eager fused call's (plain launches) hidden and caches bit for bit.
    Returns the fused forward and its inputs."""
    from q3tts import kernels

    stack = copy.deepcopy(real_stack).to(BF16)
    fused, inp = FusedTalker(stack), Inputs("cuda", seed)
    r = Rows(REAL, 16, 600, 16, BF16, inp, padding=padding)
    ctx, x = r.context(r.cache, REAL.head_dim ** -0.5), inp.randn(16, REAL.hidden_size, dtype=BF16)
    start = (r.cache.k.clone(), r.cache.v.clone())
    kernels.set_programmatic_launch(pdl)
    try:
        fused.forward(x, r.positions, ctx)  # compile and tune outside the capture
        graph, out = _bench().capture_with_outputs(lambda: fused.forward(x, r.positions, ctx))
    finally:
        kernels.set_programmatic_launch(False)
    for _ in range(replays):
        x.copy_(inp.randn(16, REAL.hidden_size, dtype=BF16))
        r.cache.k.copy_(start[0])
        r.cache.v.copy_(start[1])
        graph.replay()
        got = (out.clone(), r.cache.k.clone(), r.cache.v.clone())
        r.cache.k.copy_(start[0])
        r.cache.v.copy_(start[1])
        want = (fused.forward(x, r.positions, ctx), r.cache.k, r.cache.v)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    return lambda: fused.forward(x, r.positions, ctx)


@pytest.mark.gpu
@needs_cuda
@torch.no_grad()
def test_fused_graph_replay_equals_eager_and_launches_per_layer(real_stack):
    """A graph replay equals the eager fused call (one padding row); one forward launches
    LAUNCHES_PER_LAYER kernels per layer plus the final norm."""
    forward = _check_replays(real_stack, seed=9, padding=(5,), replays=1)
    assert _bench().kernels_launched(forward) == LAUNCHES_PER_LAYER * REAL.num_layers + 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs compute capability >= 9")
@torch.no_grad()
def test_programmatic_launch_gives_the_plain_launches_bits(real_stack):
    """kernels.set_programmatic_launch: the fused forward captured with PDL (each kernel starts while the one
    before runs) gives the plain launches' hidden and caches bit for bit, over replays with new inputs."""
    _check_replays(real_stack, seed=10, padding=(3,), replays=4, pdl=True)
