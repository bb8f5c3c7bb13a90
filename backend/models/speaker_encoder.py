"""ECAPA-TDNN speaker encoder (spec f.2): 24 kHz audio -> x-vector [enc_dim] for Base voice cloning.

`SpeakerEncoder(SpeakerEncoderConfig)` has state_dict names equal to the released `speaker_encoder.*`
keys minus the prefix. `forward(mels [B, T, mel_dim]) -> [B, enc_dim]`; `embed(wav)` adds the
reference's mel front end (`q3tts.codec.audio.mel_spectrogram`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from q3tts.codec.audio import mel_spectrogram
from ..config import SpeakerEncoderConfig


def _conv(c_in: int, c_out: int, kernel: int = 1, dilation: int = 1) -> nn.Conv1d:
    return nn.Conv1d(c_in, c_out, kernel, dilation=dilation, padding="same", padding_mode="reflect")


class TDNN(nn.Module):
    """Reflect-padded 'same' Conv1d + ReLU."""

    def __init__(self, c_in: int, c_out: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.conv = _conv(c_in, c_out, kernel, dilation)

    def forward(self, x: Tensor) -> Tensor:  # [B, C, T]
        return torch.relu(self.conv(x))


class Res2Net(nn.Module):
    """Split channels into `scale` groups; group i>0 = TDNN(group_i + out_{i-1}) (group 1: no add)."""

    def __init__(self, channels: int, scale: int, kernel: int, dilation: int) -> None:
        super().__init__()
        width = channels // scale
        self.scale = scale
        self.blocks = nn.ModuleList(TDNN(width, width, kernel, dilation) for _ in range(scale - 1))

    def forward(self, x: Tensor) -> Tensor:
        parts = list(torch.chunk(x, self.scale, dim=1))
        out = [parts[0]]
        for i, block in enumerate(self.blocks, start=1):
            out.append(block(parts[i] if i == 1 else parts[i] + out[-1]))
        return torch.cat(out, dim=1)


class SqueezeExcite(nn.Module):
    """Channel gate from the time-mean: x · sigmoid(conv2(relu(conv1(mean_t x))))."""

    def __init__(self, channels: int, se_channels: int) -> None:
        super().__init__()
        self.conv1 = _conv(channels, se_channels)
        self.conv2 = _conv(se_channels, channels)

    def forward(self, x: Tensor) -> Tensor:
        gate = torch.sigmoid(self.conv2(torch.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gate


class SERes2NetBlock(nn.Module):
    """TDNN k1 -> Res2Net -> TDNN k1 -> SE, plus residual."""

    def __init__(self, c_in: int, c_out: int, scale: int, se_channels: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.tdnn1 = TDNN(c_in, c_out, 1, 1)
        self.res2net_block = Res2Net(c_out, scale, kernel, dilation)
        self.tdnn2 = TDNN(c_out, c_out, 1, 1)
        self.se_block = SqueezeExcite(c_out, se_channels)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def _weighted_stats(x: Tensor, w: Tensor, eps: float = 1e-12) -> tuple[Tensor, Tensor]:
    """Mean and std over time of x [B, C, T] under weights w [B, C|1, T] summing to 1 -> [B, C] each."""
    mean = (w * x).sum(dim=2)
    std = torch.sqrt((w * (x - mean[..., None]).pow(2)).sum(dim=2).clamp(eps))
    return mean, std


class AttentiveStatsPool(nn.Module):
    """Attention over time conditioned on global mean/std; returns cat(weighted mean, weighted std)."""

    def __init__(self, channels: int, attention_channels: int) -> None:
        super().__init__()
        self.tdnn = TDNN(channels * 3, attention_channels, 1, 1)
        self.conv = _conv(attention_channels, channels)

    def forward(self, x: Tensor) -> Tensor:  # [B, C, T] -> [B, 2C, 1]
        t = x.shape[-1]
        uniform = torch.ones_like(x[:, :1]) / t  # [B, 1, T]
        mean, std = _weighted_stats(x, uniform)
        context = torch.cat([x, mean[..., None].expand(-1, -1, t), std[..., None].expand(-1, -1, t)], dim=1)
        attn = torch.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = _weighted_stats(x, attn)
        return torch.cat([mean, std], dim=1)[..., None]


class SpeakerEncoder(nn.Module):
    """ECAPA-TDNN x-vector extractor."""

    def __init__(self, config: SpeakerEncoderConfig) -> None:
        super().__init__()
        ch, ks, dil = config.enc_channels, config.enc_kernel_sizes, config.enc_dilations
        if not len(ch) == len(ks) == len(dil):
            raise ValueError("enc_channels, enc_kernel_sizes and enc_dilations must have the same length")
        self.config = config
        self.blocks = nn.ModuleList([TDNN(config.mel_dim, ch[0], ks[0], dil[0])])
        for i in range(1, len(ch) - 1):
            self.blocks.append(SERes2NetBlock(ch[i - 1], ch[i], config.enc_res2net_scale,
                                              config.enc_se_channels, ks[i], dil[i]))
        self.mfa = TDNN(ch[-1], ch[-1], ks[-1], dil[-1])
        self.asp = AttentiveStatsPool(ch[-1], config.enc_attention_channels)
        self.fc = _conv(ch[-1] * 2, config.enc_dim)

    def forward(self, mels: Tensor) -> Tensor:
        """mels [B, T, mel_dim] -> x-vectors [B, enc_dim]."""
        x = mels.transpose(1, 2)  # [B, mel, T]
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        x = self.mfa(torch.cat(outs[1:], dim=1))  # [B, C_last, T]
        return self.fc(self.asp(x))[..., 0]

    @torch.inference_mode()
    def embed(self, wav: Tensor) -> Tensor:
        """wav [n] float32 mono at 24 kHz -> x-vector [enc_dim] (in the module dtype)."""
        p = next(self.parameters())
        mels = mel_spectrogram(wav.float().cpu()[None]).transpose(1, 2)  # [1, T, 128]
        return self(mels.to(device=p.device, dtype=p.dtype))[0]
