"""Qwen3 decoder building blocks shared by the talker and the code predictor.

Token-major, batch-free tensors: every forward takes `x [N, H]` rows (tokens of any sequences) with
their `positions [N]`; the `AttentionContext` knows which rows belong to which sequence.
Attribute names equal the released safetensors keys (`self_attn.q_proj`, `mlp.gate_proj`, ...).

Launch-count layout of one layer (the decode step is launch-bound, perf/results/RESULTS.md), 8
kernels besides attention's store + decode (was 25):
  [input norm (+ residual add)] -> qkv GEMM -> q-norm, k-norm and RoPE (q and k, one launch)
  -> attention -> o GEMM -> [post-attention norm + residual add] -> gate_up GEMM -> silu·mul
  -> down GEMM
RoPE reads cos/sin tables [max_positions, D] built once per (device, dtype) with the fp32 math of
`rope_cos_sin` (row p of the table == rope_cos_sin at p, bit for bit), gathered by position in the
kernel, instead of ~10 table kernels per forward and 5 eager ops per q/k.
The residual stream is carried between layers as (x, residual) and added inside the next norm
(`kernels.rms_norm(x, w, eps, residual)`): the add is done in the model dtype and rounded before the
fp32 statistics, exactly the eager `h = x + residual; rms_norm(h)`. `DecoderStack.fp32_residual` (off:
the official arithmetic) keeps the residual stream in fp32 instead; the normed rows that feed the GEMMs
stay in the model dtype.

Fused projections: `fuse_()` concatenates q/k/v and gate/up once into non-persistent buffers
(`qkv_weight`, `gate_up_weight`) and re-points the released parameters at row slices of them, so the
state_dict keys/values are unchanged and no weight memory is duplicated. `.to()/.cuda()/.half()`
keep that layout (see `_apply`); `load_state_dict` (copy) writes through the views. A forward finds
unfused (or stale, e.g. after `load_state_dict(assign=True)`) weights by pointer check and fuses
then, which is refused during CUDA graph capture: call `fuse_()` (Qwen3TTS.from_checkpoint does)
before capturing.

Every linear layer of the model layer (these stacks, the talker's text projection and heads, the code
predictor's heads, the codec decoder's transformer and ConvNeXt blocks) runs through `linear`, the one
dispatch point: `kernels.linear` while `kernels.batch_invariant()` is on (a row's product then does
not depend on how many rows share the GEMM: EngineConfig.batch_invariant), F.linear (cuBLAS, which
picks its kernel and reduction split by shape) otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from q3tts.config import DecoderLayerConfig
from q3tts import kernels
from q3tts.kernels.reference import rope_cos_sin
from q3tts.models.attention import AttentionContext


def refuse_in_capture(what: str) -> None:
    """Raise when called inside CUDA graph capture: `what` builds a tensor that must exist before."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{what} inside CUDA graph capture: call fuse_() on the model "
                           f"(after any .to()) before capturing")


def rows_at(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table[ids]: the rows [*ids.shape, ...] of `table` at `ids` (an int tensor on its device), the bits of
    `F.embedding` / `index_select`. Through indexing on purpose: on CUDA those two run torch's small-index kernel
    for up to 16 ids, whose threads walk the ids one by one (a dependent load each). In the H100's 16-row step graph
    that kernel took 26 µs a launch (17 a step; 2.8 at one row), indexing's kernel about 3 (the sampling
    parameters' gathers; perf/results/RESULTS.md, forty-seventh session).
    A 0-dim `ids` indexes as one id of shape [1]: as a 0-dim tensor index it is read back to the host as a Python
    int (`item()`), on CUDA a sync on the caller's stream (the CustomVoice prompt's speaker row, at the first admission
    of each voice). Other ids index as they are (a strided column too: flattening it would copy it)."""
    if ids.dim() == 0:
        return table[ids.view(1)][0]
    return table[ids]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N]: `kernels.linear` under
    `kernels.batch_invariant()` (rows independent of the row count), else F.linear."""
    if not kernels.batch_invariant():
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # [M, K]; a transposed view (the codec's) as a copy
    return kernels.linear(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear (same parameters and state_dict keys) whose forward is `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; statistics in fp32, rounded to the input dtype before the weight.

    With `residual`, returns (rms_norm(x + residual), x + residual) (the add in the residual's dtype: x.dtype,
    or float32 for an fp32 residual stream)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return kernels.rms_norm(x, self.weight, self.eps, residual)


def rope_tables(max_positions: int, head_dim: int, theta: float, dtype: torch.dtype,
                device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[max_positions, D]` for positions 0..max_positions-1: row p equals
    `rope_cos_sin(tensor([p]), ...)` (same fp32 math, elementwise)."""
    return rope_cos_sin(torch.arange(max_positions, device=device), head_dim, theta, dtype)


def _fuse_rows(owner: nn.Module, buffer_name: str, linears: list[Linear]) -> None:
    """Concatenate the weights of `linears` (rows) into `owner.<buffer_name>` (non-persistent) and
    make each weight a row slice of it."""
    with torch.no_grad():
        fused = torch.cat([lin.weight.detach() for lin in linears], dim=0).contiguous()
        owner.register_buffer(buffer_name, fused, persistent=False)
        _view_rows(fused, linears)


def _view_rows(fused: torch.Tensor, linears: list[Linear]) -> None:
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = fused[start:start + rows]
        start += rows


def _is_fused(fused: torch.Tensor | None, linears: list[Linear]) -> bool:
    """Whether every weight still is its row slice of `fused` (host-side pointer check)."""
    if fused is None:
        return False
    ptr, step = fused.data_ptr(), fused.stride(0) * fused.element_size()
    start = 0
    for lin in linears:
        w = lin.weight
        if (w.data_ptr() != ptr + start * step or w.dtype != fused.dtype
                or w.device != fused.device):
            return False
        start += w.shape[0]
    return start == fused.shape[0]


class FusedRows(nn.Module):
    """A module whose Linear children `_fused_names` run as one GEMM over `<_buffer>` (the talker's and code
    predictor's q/k/v and gate/up, the codec transformer's q/k/v: see this module's docstring)."""

    _buffer: str
    _fused_names: tuple[str, ...]

    def _linears(self) -> list[Linear]:
        return [getattr(self, name) for name in self._fused_names]

    def fuse_(self) -> None:
        if any(lin.weight.is_meta for lin in self._linears()):
            return
        _fuse_rows(self, self._buffer, self._linears())

    def fused_weight(self) -> torch.Tensor:
        """The concatenated weight, (re)built when missing or stale (never inside capture)."""
        fused = getattr(self, self._buffer, None)
        if not _is_fused(fused, self._linears()):
            refuse_in_capture(f"fusing {type(self).__name__} weights")
            self.fuse_()
            fused = getattr(self, self._buffer)
        return fused

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # .to()/.cuda()/.half() converted the weights and the buffer separately: point the weights
        # back at slices of the (identical) converted buffer so that they share memory again
        fused = getattr(self, self._buffer, None)
        if fused is not None:
            linears = self._linears()
            if (not fused.is_meta
                    and all(lin.weight.dtype == fused.dtype and lin.weight.device == fused.device
                            for lin in linears)
                    and sum(lin.weight.shape[0] for lin in linears) == fused.shape[0]):
                _view_rows(fused, linears)
            else:
                self._buffers[self._buffer] = None  # refused by the next forward's check
        return self


class SelfAttention(FusedRows):
    """GQA self-attention with QK-norm (RMSNorm over head_dim before RoPE), no biases.

    q/k/v run as one GEMM over `qkv_weight` (rows q | k | v), split by views."""

    _buffer = "qkv_weight"
    _fused_names = ("q_proj", "k_proj", "v_proj")

    def __init__(self, cfg: DecoderLayerConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, q_dim, bias=False)
        self.k_proj = Linear(cfg.hidden_size, kv_dim, bias=False)
        self.v_proj = Linear(cfg.hidden_size, kv_dim, bias=False)
        self.o_proj = Linear(q_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.register_buffer("qkv_weight", None, persistent=False)
        self._split = (q_dim, kv_dim, kv_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        """x [N, H] at positions [N]; cos, sin: RoPE tables [max_pos, D] -> [N, H]."""
        n = x.shape[0]
        q, k, v = linear(x, self.fused_weight()).split(self._split, dim=-1)  # views of [N, Q+2KV]
        v = v.view(n, self.num_kv_heads, self.head_dim)  # [N, KVH, D] view (row stride Q+2KV)
        norm = kernels.QKNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        q, k = kernels.apply_rotary(q.view(n, self.num_heads, self.head_dim),
                                    k.view(n, self.num_kv_heads, self.head_dim), positions, cos, sin,
                                    norm=norm)  # QK-norm + RoPE -> new [N, NH, D], [N, KVH, D]
        out = attn.attend(self.layer_idx, q, k, v)  # [N, NH, D]
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class MLP(FusedRows):
    """SwiGLU: down(silu(gate(x)) * up(x)) over x [..., H]; gate/up as one GEMM over `gate_up_weight`.
    The one SwiGLU of the package: the talker, the code predictor and the codec decoder's transformer."""

    _buffer = "gate_up_weight"
    _fused_names = ("gate_proj", "up_proj")

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.register_buffer("gate_up_weight", None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_mul(linear(x, self.fused_weight())))  # [..., 2I] -> [..., I] -> [..., H]


class DecoderLayer(nn.Module):
    """Pre-norm Qwen3 layer: h = x + attn(norm(x)); y = h + mlp(norm(h)).

    Carries the residual stream: forward(x, residual) with residual None on the first layer (x is
    the stream) returns (mlp_out, h) whose sum y the next norm forms (fused add + RMSNorm)."""

    def __init__(self, cfg: DecoderLayerConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, attn: AttentionContext
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, normed = x, self.input_layernorm(x)
        else:
            normed, residual = self.input_layernorm(x, residual)  # residual = x + residual
        attn_out = self.self_attn(normed, positions, cos, sin, attn)
        normed, residual = self.post_attention_layernorm(attn_out, residual)  # h = attn_out + x
        return self.mlp(normed), residual


class DecoderStack(nn.Module):
    """`layers.{i}` + final `norm`; subclasses add their embedding tables under the same prefix.

    `max_positions`: size of the RoPE tables (positions 0..max_positions-1 may be asked for; on CUDA
    a larger position reads past the table)."""

    def __init__(self, cfg: DecoderLayerConfig, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.max_positions = max_positions
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fp32_residual = False  # the residual stream in fp32 (EngineConfig.fp32_residual)
        self._rope: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def attn_scale(self) -> float:
        return self.cfg.head_dim ** -0.5

    def rope(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE cos/sin tables [max_positions, D] in `dtype` on `device`, built once."""
        key = (torch.device(device), dtype)
        tables = self._rope.get(key)
        if tables is None:
            refuse_in_capture("building RoPE tables")
            tables = rope_tables(self.max_positions, self.cfg.head_dim, self.cfg.rope_theta,
                                 dtype, key[0])
            self._rope[key] = tables
        return tables

    def fuse_(self) -> DecoderStack:
        """Fuse every layer's projections and build the RoPE tables for the weights' device and
        dtype (idempotent; call after loading and before any CUDA graph capture)."""
        for layer in self.layers:
            layer.self_attn.fuse_()
            layer.mlp.fuse_()
        w = self.norm.weight
        if not w.is_meta:
            self.rope(w.device, w.dtype)
        return self

    def warm_kernels(self, page_size: int, max_pages: int, batch_sizes: Sequence[int]) -> None:
        """Compile this stack's kernels and tune paged decode attention for pages of `page_size` and
        block tables `max_pages` wide, in the weights' dtype and device; call before CUDA-graph
        capture (see kernels/warmup.py). A no-op where the kernels would not run."""
        cfg, w = self.cfg, self.norm.weight
        kernels.warmup(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                       hidden_sizes=(cfg.hidden_size,), page_size=page_size, dtype=w.dtype,
                       device=w.device, max_pages=max_pages, batch_sizes=tuple(batch_sizes),
                       intermediate_sizes=(cfg.intermediate_size,))

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # tables follow the weights: rebuilt from the fp32 math (never cast from another dtype)
        had_tables = bool(self._rope)
        self._rope = {}
        if had_tables and not self.norm.weight.is_meta:
            self.rope(self.norm.weight.device, self.norm.weight.dtype)
        return self

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                attn: AttentionContext) -> torch.Tensor:
        """x [N, H], positions [N] -> final-normed hidden [N, H]."""
        cos, sin = self.rope(x.device, x.dtype)
        # an fp32 stream starts at 0: the first norm's h = x + 0 is x exactly, as without a residual
        residual = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if self.fp32_residual else None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, cos, sin, attn)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm(x, residual)[0]
