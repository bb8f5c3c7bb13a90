"""Building blocks of the 12 Hz codec decoder, written as *chunk* operators over explicit state.

Every stateful layer maps `(x, state) -> (y, new_state)` for a chunk of T new time steps, where
`state` is exactly what the layer needs from the past. A full decode is one chunk with a
zero state; a streaming decode is many chunks. States are plain tensors with a leading batch dim, kept
in a flat list (`States`); each stateful layer owns one or more indices into it, assigned at build time.

Under `kernels.batch_invariant()` (EngineConfig.batch_invariant) a stream's samples do not depend on the
other streams of a call: linear layers through `models.layers.linear`, RMSNorm through `kernels.rms_norm`,
groups-1 convs through `kernels.causal_conv1d` (the Triton kernel: one batch row per program),
transposed convs as a stride-1 conv over their input taps through that kernel, depthwise convs as
multiply-adds in a fixed order, and attention through the memory-efficient SDPA kernel (one program per
(query block, head, batch row), each over all its keys). cuDNN and the math SDPA pick their
algorithms and reduction splits by shape. LayerNorm (codec/decoder.py) stays torch's: its CUDA kernel
reduces each row inside one block whose size depends only on the row length.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from q3tts import kernels
from q3tts.kernels.reference import rms_norm_ref, rotate_half, snake_beta_ref
from q3tts.models.layers import Linear, refuse_in_capture


_PACK_ALIGN = 16  # elements: each state of a packed buffer starts 32-byte aligned (bf16) or better


class StateSpec:
    """Collects the per-stream state shapes of a model while it is being built."""

    def __init__(self) -> None:
        self.entries: list[tuple[tuple[int, ...], torch.dtype | None, bool]] = []

    def add(self, shape: tuple[int, ...], dtype: torch.dtype | None = None, resident: bool = False) -> int:
        """Register one state tensor of `shape` (no batch dim); `dtype=None` means the model dtype. A `resident`
        state is a tensor of its own in `zeros_packed`, outside the packed buffers: the streaming decoder
        neither gathers nor scatters it, its layer reads and writes its streams' rows in place (the `rows` of
        `CodecDecoder.forward_chunk`)."""
        self.entries.append((tuple(shape), dtype, resident))
        return len(self.entries) - 1

    def zeros(self, batch: int, dtype: torch.dtype, device: torch.device | str) -> list[Tensor]:
        """Zero states (= causal zero padding) for `batch` streams."""
        return [torch.zeros((batch, *shape), dtype=dt or dtype, device=device) for shape, dt, _ in self.entries]

    def zeros_packed(self, batch: int, dtype: torch.dtype, device: torch.device | str
                     ) -> tuple[list[Tensor], list[Tensor]]:
        """`zeros`' states, and their storage (returned second): one buffer [batch, n] per dtype holding every
        state that is not resident as a view (a stream's rows of them are one row of each buffer, so they
        are zeroed, gathered or loaded in one launch per dtype; each starts at a multiple of `_PACK_ALIGN`
        elements), then the resident states themselves."""
        buffers = [torch.zeros(batch, n, dtype=dt, device=device) for dt, n in self._layout(dtype)[0].items()]
        resident = [torch.zeros((batch, *shape), dtype=dt or dtype, device=device)
                    for shape, dt, res in self.entries if res]
        return self.views(buffers, dtype, resident), buffers + resident

    def num_packed(self, dtype: torch.dtype) -> int:
        """How many packed buffers lead `zeros_packed`'s storage (one per dtype of the states not resident)."""
        return len(self._layout(dtype)[0])

    def views(self, buffers: list[Tensor], dtype: torch.dtype, resident: list[Tensor]) -> list[Tensor]:
        """The states in entry order: views into packed `buffers` (`zeros_packed`'s layout, any number of rows),
        and the `resident` tensors as they are."""
        sizes, places = self._layout(dtype)
        by_dtype, own = dict(zip(sizes, buffers)), iter(resident)
        return [next(own) if res else by_dtype[place[0]][:, place[1]:place[1] + math.prod(shape)].view(-1, *shape)
                for (shape, _, res), place in zip(self.entries, places)]

    def _layout(self, dtype: torch.dtype) -> tuple[dict[torch.dtype, int], list[tuple[torch.dtype, int] | None]]:
        """The packed layout: columns per dtype buffer (in buffer order), and each entry's (dtype, first column)
        (None: resident)."""
        sizes: dict[torch.dtype, int] = {}
        places = []
        for shape, dt, resident in self.entries:
            if resident:
                places.append(None)
                continue
            dt = dt or dtype
            places.append((dt, sizes.get(dt, 0)))
            sizes[dt] = sizes.get(dt, 0) + -(-math.prod(shape) // _PACK_ALIGN) * _PACK_ALIGN
        return sizes, places


States = list[Tensor]  # one tensor per StateSpec entry, each [B, ...]; updated in place of the list


def channels_last(x: Tensor) -> Tensor:
    """x [B, C, T] as stored channels-last (channel stride 1; a copy unless it is already): the layout in which the
    conv kernel reads its taps aligned (kernels/conv1d.py)."""
    return x if x.stride(1) == 1 else x.transpose(1, 2).contiguous().transpose(1, 2)


class CausalConv1d(nn.Module):
    """Conv1d with left zero padding `(k-1)·d` (stride 1), streamed with a history of its input.

    `use_kernels` (`set_use_kernels`, from `CodecDecoder.use_kernels`) or `kernels.batch_invariant()`: groups-1
    convs go through `kernels.causal_conv1d` with x channels-last (`channels_last`; the SnakeBeta kernel before
    most of them writes it so); depthwise convs under the latter: `depthwise_conv1d`. A groups-1 conv keeps its
    history channels-last too (state [history, C]; `history_of` gives it as [B, C, history]), whichever path runs."""

    use_kernels = False
    fuse = False  # `snake=` made in the conv kernel's epilogue (`CodecDecoder.use_kernels(fuse=)`)

    def __init__(self, spec: StateSpec, c_in: int, c_out: int, kernel: int, dilation: int = 1,
                 groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel, dilation=dilation, groups=groups)
        self.history = (kernel - 1) * dilation
        self._state_cl = groups == 1
        shape = (self.history, c_in) if self._state_cl else (c_in, self.history)
        self.state = spec.add(shape) if self.history else -1
        self.weight_oik: Tensor | None = None  # the conv kernel's weight layout, set by use_kernels

    def history_of(self, states: States) -> Tensor:
        """This conv's history in `states` as [B, C, history] (a view)."""
        state = states[self.state]
        return state.transpose(1, 2) if self._state_cl else state

    def keep_history(self, states: States, history: Tensor) -> None:
        """Set this conv's history in `states` to `history` [B, C, history] (kept as a view)."""
        states[self.state] = history.transpose(1, 2) if self._state_cl else history

    def forward(self, x: Tensor, states: States, residual: Tensor | None = None, snake: SnakeBeta | None = None,
                keep: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """[B, C, T] -> [B, C', T] (+ residual [B, C', T], fused into the conv when it is a kernel). snake: that
        output through the SnakeBeta `snake` instead (keep: (output, activated)), made in the conv kernel's epilogue
        when the conv is a kernel and `fuse` is set (`kernels.causal_conv1d(snake=)`: the bits of the two kernels)."""
        if self.conv.groups == 1 and (self.use_kernels or kernels.batch_invariant()):
            # the kernel reads the state in front of x in place: no cat of the history (cuDNN, if the
            # tuner picks it, does the cat); the new state is the last `history` samples of cat(state, x)
            x = channels_last(x)
            history = self.history_of(states) if self.history else None
            if history is not None:  # kept channels-last (the next call's kernel reads it so): cat along time there
                t = x.shape[-1]
                self.keep_history(states, x[..., -self.history:] if t >= self.history else
                                  torch.cat([history[..., t:].transpose(1, 2), x.transpose(1, 2)], 1).transpose(1, 2))
            if self.fuse and snake is not None:
                return kernels.causal_conv1d(x, self.conv.weight, self.conv.bias, self.conv.dilation[0], residual,
                                             self.weight_oik, history=history, snake=(snake.alpha, snake.beta),
                                             keep_conv=keep)
            return activated(kernels.causal_conv1d(x, self.conv.weight, self.conv.bias, self.conv.dilation[0],
                                                   residual, self.weight_oik, history=history), snake, keep)
        if self.history:
            x = torch.cat([self.history_of(states), x], dim=-1)  # [B, C, hist + T]
            self.keep_history(states, x[..., -self.history:])
        if self.conv.groups == self.conv.in_channels == self.conv.out_channels and kernels.batch_invariant():
            out = depthwise_conv1d(x, self.conv.weight, self.conv.bias, self.conv.dilation[0])
        else:
            out = self.conv(x)
        return activated(out if residual is None else residual + out, snake, keep)

    def set_use_kernels(self, on: bool) -> None:
        """Route this conv through `kernels.causal_conv1d` (groups 1 only) with a copy of the weight in the
        kernel's layout, made now from the current weight: call after the module's last `.to()`."""
        self.use_kernels = on
        self.weight_oik = kernels.conv_kernel_weight(self.conv.weight) if on and self.conv.groups == 1 else None


def activated(out: Tensor, snake: SnakeBeta | None, keep: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """A conv's `snake=` / `keep=` contract outside its epilogue: out, or snake(out), or (keep) (out, snake(out))."""
    if snake is None:
        return out
    act = snake(out)
    return (out, act) if keep else act


def depthwise_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, dilation: int) -> Tensor:
    """Valid depthwise conv1d: x [B, C, L], weight [C, 1, K], bias [C] or None -> [B, C, L - (K-1)·dilation],
    each element's K products summed in fp32 in tap order (elementwise ops: the same order whatever the
    batch) and rounded once to x.dtype."""
    taps = weight.shape[-1]
    length = x.shape[-1] - (taps - 1) * dilation
    w = weight[:, 0].float()  # [C, K]
    acc = x[..., :length].float() * w[:, :1]  # [B, C, T]
    for j in range(1, taps):
        acc = torch.addcmul(acc, x[..., j * dilation:j * dilation + length].float(), w[:, j:j + 1])
    if bias is not None:
        acc = acc + bias.float()[:, None]
    return acc.to(x.dtype)


class CausalTransConv1d(nn.Module):
    """ConvTranspose1d(k, s) with the last `k - s` samples trimmed (zero look-ahead).

    With k = 2s, output block t depends on inputs t and t-1, so the state is the previous input sample.
    With k = s there is no overlap and no state.
    `use_kernels` (from `CodecDecoder.use_kernels`) where the kernels serve x's device, or
    `kernels.batch_invariant()`: it runs as a stride-1 conv of k/s taps over its input (`as_conv`), channels-last,
    the state read in place as the conv's history.
    """

    use_kernels = False
    fuse = False  # the phases interleaved and `snake=` made in the conv kernel's epilogue (as CausalConv1d.fuse)

    def __init__(self, spec: StateSpec, c_in: int, c_out: int, kernel: int, stride: int) -> None:
        super().__init__()
        if kernel not in (stride, 2 * stride):
            raise ValueError(f"transposed conv needs kernel = stride or 2·stride, got {kernel}/{stride}")
        self.conv = nn.ConvTranspose1d(c_in, c_out, kernel, stride=stride)
        self.stride = stride
        self.state = spec.add((c_in, 1)) if kernel == 2 * stride else -1
        self._conv_form: tuple[Tensor, Tensor] | None = None  # (weight, bias) of `as_conv`, per dtype/device

    def forward(self, x: Tensor, states: States, snake: SnakeBeta | None = None,
                keep: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """[B, C, T] -> [B, C', T·s]; snake: through the SnakeBeta `snake` instead (keep: (output, activated)), made
        in the conv kernel's epilogue on the kernel path with `fuse` (`as_conv`)."""
        history = states[self.state] if self.state >= 0 else None  # [B, C, 1]
        if history is not None:
            states[self.state] = x[..., -1:]
        if (self.use_kernels and kernels.use_triton(x)) or kernels.batch_invariant():
            return self.as_conv(x, history, snake, keep)
        if history is None:
            return activated(self.conv(x), snake, keep)
        y = self.conv(torch.cat([history, x], dim=-1))  # [B, C', (T + 2)·s]
        return activated(y[..., self.stride: y.shape[-1] - self.stride], snake, keep)

    def as_conv(self, x: Tensor, history: Tensor | None = None, snake: SnakeBeta | None = None,
                keep: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """The trimmed transposed conv of x [B, C, T] after `history` [B, C, taps - 1] (taps = k/s; None: taps = 1)
        as one `kernels.causal_conv1d` of taps taps into C'·s channels, channel (o, r) = output phase r of channel
        o, the phases interleaved in time -> [B, C', T·s] (`snake`, `keep`: as `forward`); with `fuse`, by the
        kernel's stores, which also make the snake, else by a copy after it."""
        weight, bias = self._conv_weights()
        if self.fuse:
            return kernels.causal_conv1d(channels_last(x), weight, bias, history=history, phases=self.stride,
                                         snake=None if snake is None else (snake.alpha, snake.beta), keep_conv=keep)
        y = kernels.causal_conv1d(channels_last(x), weight, bias, history=history)  # [B, C'·s, T]
        return activated(kernels.interleave_phases(y, self.stride), snake, keep)

    def _conv_weights(self) -> tuple[Tensor, Tensor]:
        """(weight [C'·s, C, taps], bias [C'·s]) of `as_conv`: output phase r of block t is
        sum_m W[:, o, (taps-1-m)·s + r] · x[t + m] (tap m = taps-1 is the block's own input), built once
        per dtype/device (outside CUDA graph capture; the weights are fixed after loading)."""
        w = self.conv.weight  # [C, C', k]
        cached = self._conv_form
        if cached is None or cached[0].dtype != w.dtype or cached[0].device != w.device:
            refuse_in_capture("building the transposed conv's conv-form weights")
            c_in, c_out, k = w.shape
            taps = k // self.stride
            with torch.no_grad():
                conv_w = (w.view(c_in, c_out, taps, self.stride).flip(2).permute(1, 3, 0, 2)
                          .reshape(c_out * self.stride, c_in, taps))  # [(o, r), C, m]
                cached = self._conv_form = (kernels.conv_kernel_weight(conv_w),
                                            self.conv.bias.detach().repeat_interleave(self.stride))
        return cached


class SnakeBeta(nn.Module):
    """`x + sin(x·e^α)² / (e^β + 1e-9)`, α and β per channel (log-parameterised); one fused kernel
    (`kernels.snake_beta`, its output stored channels-last) when `use_kernels` is set, the torch reference
    otherwise."""

    use_kernels = False

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: Tensor) -> Tensor:  # [B, C, T]
        if self.use_kernels:  # stored channels-last: a conv reads it next (`CausalConv1d`, `CausalTransConv1d`)
            return kernels.snake_beta(x, self.alpha, self.beta, channels_last=True)
        return snake_beta_ref(x, self.alpha, self.beta)


class RMSNorm(nn.Module):
    """RMSNorm with fp32 statistics, rounded to the input dtype before the weight multiply: one launch of
    `kernels.rms_norm` when `use_kernels` is set (or under `kernels.batch_invariant()`), the torch reference
    (seven elementwise launches on CUDA) otherwise."""

    use_kernels = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if self.use_kernels or kernels.batch_invariant():
            return kernels.rms_norm(x, self.weight, self.eps)
        return rms_norm_ref(x, self.weight, self.eps)


class LayerScale(nn.Module):
    """Per-channel residual scale (parameter name `scale`)."""

    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x


class AttentionProjections(nn.Module):
    """q/k/v/o projections of a bias-free multi-head attention (codec decoder and Mimi encoder)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.q_proj = Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = Linear(heads * head_dim, hidden, bias=False)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate `x` [B, T, H, D] by cos/sin [B, T, D] (rotate-half convention)."""
    return x * cos[:, :, None] + rotate_half(x) * sin[:, :, None]


def sliding_window_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor,
                             window: int) -> Tensor:
    """Causal sliding-window attention: key j is visible to query i iff `q_i - window < k_j <= q_i`
    and `k_j >= 0` (negative positions mark empty history slots).

    q [B, T, H, D], k/v [B, S, H, D], q_pos [B, T], k_pos [B, S] -> [B, T, H, D]
    """
    delta = q_pos[:, :, None] - k_pos[:, None, :]  # [B, T, S]
    visible = (delta >= 0) & (delta < window) & (k_pos[:, None, :] >= 0)
    invariant = q.is_cuda and kernels.batch_invariant()  # see the module docstring
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION) if invariant else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=visible[:, None])  # [B, H, T, D]
    return out.transpose(1, 2)
