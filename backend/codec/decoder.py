"""The 12 Hz codec decoder: codes [B, 16, T] -> 24 kHz pcm [B, T·1920].

`CodecDecoder` is an nn.Module whose state_dict names are the released `decoder.*` keys without the
prefix. Its one compute path, `forward_chunk(codes, states)`, decodes T new frames given the per-stream
state of everything before them; `decode` is that path with zero state (= the reference's
single full pass, which the reference uses for up to 300 frames). `StreamingDecoder` (streaming.py)
keeps the states of many streams in a preallocated pool.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from q3tts import kernels
from q3tts.kernels.reference import rope_cos_sin
from q3tts.models.layers import MLP, FusedRows, Linear, linear, refuse_in_capture, rows_at

from ..config import CodecConfig, CodecDecoderConfig
from .layers import (AttentionProjections, CausalConv1d, CausalTransConv1d, LayerScale, RMSNorm, SnakeBeta, StateSpec, States,
                     apply_rope, sliding_window_attention)


class Codebook(nn.Module):
    """RVQ codebook: entry = embedding_sum / clamp(cluster_usage, 1e-5), divided in the parameter dtype
    (as the reference does every call) and cached per dtype/device; weights are fixed after loading."""

    def __init__(self, dim: int, size: int) -> None:
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))
        self._table: Tensor | None = None

    def table(self) -> Tensor:  # [size, dim]
        w = self.embedding_sum
        if self._table is None or self._table.dtype != w.dtype or self._table.device != w.device:
            with torch.no_grad():
                self._table = w / self.cluster_usage.clamp(min=1e-5)[:, None]
        return self._table


class _VQLayer(nn.Module):
    def __init__(self, dim: int, size: int) -> None:
        super().__init__()
        self._codebook = Codebook(dim, size)


class _VQStack(nn.Module):
    def __init__(self, n: int, dim: int, size: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_VQLayer(dim, size) for _ in range(n))


class ResidualVQ(nn.Module):
    """Sum of codebook entries of `n` quantizers, projected by a 1×1 conv (dim -> out_dim). `use_kernels` (from
    `CodecDecoder.use_kernels(fuse=True)`): the lookups and their sum in one launch (`kernels.rvq_sum`, the same
    bits)."""

    use_kernels = False

    def __init__(self, n: int, dim: int, out_dim: int, size: int) -> None:
        super().__init__()
        self.input_proj = nn.Conv1d(out_dim, dim, 1, bias=False)  # encoder side only; kept for the layout
        self.output_proj = nn.Conv1d(dim, out_dim, 1, bias=False)
        self.vq = _VQStack(n, dim, size)
        self._stacked: Tensor | None = None

    def tables(self) -> Tensor:
        """The codebooks' tables stacked [n, size, dim], built once per dtype/device (outside CUDA graph capture)."""
        first = self.vq.layers[0]._codebook.table()
        if self._stacked is None or self._stacked.dtype != first.dtype or self._stacked.device != first.device:
            refuse_in_capture("stacking the codebook tables")
            self._stacked = torch.stack([layer._codebook.table() for layer in self.vq.layers])
        return self._stacked

    def forward(self, codes: Tensor) -> Tensor:  # [B, n, T] -> [B, out_dim, T]
        if self.use_kernels:
            total = kernels.rvq_sum(codes, self.tables())  # [B, T, dim]
        else:
            total = rows_at(self.vq.layers[0]._codebook.table(), codes[:, 0])  # [B, T, dim]
            for g in range(1, len(self.vq.layers)):
                total = total + rows_at(self.vq.layers[g]._codebook.table(), codes[:, g])
        if kernels.batch_invariant():  # the 1x1 conv as the linear layer it is (codec/layers.py)
            return linear(total, self.output_proj.weight[:, :, 0]).transpose(1, 2)
        return self.output_proj(total.transpose(1, 2))


class SplitRVQ(nn.Module):
    """Codebook 0 (semantic, `rvq_first`) plus codebooks 1..n-1 (`rvq_rest`), summed."""

    def __init__(self, cfg: CodecDecoderConfig) -> None:
        super().__init__()
        dim, out = cfg.codebook_dim // 2, cfg.codebook_dim
        self.rvq_first = ResidualVQ(1, dim, out, cfg.codebook_size)
        self.rvq_rest = ResidualVQ(cfg.num_quantizers - 1, dim, out, cfg.codebook_size)

    def forward(self, codes: Tensor) -> Tensor:  # [B, 16, T] -> [B, codebook_dim, T]
        return self.rvq_first(codes[:, :1]) + self.rvq_rest(codes[:, 1:])


class Attention(FusedRows, AttentionProjections):
    """MHA (no bias, no QK-norm), RoPE, causal sliding window of W = sliding_window positions. A stream keeps
    its last W keys and values in a ring (position p in row p % W), so a frame adds its key and value in
    place instead of shifting the window. q/k/v run as one GEMM over `qkv_weight` (rows q | k | v, `fuse_`).
    `use_kernels` (`CodecDecoder.use_kernels`): a one-frame call, where the kernels serve the device, runs RoPE
    on q and k in one launch (`kernels.apply_rotary`) and `kernels.ring_attention` (one launch, no copy of the
    window)."""

    use_kernels = False
    _buffer = "qkv_weight"
    _fused_names = ("q_proj", "k_proj", "v_proj")

    def __init__(self, spec: StateSpec, cfg: CodecDecoderConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        nkv, hd = cfg.num_kv_heads, cfg.head_dim
        self.window = cfg.sliding_window
        self.k_state = spec.add((self.window, nkv, hd), resident=True)
        self.v_state = spec.add((self.window, nkv, hd), resident=True)
        self.register_buffer("qkv_weight", None, persistent=False)
        self._split = (cfg.num_heads * hd, nkv * hd, nkv * hd)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], q_pos: Tensor, k_pos: Tensor,
                states: States, rows: Tensor) -> Tensor:  # [B, T, h]; rows [B]: the streams' ring rows
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, -1, self.head_dim)  # [B, T, H | KVH, D], views of [B, T, (H + 2·KVH)·D]
                   for y in linear(x, self.fused_weight()).split(self._split, dim=-1))
        rings = states[self.k_state], states[self.v_state]  # [N, W, KVH, D] each (resident: N >= B)
        if t == 1 and self.use_kernels and kernels.use_triton(x):
            cos, sin = (r[:, 0] for r in rope)  # [B, D]: row b is stream b's position
            q, k = kernels.apply_rotary(q[:, 0], k[:, 0], torch.arange(b, device=x.device), cos, sin)
            out = kernels.ring_attention(q, k, v[:, 0], *rings, rows, q_pos[:, 0],
                                         self.head_dim ** -0.5)[:, None]  # [B, 1, H, D]
        else:
            out = self._window(apply_rope(q, *rope), apply_rope(k, *rope), v, *rings, rows, q_pos, k_pos)
        return self.o_proj(out.reshape(b, t, -1))

    def _window(self, q: Tensor, k: Tensor, v: Tensor, k_ring: Tensor, v_ring: Tensor, rows: Tensor,
                q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Any number of frames T: the ring's past W-1 rows in position order, then the new keys
        (`sliding_window_attention`); the last W new keys and values go into the ring. q [B, T, H, D],
        k, v [B, T, KVH, D], rings [N, W, KVH, D] at rows [B], k_pos [B, W-1+T] (the past positions first)
        -> [B, T, H, D]."""
        t, batch = q.shape[1], rows[:, None]
        past = k_pos[:, :self.window - 1] % self.window  # [B, W-1] rows (negative positions: masked)
        k_all, v_all = torch.cat([k_ring[batch, past], k], dim=1), torch.cat([v_ring[batch, past], v], dim=1)
        last = slice(max(0, t - self.window), t)
        k_ring[batch, q_pos[:, last] % self.window] = k[:, last]
        v_ring[batch, q_pos[:, last] % self.window] = v[:, last]
        if self.kv_heads != self.heads:
            k_all = k_all.repeat_interleave(self.heads // self.kv_heads, dim=2)
            v_all = v_all.repeat_interleave(self.heads // self.kv_heads, dim=2)
        return sliding_window_attention(q, k_all, v_all, q_pos, k_pos, self.window)  # [B, T, H, D]


class TransformerLayer(nn.Module):
    """Pre-norm layer with LayerScale on both residual branches."""

    def __init__(self, spec: StateSpec, cfg: CodecDecoderConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = Attention(spec, cfg)
        self.mlp = MLP(h, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(h, cfg.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(h, cfg.layer_scale_initial_scale)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], q_pos: Tensor, k_pos: Tensor,
                states: States, rows: Tensor) -> Tensor:
        attn = self.self_attn(self.input_layernorm(x), rope, q_pos, k_pos, states, rows)
        x = x + self.self_attn_layer_scale(attn)
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class Transformer(nn.Module):
    """`pre_transformer`: input_proj -> layers -> norm -> output_proj; state includes the frame counter."""

    def __init__(self, spec: StateSpec, cfg: CodecDecoderConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(spec, cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_proj = Linear(cfg.latent_dim, cfg.hidden_size)
        self.output_proj = Linear(cfg.hidden_size, cfg.latent_dim)
        self.head_dim, self.theta, self.past = cfg.head_dim, cfg.rope_theta, cfg.sliding_window - 1
        self.pos_state = spec.add((), torch.int64)

    def forward(self, x: Tensor, states: States, rows: Tensor) -> Tensor:  # [B, T, latent] -> [B, T, latent]
        t = x.shape[1]
        start = states[self.pos_state]  # [B] frames decoded so far
        steps = torch.arange(t, device=x.device)
        q_pos = start[:, None] + steps  # [B, T]
        k_pos = torch.cat([start[:, None] - self.past + torch.arange(self.past, device=x.device), q_pos], 1)
        states[self.pos_state] = start + t
        x = self.input_proj(x)
        rope = rope_cos_sin(q_pos, self.head_dim, self.theta, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, q_pos, k_pos, states, rows)
        return self.output_proj(self.norm(x))


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv k7 -> LayerNorm -> Linear ×4 -> GELU -> Linear -> ×gamma, residual."""

    def __init__(self, spec: StateSpec, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv1d(spec, dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)  # batch-invariant as it is (codec/layers.py)
        self.pwconv1 = Linear(dim, 4 * dim)
        self.pwconv2 = Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: Tensor, states: States) -> Tensor:  # [B, C, T]
        h = self.dwconv(x, states).transpose(1, 2)  # [B, T, C]
        h = self.gamma * self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + h.transpose(1, 2)


class ResidualUnit(nn.Module):
    """x + conv1x1(Snake(causal conv k7 dilated(Snake(x)))): the first Snake (`act1`) made by the layer before the
    unit, the second by the k7 conv (`CausalConv1d(snake=)`: in its epilogue on the kernel path)."""

    def __init__(self, spec: StateSpec, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(spec, dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(spec, dim, dim, 1)

    def forward(self, x: Tensor, x_act: Tensor, states: States, then: SnakeBeta | None = None,
                keep: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """x [B, C, T], x_act = act1(x) -> [B, C, T]. then: the next layer's SnakeBeta, which the last conv applies to
        the output (keep: (output, activated))."""
        h = self.conv1(x_act, states, snake=self.act2)
        return self.conv2(h, states, residual=x, snake=then, keep=keep)


class DecoderBlock(nn.Module):
    """SnakeBeta -> causal ConvTranspose (×rate) -> ResidualUnits with dilations 1, 3, 9 (`block.*`). Each
    SnakeBeta after a conv is made by that conv (in its epilogue on the kernel path): the block's first by the layer
    before the block, the first unit's first by the transposed conv, a later unit's first by the unit before it, the
    next layer's by the last unit."""

    def __init__(self, spec: StateSpec, c_in: int, c_out: int, rate: int) -> None:
        super().__init__()
        self.block = nn.ModuleList([SnakeBeta(c_in), CausalTransConv1d(spec, c_in, c_out, 2 * rate, rate),
                                    *(ResidualUnit(spec, c_out, d) for d in (1, 3, 9))])

    def forward(self, x_act: Tensor, states: States, then: SnakeBeta | None = None) -> Tensor:
        """x_act: block[0](x) [B, C, T], made by the layer before -> [B, C', T·rate] (`then`: through that SnakeBeta,
        the next layer's)."""
        units = self.block[2:]
        x, act = self.block[1](x_act, states, snake=units[0].act1, keep=True)  # act: the next unit's act1(x)
        for unit, nxt in zip(units[:-1], units[1:]):
            x, act = unit(x, act, states, then=nxt.act1, keep=True)
        return units[-1](x, act, states, then=then)


class CodecDecoder(nn.Module):
    """12 Hz codec decoder; state_dict names = released `decoder.*` keys minus the prefix."""

    def __init__(self, cfg: CodecDecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.spec = StateSpec()
        spec, latent = self.spec, cfg.latent_dim
        self.quantizer = SplitRVQ(cfg)
        self.pre_conv = CausalConv1d(spec, cfg.codebook_dim, latent, 3)
        self.pre_transformer = Transformer(spec, cfg)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalTransConv1d(spec, latent, latent, r, r), ConvNeXtBlock(spec, latent)])
            for r in cfg.upsampling_ratios)
        dims = [cfg.decoder_dim // 2 ** i for i in range(len(cfg.upsample_rates) + 1)]
        self.decoder = nn.ModuleList([
            CausalConv1d(spec, latent, dims[0], 7),
            *(DecoderBlock(spec, dims[i], dims[i + 1], r) for i, r in enumerate(cfg.upsample_rates)),
            SnakeBeta(dims[-1]),
            CausalConv1d(spec, dims[-1], 1, 7),
        ])

    @classmethod
    def from_weights(cls, codec_config: CodecConfig | CodecDecoderConfig, weights: dict[str, Tensor],
                     dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> CodecDecoder:
        """Build from a codec config and its weights: `decoder.*` keys (speech_tokenizer/model.safetensors)
        or the same names without the prefix. Strict: a missing or unexpected key raises."""
        cfg = codec_config.decoder if isinstance(codec_config, CodecConfig) else codec_config
        own = {k.removeprefix("decoder."): v for k, v in weights.items() if not k.startswith("encoder.")}
        model = cls(cfg)
        model.load_state_dict(own, strict=True)
        model.to(device=device, dtype=dtype).eval()
        for layer in model.pre_transformer.layers:  # fused now: never inside a CUDA graph capture
            layer.self_attn.fuse_()  # q/k/v as one GEMM
            layer.mlp.fuse_()  # gate/up as one GEMM
        return model

    def use_kernels(self, on: bool, fuse: bool = False) -> None:
        """Route the convs, SnakeBeta activations, RMSNorms and one-frame attention through `q3tts.kernels` (on) or
        torch (off). Call after the decoder's last `.to()` (the convs copy their weights into the kernel layout).
        fuse (with on; EngineConfig.codec_fusion): each SnakeBeta made in the epilogue of the conv before it, the
        transposed convs' phases interleaved there, and each residual VQ's lookups summed in one launch
        (`kernels.rvq_sum`): the same bits, fewer launches."""
        for m in self.modules():
            if isinstance(m, CausalConv1d):
                m.set_use_kernels(on)
            elif isinstance(m, (SnakeBeta, Attention, RMSNorm, CausalTransConv1d)):
                m.use_kernels = on
            if isinstance(m, (CausalConv1d, CausalTransConv1d)):
                m.fuse = on and fuse
            elif isinstance(m, ResidualVQ):
                m.use_kernels = on and fuse

    def zero_states(self, batch: int) -> States:
        """Fresh per-stream state (all zeros = causal zero padding, frame counter 0) for `batch` streams."""
        p = next(self.parameters())
        return self.spec.zeros(batch, p.dtype, p.device)

    def forward_chunk(self, codes: Tensor, states: States, rows: Tensor | None = None) -> Tensor:
        """Decode T new frames per stream. codes [B, 16, T] (int64, >= 0) -> pcm [B, T·1920];
        `states` (from `zero_states` or a previous call) is updated in place of the list. rows [B] (int64):
        the streams' rows of the resident states (`StateSpec.add`), which may hold more streams than the
        call; None: rows 0..B-1 (every state has the call's B rows)."""
        x = codes
        for _, step in self.chunk_steps(states, rows):
            x = step(x)
        return x

    def chunk_steps(self, states: States, rows: Tensor | None = None) -> list[tuple[str, Callable[[Tensor], Tensor]]]:
        """`forward_chunk` as its named steps in order, each x -> y over `states` (and the resident states' `rows`):
        the first takes the codes [B, 16, T], the last returns the pcm [B, T·1920] (perf/bench_codec.py --stages
        times them one by one)."""
        def transformer(x: Tensor) -> Tensor:
            at = rows if rows is not None else torch.arange(x.shape[0], device=x.device)
            return self.pre_transformer(x.transpose(1, 2), states, at).transpose(1, 2)  # [B, latent, T]

        steps = [("quantizer + pre_conv", lambda x: self.pre_conv(self.quantizer(x), states)),  # [B, latent, T]
                 ("pre_transformer", transformer)]
        steps += [(f"upsample {i} (transposed conv + ConvNeXt)", lambda x, u=up, c=convnext: c(u(x, states), states))
                  for i, (up, convnext) in enumerate(self.upsample)]  # [B, latent, T·r]
        steps += self._decoder_steps(states)
        return steps + [("clamp", lambda x: x.clamp(-1.0, 1.0)[:, 0])]  # [B, T·1920]

    def _decoder_steps(self, states: States) -> list[tuple[str, Callable[[Tensor], Tensor]]]:
        """The decoder's layers as steps, each SnakeBeta made by the layer before it (a conv's epilogue on the kernel
        path): the conv's, the blocks' first and the one before the output conv. [B, latent, T] -> [B, 1, T·1920]."""
        layers = list(self.decoder)
        steps = []
        for i, (layer, nxt) in enumerate(zip(layers, [*layers[1:], None])):
            then = nxt.block[0] if isinstance(nxt, DecoderBlock) else nxt if isinstance(nxt, SnakeBeta) else None
            if isinstance(layer, DecoderBlock):
                steps.append((f"decoder {i} (DecoderBlock)", lambda x, m=layer, t=then: m(x, states, then=t)))
            elif isinstance(layer, CausalConv1d):
                steps.append((f"decoder {i} (CausalConv1d)", lambda x, m=layer, t=then: m(x, states, snake=t)))
        return steps

    @torch.inference_mode()
    def decode(self, codes: Tensor) -> Tensor:
        """Full decode in one pass: codes [B, 16, T] (entries < 0 are read as 0) -> pcm [B, T·1920]."""
        return self.forward_chunk(codes.clamp(min=0), self.zero_states(codes.shape[0]))

    def decode_like_reference(self, codes: Tensor, chunk: int = 300, context: int = 25) -> Tensor:
        """The reference's `chunked_decode`: independent passes over `chunk` frames, each with
        up to `context` preceding frames whose audio is dropped. Equals `decode` for T <= chunk; use it
        only for bit-parity with the reference on longer outputs. codes [B, 16, T] -> pcm [B, T·1920]."""
        spf = self.config.samples_per_frame
        pieces = []
        for start in range(0, codes.shape[-1], chunk):
            ctx = min(context, start)
            pieces.append(self.decode(codes[..., start - ctx:start + chunk])[:, ctx * spf:])
        return torch.cat(pieces, dim=1)
