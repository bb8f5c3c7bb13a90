"""Per-sequence state slots.

`SlotPool` hands out slot ids 0..num_slots-1 (torch-free). `SlotState` holds the device tensors of
every slot, indexed by slot id, that one decode step reads and writes in place (so the step can be a
CUDA graph): the last sampled first-codebook token, the talker hidden it was sampled from, the
next KV position, the frame counter, the repetition-history mask, the trailing-text queue and the
sampler seed. Slot `num_slots` is the dummy slot that padding rows of a graph batch use; it is
never handed out. The codec's streaming state uses the same slot ids (StreamingDecoder slot pool).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from q3tts.models.transfer import upload


class SlotPool:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free_slot_ids = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest id
        self.owner: dict[int, object] = {}

    @property
    def num_free(self) -> int:
        return len(self.free_slot_ids)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self.free_slot_ids)

    @property
    def dummy_slot(self) -> int:
        return self.num_slots

    def acquire(self, owner: object) -> int:
        if not self.free_slot_ids:
            raise RuntimeError("SlotPool: no free slot")
        slot = self.free_slot_ids.pop()
        self.owner[slot] = owner
        return slot

    def release(self, slot: int) -> None:
        assert slot in self.owner, f"SlotPool: slot {slot} is not held"
        del self.owner[slot]
        self.free_slot_ids.append(slot)
        self.free_slot_ids.sort(reverse=True)

    def check_integrity(self) -> None:
        ids = sorted(self.free_slot_ids + list(self.owner))
        if ids != list(range(self.num_slots)):
            raise RuntimeError(f"SlotPool integrity check failed: free({len(self.free_slot_ids)}) + "
                               f"held({len(self.owner)}) != range({self.num_slots})")


_FLOAT_PARAMS = ("temperature", "top_p", "repetition_penalty", "subtalker_temperature", "subtalker_top_p")
_INT_PARAMS = ("top_k", "subtalker_top_k", "seed")
_BOOL_PARAMS = ("greedy", "cp_greedy")
# columns of `SlotState.load_sampling`'s one host-to-device copy: the slot, then each packed tensor's parameters
_INTS = slice(1, 1 + len(_INT_PARAMS))
_FLOATS = slice(_INTS.stop, _INTS.stop + len(_FLOAT_PARAMS))
_BOOLS = slice(_FLOATS.stop, _FLOATS.stop + len(_BOOL_PARAMS))
_LOAD_COLUMNS = _BOOLS.stop


def _column(packed: str, index: int) -> property:
    """Read-only attribute: column `index` of the packed tensor `packed`, a [S] view (writes go through)."""
    return property(lambda self: getattr(self, packed)[:, index])


@dataclass
class SamplingColumns:
    """Sampling parameters of R rows as [R] column views of three packed tensors (float32, int64, bool): R = every
    slot (`SlotState`), or a step's rows (`SlotState.sampling_rows`: one index op per packed tensor, where a step
    once gathered each of its parameters apart: 11 index ops)."""

    params_f: torch.Tensor     # [R, 5] float32, columns = _FLOAT_PARAMS
    params_i: torch.Tensor     # [R, 3] int64, columns = _INT_PARAMS
    params_b: torch.Tensor     # [R, 2] bool, columns = _BOOL_PARAMS

    # [R] column views, talker then code predictor
    temperature = _column("params_f", 0)
    top_p = _column("params_f", 1)
    repetition_penalty = _column("params_f", 2)
    sub_temperature = _column("params_f", 3)
    sub_top_p = _column("params_f", 4)
    top_k = _column("params_i", 0)
    sub_top_k = _column("params_i", 1)
    seed = _column("params_i", 2)  # uniform stream of the sequence
    greedy = _column("params_b", 0)
    sub_greedy = _column("params_b", 1)


@dataclass
class SlotState(SamplingColumns):
    """Device state of all slots (+1 dummy row). S = num_slots + 1, H = talker hidden, Q = text queue.

    The per-slot sampling parameters are `SamplingColumns` (R = S), so starting a batch of sequences writes
    them with one host-to-device copy (`load_sampling`)."""

    last_c0: torch.Tensor      # [S] int64, c0 sampled at the previous talker step
    past_hidden: torch.Tensor  # [S, H] model dtype, final-norm talker hidden that c0 was sampled from
    rep_mask: torch.Tensor     # [S, V] bool, c0 ids generated so far (repetition penalty)
    text_queue: torch.Tensor   # [S, Q, H] model dtype, trailing text rows (frame t adds row t)
    text_len: torch.Tensor     # [S] int64, valid rows of text_queue (past them: E_pad)

    @classmethod
    def allocate(cls, num_slots: int, hidden: int, vocab: int, queue: int,
                 dtype: torch.dtype, device: torch.device | str) -> SlotState:
        s = num_slots + 1
        i64 = dict(dtype=torch.int64, device=device)
        params_f = torch.ones(s, len(_FLOAT_PARAMS), dtype=torch.float32, device=device)
        return cls(
            last_c0=torch.zeros(s, **i64), past_hidden=torch.zeros(s, hidden, dtype=dtype, device=device),
            rep_mask=torch.zeros(s, vocab, dtype=torch.bool, device=device),
            text_queue=torch.zeros(s, queue, hidden, dtype=dtype, device=device),
            text_len=torch.zeros(s, **i64), params_f=params_f,
            params_i=torch.zeros(s, len(_INT_PARAMS), **i64),
            params_b=torch.ones(s, len(_BOOL_PARAMS), dtype=torch.bool, device=device),
        )

    def sampling_rows(self, slots: torch.Tensor) -> SamplingColumns:
        """The sampling parameters of `slots` [B] (three index ops)."""
        return SamplingColumns(self.params_f[slots], self.params_i[slots], self.params_b[slots])

    def load_sampling(self, slots: list[int], params: list) -> None:
        """Write SamplingParams `params[j]` into the parameter rows of `slots[j]`: one host-to-device copy of
        the slots and every parameter (float32 bits and bools as int64 columns), then one index copy per
        packed tensor (this runs on the time-to-first-audio path of every admitted batch)."""
        host = np.empty((len(slots), _LOAD_COLUMNS), dtype=np.int64)  # slot | ints | float32 bits | bools
        host[:, 0] = slots
        host[:, _INTS] = [[getattr(p, n) for n in _INT_PARAMS] for p in params]
        host[:, _FLOATS] = np.array([[getattr(p, n) for n in _FLOAT_PARAMS] for p in params],
                                    dtype=np.float32).view(np.int32)
        host[:, _BOOLS] = [[getattr(p, n) for n in _BOOL_PARAMS] for p in params]
        rows = upload(torch.from_numpy(host), self.params_f.device)  # [n, _LOAD_COLUMNS]
        idx = rows[:, 0]
        self.params_i.index_copy_(0, idx, rows[:, _INTS])
        self.params_f.index_copy_(0, idx, rows[:, _FLOATS].to(torch.int32).view(torch.float32))
        self.params_b.index_copy_(0, idx, rows[:, _BOOLS].bool())
