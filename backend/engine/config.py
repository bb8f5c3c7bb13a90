"""`EngineConfig`: the one frozen object every engine part is built from.

Built at the edge (synth CLI, Triton `initialize`, bench) and validated in `__post_init__`. Values
that depend on the model or the device (the page count when only a memory fraction is given) are
filled into a copy made with `dataclasses.replace` by `resolve()`; nothing writes to a config.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

KV_POLICIES = ("reserve", "on_demand")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TEST_HOOKS_ENV = "Q3TTS_TEST_HOOKS"  # =1 allows the test-only fields (fault_injection_seed)
CHAIN_TUNE_ROWS = 16  # the largest batch `chain_tune` times (the fused GEMMs' first row class)


@dataclass(frozen=True)
class EngineConfig:
    """Engine sizing and policy.

    page_size            talker KV tokens per page
    num_pages            KV pages in the pool (None: derived from `kv_memory_fraction` by `resolve`)
    kv_memory_fraction   share of free device memory given to the KV pool when `num_pages` is None
    max_slots            sequences running at once (= state slots, = largest decode batch)
    max_queue            admitted-but-waiting sequences; one more is rejected with AdmissionRejected
    max_prompt_tokens    prefill rows of one prompt (and text tokens of one request) at most
    max_prefill_tokens   prompt rows prefilled in one step (the sequences started in a step share one
                         ragged forward): a sequence that would go past it waits for the next step,
                         and so do the ones behind it (FIFO); a prompt longer than this is prefilled in
                         pieces over several steps while the playing streams step (chunked prefill,
                         scheduler.py 2.)
    max_step_seconds     deadline scheduling (scheduler.py, 2.): a step that prefills keeps its modelled
                         time (decode step + prefill rows, measured by the engine) within this bound and
                         within the slack of the streams already playing (when their audio runs out, played
                         in real time from their first frame), so arrivals never starve a playing stream;
                         None: off (arrivals start as soon as slots, pages and max_prefill_tokens allow).
                         0.05 suits the H200 (decode step 10-20 ms, a 61-row prefill 3 ms, 80 ms per frame)
    max_text_tokens      trailing text rows one sequence may queue (incremental mode): the per-slot
                         device text queue has this many rows of width H
    max_frames           engine-wide cap on frames per sequence (SamplingParams.max_frames is clipped)
    frames_per_text_token, min_text_frames
                         the runaway guard: a request without max_frames may make at most
                         max(min_text_frames, ceil(frames_per_text_token * its text tokens)) frames (and
                         never more than max_frames), then ends with reason 'max_frames'. Speech runs at
                         about 4 frames (0.3 s) per text token (English ~3.3 tokens/s at 12.5 frames/s;
                         Chinese ~4 characters/s, one token each), so 10 is 2.5x a slow reading; the floor
                         (64 frames = 5.1 s) leaves a one-word text room for its silences. Streamed text
                         raises the cap as its tokens arrive; an explicit max_frames replaces the guard
    kv_policy            'reserve': a sequence gets pages for prompt + max_frames at admission, so a
                         running sequence never runs out; 'on_demand': pages are taken as frames are
                         made and, if the pool runs dry, the newest running sequence is aborted with
                         reason 'error' (see scheduler.Scheduler.grow)
    graph_batch_sizes    decode batch buckets captured as CUDA graphs (padded up to the next bucket)
    dtype, device        model dtype and torch device
    use_cuda_graphs      capture/replay the decode step on CUDA (ignored on CPU: eager there)
    prefill_graphs       capture/replay the prefill of the sequences a step starts (talker forward + first
                         c0 draw, prompts packed into 64..4096-row token buckets, engine/prefill_graph.py)
                         on CUDA; a step past the largest bucket runs eagerly (ignored on CPU)
    codec_kernels        run the codec's convs and SnakeBeta through q3tts.kernels (Triton conv timed
                         against cuDNN per shape in the graph warm-up, fused SnakeBeta; on CPU their torch
                         references). On the H200 served at 64 streams: 247-249 audio-s/s against 198-199
                         off, first audio no later (two interleaved A/B rounds, perf/results/RESULTS.md)
    codec_fusion         with the codec's kernels: each SnakeBeta made in the epilogue of the conv before it, the
                         transposed convs' phases interleaved there, the codebook lookups summed in one launch
                         (CodecDecoder.use_kernels: the same bits, 62-80 fewer launches a step). Off: on an H100 the
                         step took 4.32 / 5.45 / 8.64 ms at 1 / 16 / 64 rows on, 4.21 / 5.51 / 8.43 off (one run
                         each, perf/results/RESULTS.md, fifty-second session); not yet served
    codec_pipeline       decode each frame's audio one step behind, on the codec's own stream beside the
                         next frame's work (engine/audio_pipeline.py), instead of inside the step beside its
                         talker half. None (default): where the decode step is a CUDA graph with one step in
                         flight; True: also with two, eager and on the CPU (same bits; tests); False: never.
                         With two steps in flight the codec in the step serves as much or more: H200, 12.4 against
                         11.9 audio-s/s at 1 stream, 160.5 against 154-155 at 16, equal at 64 (twentieth session);
                         H100 at 68b0161, 519.4 against 495.8 at 64 streams (one server each: inside the ±8 % a
                         server's 64-stream figure moves on one machine, fiftieth session), though the bench step
                         one step behind is 5.46 against 5.53 ms at 16 rows (8.53 against 8.38 at 64; forty-ninth
                         session, perf/results/RESULTS.md)
    codec_sms            the SMs the pipelined codec may run on: 0 (default) all of them; N > 0 a CUDA green
                         context of N SMs (engine/audio_pipeline.py), so the codec's kernels cannot hold the
                         SMs the next frame's chain of small kernels waits for. For the pipelined codec only
                         (refused where the codec runs in the step; ignored on the CPU). On the H200
                         (profile_step's overlap probe, frame work and codec forked in one graph at 64 rows):
                         64 SMs 8.14 against 8.98 ms per frame; no gain at 1 and 16 rows. On an H100 at 68b0161
                         (bench, two steps in flight) 66 SMs took the 64-row step to 7.94 ms from 8.53 on all SMs
                         and 8.38 with the codec in the step; not yet served (perf/results/RESULTS.md)
    fused_code_predictor the largest decode bucket whose code predictor runs its 15 passes through the fused
                         kernels (kernels/code_predictor.py, 22-23 launches a pass; where the kernels serve the
                         device); larger buckets run the eager passes; 0: never. 16: on the H200 (1.7B, bf16,
                         graphs) the fused passes made the step 1.4-2.1 ms faster at batch 1-16 (fourth
                         session); at 32 the eager passes have since overtaken them (step 8.35 against 8.91 ms
                         at a6db826; served at 32 streams 266.8 against 255.3 audio-s/s, one round each;
                         perf/results/RESULTS.md)
    fused_talker         the largest decode bucket whose talker decode forward runs through its fused kernels
                         (models/talker_fused.py, 5 launches per layer; where the kernels serve the device);
                         larger buckets and the prefill run the eager stack; 0: never. 16: on the H200
                         (once the GEMMs' RMSNorm prologue read a 2048-wide row in 4 round trips, not 16),
                         served 16 streams' first audio came 2-4 ms sooner at p50 and 7-8 ms at p99 in two
                         interleaved A/B rounds (64 streams: one round each way; perf/results/RESULTS.md)
    fp32_residual        keep the residual stream of the talker and code predictor in fp32 (the normed rows
                         that feed the GEMMs stay in `dtype`); the fused code predictor and talker are not
                         used with it. Off: the official model's arithmetic (the stream rounded to bf16),
                         which fails issue 11's bf16 fidelity gates on random weights. On the H200 it lifts
                         the logits cosine over its gate (0.999872 -> 0.999962) but not the c0 agreement
                         (97.5 -> 98.5 %, gate 99 %) and costs 23 % at batch 1 (perf/results/RESULTS.md)
    batch_invariant      a row's codes and PCM do not depend on the batch it ran in (which decode bucket or
                         prefill token bucket, what the other rows hold): the engine turns on
                         `q3tts.kernels.set_batch_invariant` (process-wide, left on), every linear layer runs
                         through `kernels.linear` (models/layers.py `linear`), the fused code predictor serves
                         every bucket, the codec's convs run through the kernels (as with codec_kernels) and
                         its transposed / depthwise convs and attention through row-independent paths
                         (codec/layers.py), and the eager prefill attends each prompt alone. Off: cuBLAS /
                         cuDNN / torch reductions pick their reduction order by shape (16 identical greedy
                         bf16 requests served together: 29.7 dB from the same request alone). Off by
                         default: on the H200 it costs 5 / 6 / 24 % per step at batch 1 / 16 / 64 and
                         doubles first audio at 16 and 64 streams (the prefill's GEMMs without split-K or
                         cuBLAS tiles), over the 10 % the issue allows (perf/results/RESULTS.md)
    programmatic_launch  launch the fused kernels (code predictor, fused talker, their sampling) with programmatic
                         dependent launch where the device has it (Hopper+): a GEMM whose weight tile fits its
                         programs' registers loads it, then waits for the kernel before while that one still runs
                         (`q3tts.kernels.set_programmatic_launch`, process-wide, left as set; kernels/_launch.py).
                         Same bits either way. On an H100: the step 4.70 -> 4.12 ms at one row, 6.50 -> 6.24 at
                         16, equal at 64; served +13 % audio-s/s at one stream, +5 % at 16, +1 % at 64, in
                         three interleaved rounds without a stall (perf/results/RESULTS.md, thirty-ninth session)
    run_ahead            the engine process (serving/engine_process.py) runs its next step as soon as it has
                         answered one, before the serving loop asks for it, so that the device's next step does
                         not wait for the serving loop to route the last step's outputs (nor for that step's
                         audio); the serving loop's calls that come meanwhile reach the step after the one they
                         precede only when they come after its wait for the device. Same bits either way. Off
                         by default until an H200 A/B: on the 2-core CPU (tiny checkpoint, 8 streams) the step
                         ahead takes the cores the serving loop routes with, and first audio came ~45 ms later
                         at p50 in 3 of 3 interleaved runs (perf/results/RESULTS.md)
    steps_in_flight      decode steps launched ahead of the host, where the step runs ahead of it (the pipelined
                         codec, or a CUDA graph; on the CPU without the pipelined codec the step is synchronous):
                         2 (default) launches step t+1 before it lands step t (scheduled with t's frames
                         counted as made: the slots' state is already on the device), so the host's turn
                         between steps (landing t's frames, scheduling, packing t+1's rows) runs while t+1
                         does; 1 lands t first, and the device idles through that turn. Same codes and audio
                         either way; a row that ends at t (EOS) runs once more in t+1, its frame dropped (the
                         codec clamps that frame's EOS code into its codebook); a request added while the
                         engine waits for t starts with t+2, not t+1. On the H200
                         served at 1 / 16 / 64 streams: 11.95 / 156.2 / 446-461 audio-s/s against 10.38 /
                         136.4 / 420-427 with 1, the device idle between steps ~0 against 0.8-1.2 ms; first
                         audio at p50 0.5 ms sooner / 2.2 ms later / no later, at p99 sooner or equal
                         (perf/results/RESULTS.md)
    launch_at_frames     with two steps in flight and the pipelined codec (codec_pipeline true; refused without
                         them): launch step t+1 once step t's frames are made (its code predictor done: the
                         host polls the mark the step graph records there, engine/audio_pipeline.py), not as
                         soon as the call begins, so a request added before then still joins t+1 (at once it
                         joins t+2: first audio at 16 streams 2.2 ms later at p50), while the host's turn still
                         runs beside t's talker half (about 1.9 ms at 1 and 64 rows on the H200). Same codes
                         and audio either way. Off: served at 64 streams on the H200, first audio no sooner (p50
                         48.5 and 60.9 against 49.6 and 53.3 ms)
    chain_tune           tune the launch configs of the fused code predictor (its 15 passes) and of the fused
                         talker (its decode forward) on their device time in one CUDA graph at 1 and 16 rows
                         (`chain_tune_batches`; engine/chain_tuning.py), not one launch at a time, before the
                         decode graphs are captured; once per tuning table and part: it leaves a mark in the
                         table, so an engine that loads it (`tune_cache`) times nothing again. CUDA with graphs,
                         for each fused part that serves the step (not under `fp32_residual` or
                         Q3TTS_KERNELS=torch) only. On the H200 (1.7B, bf16, one machine) the code predictor's
                         took 46 s and the step 5.32 / 6.86 ms at 1 / 16 rows against 5.61 / 7.31 off (served 1
                         and 16 streams: 4.5-5.7 % more audio-s/s, first audio no later at p90 / p99, in two
                         interleaved rounds); the talker's took 27 s and the step 5.04 / 6.51 ms against 5.34 /
                         6.76 (served 1 and 16 streams: 4.6-8.7 % more audio-s/s in two interleaved rounds;
                         perf/results/RESULTS.md)
    tune_cache           a file that keeps the kernels' tuned launch configs between engines (kernels/autotune.py
                         `save_tuned` / `load_tuned`; valid for the same GPU model, torch, triton and kernel
                         sources): an engine takes what it holds and writes back what it tuned, so an engine
                         process that replaces one after a device fault, or a restarted server, times nothing
                         again. None: off. `q3tts serve` on GPUs sets it (render.default_tune_cache)
    voice_cache_bytes    device memory for the Base voices kept prepared (engine/voice_cache.py: x-vector,
                         reference codes, an ICL voice's primed codec stream; least recently used first
                         out). 256 MiB holds about 60 ICL voices of the released 1.7B in bfloat16 (a
                         primed stream is 2.5 MiB, 30 s of reference codes 48 KiB); 0 keeps none
    fault_injection_seed TEST ONLY (refused unless Q3TTS_TEST_HOOKS=1): a decode step holding a sequence with
                         this seed causes a device fault (engine/faults.py: on CUDA a real device-side
                         assert, which poisons the context), to test the serving layer's healing
    """

    page_size: int = 16
    num_pages: int | None = None
    kv_memory_fraction: float = 0.5
    max_slots: int = 64
    max_queue: int = 256
    max_prompt_tokens: int = 2048
    max_prefill_tokens: int = 4096
    max_step_seconds: float | None = None
    max_text_tokens: int = 1024
    max_frames: int = 8192
    frames_per_text_token: float = 10.0
    min_text_frames: int = 64
    kv_policy: str = "on_demand"
    graph_batch_sizes: tuple[int, ...] = DEFAULT_GRAPH_BATCH_SIZES
    dtype: str = "bfloat16"
    device: str = "cuda"
    use_cuda_graphs: bool = True
    prefill_graphs: bool = True
    codec_kernels: bool = True
    codec_fusion: bool = False
    codec_pipeline: bool | None = None
    codec_sms: int = 0
    fused_code_predictor: int = 16
    fused_talker: int = 16
    fp32_residual: bool = False
    batch_invariant: bool = False
    programmatic_launch: bool = True
    run_ahead: bool = False
    steps_in_flight: int = 2
    launch_at_frames: bool = False
    chain_tune: bool = True
    tune_cache: str | None = None
    voice_cache_bytes: int = 256 << 20
    fault_injection_seed: int | None = None

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"EngineConfig: {msg}")

        need(self.page_size >= 1, f"page_size must be >= 1, got {self.page_size}")
        need(self.num_pages is None or self.num_pages >= 1, f"num_pages must be >= 1, got {self.num_pages}")
        need(0 < self.kv_memory_fraction <= 1, f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        need(self.max_slots >= 1, f"max_slots must be >= 1, got {self.max_slots}")
        need(self.max_queue >= 0, f"max_queue must be >= 0, got {self.max_queue}")
        need(self.max_prompt_tokens >= 1, f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        need(self.max_prefill_tokens >= 1, f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        need(self.max_step_seconds is None or (math.isfinite(self.max_step_seconds) and self.max_step_seconds > 0),
             f"max_step_seconds must be a finite number > 0 or null, got {self.max_step_seconds}")
        need(self.max_text_tokens >= 1, f"max_text_tokens must be >= 1, got {self.max_text_tokens}")
        need(self.max_frames >= 1, f"max_frames must be >= 1, got {self.max_frames}")
        need(math.isfinite(self.frames_per_text_token) and self.frames_per_text_token > 0,
             f"frames_per_text_token must be a finite number > 0, got {self.frames_per_text_token}")
        need(self.min_text_frames >= 1, f"min_text_frames must be >= 1, got {self.min_text_frames}")
        need(self.voice_cache_bytes >= 0, f"voice_cache_bytes must be >= 0, got {self.voice_cache_bytes}")
        need(self.kv_policy in KV_POLICIES, f"kv_policy must be one of {KV_POLICIES}, got {self.kv_policy!r}")
        need(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        bs = self.graph_batch_sizes
        need(isinstance(bs, tuple) and len(bs) > 0, "graph_batch_sizes must be a non-empty tuple")
        need(all(isinstance(b, int) and b >= 1 for b in bs), f"graph_batch_sizes must be ints >= 1, got {bs}")
        need(list(bs) == sorted(set(bs)), f"graph_batch_sizes must be strictly increasing, got {bs}")
        need(self.fault_injection_seed is None or os.environ.get(TEST_HOOKS_ENV) == "1",
             f"fault_injection_seed is a test hook: refused unless {TEST_HOOKS_ENV}=1")
        need(self.tune_cache is None or (isinstance(self.tune_cache, str) and self.tune_cache != ""),
             f"tune_cache must be a file path or null, got {self.tune_cache!r}")
        need(self.codec_pipeline is None or isinstance(self.codec_pipeline, bool),
             f"codec_pipeline must be true, false or null, got {self.codec_pipeline!r}")
        need(type(self.steps_in_flight) is int and self.steps_in_flight in (1, 2),
             f"steps_in_flight must be 1 or 2, got {self.steps_in_flight!r}")
        for name in ("fused_code_predictor", "fused_talker", "codec_sms"):
            need(type(getattr(self, name)) is int and getattr(self, name) >= 0,
                 f"{name} must be an int >= 0, got {getattr(self, name)!r}")
        for name in ("use_cuda_graphs", "prefill_graphs", "codec_kernels", "codec_fusion", "fp32_residual",
                     "batch_invariant", "programmatic_launch", "run_ahead", "launch_at_frames", "chain_tune"):
            need(isinstance(getattr(self, name), bool), f"{name} must be true or false, got {getattr(self, name)!r}")
        # the pipelined codec's own settings, refused where the codec runs in the step even on CUDA
        in_step = not self._pipelines_codec("cuda")
        need(not self.codec_sms or not in_step,
             f"codec_sms={self.codec_sms} sets the pipelined codec's SMs, but the codec runs in the step (codec_pipeline "
             f"{self.codec_pipeline}, steps_in_flight {self.steps_in_flight}): set codec_pipeline=true")
        need(not self.launch_at_frames or (self.codec_pipeline is True and self.steps_in_flight == 2),
             "launch_at_frames waits for the mark the pipelined codec reads: it needs codec_pipeline=true and "
             f"steps_in_flight=2, got {self.codec_pipeline} and {self.steps_in_flight}")

    # --- derived values ---------------------------------------------------------------------------

    @property
    def max_graph_batch(self) -> int:
        """Largest decode batch a graph serves: the first bucket >= max_slots, else the largest."""
        return self.bucket_for(self.max_slots) or self.graph_batch_sizes[-1]

    @property
    def fused_code_predictor_batch(self) -> int:
        """The largest decode batch whose code predictor runs the fused kernels: every batch under
        `batch_invariant` (one path whatever the bucket), else `fused_code_predictor`."""
        return max(self.max_graph_batch, self.max_slots) if self.batch_invariant else self.fused_code_predictor

    def chain_tune_batches(self, fused_batch: int) -> tuple[int, ...]:
        """The batch sizes `chain_tune` times a fused part at whose largest fused batch is `fused_batch`
        (`fused_code_predictor_batch`, `fused_talker_batch`): one row, and that batch up to 16 (its GEMMs' row class
        16 covers 2-16 rows; above, the row classes keep their launch-at-a-time picks). Empty: no chain tuning."""
        top = min(CHAIN_TUNE_ROWS, fused_batch, self.max_graph_batch)
        return tuple(sorted({1, top})) if self.chain_tune and top else ()

    def pipelines_codec(self, device: torch.device) -> bool:
        """Whether the codec runs one step behind (`codec_pipeline`) on `device`."""
        return self._pipelines_codec(device.type)

    def _pipelines_codec(self, device_type: str) -> bool:
        if self.codec_pipeline is None:
            return device_type == "cuda" and self.use_cuda_graphs and self.steps_in_flight == 1
        return self.codec_pipeline

    @property
    def fused_talker_batch(self) -> int:
        """The largest decode batch whose talker runs the fused kernels: none under `batch_invariant`
        (the eager stack at every bucket: one path, the one the invariance tests verify), else
        `fused_talker`."""
        return 0 if self.batch_invariant else self.fused_talker

    def bucket_for(self, batch: int) -> int | None:
        """Smallest captured bucket holding `batch` rows, None if the batch is larger than all."""
        return next((b for b in self.graph_batch_sizes if b >= batch), None)

    def text_frame_cap(self, text_tokens: int | None) -> int:
        """The frames a request without max_frames may make once its text has `text_tokens` tokens (None: its
        text may still grow without bound, so only the engine-wide `max_frames` bounds it)."""
        if text_tokens is None:
            return self.max_frames
        return min(self.max_frames, max(self.min_text_frames, math.ceil(self.frames_per_text_token * text_tokens)))

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    @property
    def sequence_pages(self) -> int:
        """Pages of the longest sequence (prompt and frames): the decode step's block-table width."""
        return self.pages_for(self.max_prompt_tokens + self.max_frames)

    def resolve(self, bytes_per_page: int, free_bytes: int | None) -> EngineConfig:
        """Copy with `num_pages` filled in (from the memory fraction when it was None)."""
        if self.num_pages is not None:
            return self
        if free_bytes is None:  # CPU: no device budget to split; enough for max_slots full sequences
            pages = self.max_slots * self.sequence_pages
        else:
            pages = int(free_bytes * self.kv_memory_fraction) // bytes_per_page
        if pages < 1:
            raise ValueError(f"EngineConfig: KV memory budget gives no page ({free_bytes} B free, "
                             f"{bytes_per_page} B/page, fraction {self.kv_memory_fraction})")
        return dataclasses.replace(self, num_pages=pages)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"EngineConfig: unknown fields {unknown}")
        d = dict(d)
        if "graph_batch_sizes" in d:
            d["graph_batch_sizes"] = tuple(d["graph_batch_sizes"])
        return cls(**d)

    @classmethod
    def from_json(cls, path: str | Path) -> EngineConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))
