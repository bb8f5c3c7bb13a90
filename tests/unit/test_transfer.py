"""models/transfer.py: host-to-device copies that do not wait for the device."""

from __future__ import annotations

import pytest
import torch

from q3tts.models.transfer import upload


def test_upload_on_cpu_is_a_plain_copy():
    t = torch.arange(6).view(2, 3)
    assert torch.equal(upload(t, "cpu"), t)
    out = torch.zeros(2, 3, dtype=torch.int64)
    assert upload(t, "cpu", out=out) is out and torch.equal(out, t)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_upload_returns_while_the_stream_is_busy():
    """The copy is queued behind a long kernel instead of waiting for it (a pageable copy would), and lands
    in stream order; `out` too."""
    t = torch.arange(1000)
    done = torch.cuda.Event()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU cycles on the current stream
    done.record()
    got = upload(t, "cuda")
    out = upload(t, "cuda", out=torch.zeros(1000, dtype=torch.int64, device="cuda"))
    assert not done.query(), "upload waited for the work queued before it"
    assert torch.equal(got.cpu(), t) and torch.equal(out.cpu(), t)
