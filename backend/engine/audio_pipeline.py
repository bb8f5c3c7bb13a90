"""The codec one step behind the frames (`EngineConfig.codec_pipeline`): a frame's audio is decoded on the
codec's own stream while the next frames are made.

Without it a decode step forks the codec beside its talker half and joins it before the step ends, so
the step lasts code predictor + max(codec, talker). With it the step's graph only marks the point where
its frames exist (`frames_made`: an external event recorded inside the captured graph, right after the
code predictor); the codec of those frames is a graph of its own per bucket, launched on the codec
stream, waiting on that mark only. So the codec of frame t runs beside frame t's talker half and frame
t+1's code predictor, the engine hands frame t's codes to the host when its talker half ends and its
audio when the codec ends (`collect`), and the step lasts about code predictor + talker.

Ordering (all on the GPU, no host wait):
- the codec copies the step's slots and frames into its own inputs first (`launch`); the next step's
  metadata upload and frames wait for that copy (`before_step`), so a slow codec throttles the steps
  instead of reading overwritten frames;
- the codec's state writes of a stream (reset / primed state of a new sequence) run on the codec stream
  (`ordered`), after the audio of the slot's previous sequence and before the new one's first frame;
- each launch's audio goes to its own pinned host buffer (two, alternating), so the host reads frame
  t's audio while frame t+1's is being copied.
On the CPU everything runs in line at `launch` (same order, same bits): the engine's pipelined flow is
the same there, which is what the CPU tests check.

With `EngineConfig.codec_sms` = N the codec stream belongs to a CUDA green context of N SMs: its graphs are
captured there, so their kernels run on those N SMs only and leave the others to the frame's work. The
context lives as long as the process (`green_context`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections import deque

import numpy as np
import torch

from .cuda_graph import WhileWaiting, wait_for


class AudioPipeline:
    """The codec's inputs, graphs (one per decode bucket), stream, events and host audio buffers."""

    def __init__(self, codec, max_batch: int, groups: int, dummy_slot: int, device: torch.device,
                 sms: int = 0) -> None:
        self.codec, self.device = codec, device
        self.slots = torch.full((max_batch,), dummy_slot, dtype=torch.int64, device=device)  # [Bmax]
        self.frames = torch.zeros(max_batch, groups, dtype=torch.int64, device=device)  # [Bmax, 16]
        self.pcm = torch.zeros(max_batch, codec.samples_per_frame, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pending: deque[tuple[int, int, torch.cuda.Event | None]] = deque()  # (rows, host buffer, done)
        self._next_host = 0
        self.green = None  # the green context of `sms` SMs the codec stream belongs to (CUDA, sms > 0)
        if device.type != "cuda":  # everything in line (no stream, no events)
            self.stream = self.made = self.taken = None
            self.host = [torch.zeros_like(self.pcm) for _ in range(2)]
            return
        if sms:
            self.green = green_context(sms, device)
            self.stream = self.green.Stream()
        else:
            self.stream = torch.cuda.Stream(device)
        self.made = torch.cuda.Event(external=True)  # recorded inside the step graph: the frames exist
        self.taken = torch.cuda.Event()  # the codec has copied the step's slots and frames
        self.host = [torch.zeros(self.pcm.shape, dtype=torch.float32, pin_memory=True) for _ in range(2)]

    # --- inside the step (captured) ----------------------------------------------------------------

    def frames_made(self) -> None:
        """Mark the point in the step where its frames are written (the codec waits for this only)."""
        if self.made is not None:
            self.made.record(torch.cuda.current_stream(self.device))

    # --- around the step ---------------------------------------------------------------------------

    def wait_frames(self, while_waiting: WhileWaiting | None = None) -> None:
        """Wait until the last launched step's frames are made (its `frames_made` mark), running `while_waiting`
        meanwhile (on the CPU they are made already: it runs once)."""
        wait_for(self.made, while_waiting)

    def before_step(self) -> None:
        """The step about to be loaded waits (on the GPU) until the codec took the last step's inputs."""
        if self.taken is not None:
            torch.cuda.current_stream(self.device).wait_event(self.taken)

    def launch(self, bucket: int, rows: int, slots: torch.Tensor, frames: torch.Tensor) -> None:
        """The audio of the step just launched: slots [>= bucket] and frames [>= bucket, 16] are the
        step's buffers (read once its frames are made); `collect` returns rows [:rows] of it."""
        if len(self.pending) == len(self.host):
            raise RuntimeError("AudioPipeline: collect the audio of earlier launches first")
        host = self._next_host
        self._next_host = (host + 1) % len(self.host)
        done = None
        with self._on_stream():
            if self.made is not None:
                self.stream.wait_event(self.made)
            self.slots[:bucket].copy_(slots[:bucket])
            self.frames[:bucket].copy_(frames[:bucket])
            if self.taken is not None:
                self.taken.record(self.stream)
            graph = self.graphs.get(bucket)
            if graph is not None:
                graph.replay()
            else:
                self.decode(bucket)
            self.host[host][:rows].copy_(self.pcm[:rows], non_blocking=True)
            if self.stream is not None:
                done = torch.cuda.Event()
                done.record(self.stream)
        self.pending.append((rows, host, done))

    def collect(self, while_waiting: WhileWaiting | None = None) -> np.ndarray:
        """pcm [rows, samples] float32 of the oldest launch not yet collected (waits for its codec, running
        `while_waiting` meanwhile): a view of a host buffer, valid until the launch after next."""
        rows, host, done = self.pending.popleft()
        if done is not None:
            wait_for(done, while_waiting)
        return self.host[host][:rows].numpy()

    @contextlib.contextmanager
    def ordered(self):
        """Run codec-state writes (stream resets, primed states) on the codec stream: after the audio
        already launched and the device work queued so far, before the next launch's audio."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    # --- the codec's graphs ------------------------------------------------------------------------

    def decode(self, bucket: int) -> None:
        """pcm[:bucket] <- the codec of frames[:bucket] into streams slots[:bucket] (the captured body)."""
        self.pcm[:bucket].copy_(self.codec.decode_frame(self.slots[:bucket], self.frames[:bucket]))

    def capture(self, buckets: tuple[int, ...]) -> None:
        """One graph per bucket on the codec stream, in a memory pool of its own (the codec runs beside
        the step's graphs, so it may share no memory with them). The inputs are padding rows (the
        scratch slot) while capturing, so capture touches only the scratch stream."""
        from q3tts import kernels

        self.slots.fill_(self.codec.scratch_slot)
        self.frames.zero_()
        pool = None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for bs in sorted(buckets, reverse=True):
            with torch.cuda.stream(self.stream), kernels.tuning():
                self.decode(bs)  # warm-up: kernel tuning for this bucket, the allocator
            self.stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=self.stream):
                self.decode(bs)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()


def green_context(sms: int, device: torch.device):
    """The CUDA green context of `sms` SMs of `device` (EngineConfig.codec_sms), made once per process and
    never released; a ValueError naming the setting where the device has fewer SMs, or where torch or the
    driver cannot make one.

    Never released: the caching allocator frees a block that was used on a stream by recording an event on
    that stream, so a context destroyed while one of its codec's tensors lived (graph pool memory, outputs,
    freed later by the garbage collector or at exit) aborted the process ("context is destroyed", on the H200).
    The driver frees the context with the process."""
    total = torch.cuda.get_device_properties(device).multi_processor_count
    if sms > total:
        raise ValueError(f"EngineConfig: codec_sms={sms} exceeds the {total} SMs of {device}")
    return _green_context(sms, torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _green_context(sms: int, index: int):
    from torch.cuda.green_contexts import GreenContext

    try:
        with torch.cuda.device(index):
            context = GreenContext.create(num_sms=sms)
    except RuntimeError as exc:
        raise ValueError(f"EngineConfig: codec_sms={sms}: no CUDA green context on cuda:{index} ({exc})") from exc
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(context))  # not even at interpreter exit (its tensors outlive it)
    return context
