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

import torch


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


@dataclass
class SlotState:
    """Device state of all slots (+1 dummy row). S = num_slots + 1, H = talker hidden size."""

    last_c0: torch.Tensor      # [S] int64, c0 sampled at the previous talker step
    past_hidden: torch.Tensor  # [S, H] model dtype, final-norm talker hidden that c0 was sampled from
    position: torch.Tensor     # [S] int64, KV position of the next talker token (= L0 + frames)
    num_frames: torch.Tensor   # [S] int64, frames made so far (= index of the next frame)
    rep_mask: torch.Tensor     # [S, V] bool, c0 ids generated so far (repetition penalty)
    text_ids: torch.Tensor     # [S, Q] int64, trailing text ids (T1.., then tts_eos); rest = tts_pad
    text_len: torch.Tensor     # [S] int64, valid entries of text_ids
    seed: torch.Tensor         # [S] int64, sampler stream of the sequence

    @classmethod
    def allocate(cls, num_slots: int, hidden: int, vocab: int, queue: int, pad_id: int,
                 dtype: torch.dtype, device: torch.device | str) -> SlotState:
        s = num_slots + 1
        i64 = dict(dtype=torch.int64, device=device)
        return cls(
            last_c0=torch.zeros(s, **i64),
            past_hidden=torch.zeros(s, hidden, dtype=dtype, device=device),
            position=torch.zeros(s, **i64),
            num_frames=torch.zeros(s, **i64),
            rep_mask=torch.zeros(s, vocab, dtype=torch.bool, device=device),
            text_ids=torch.full((s, queue), pad_id, **i64),
            text_len=torch.zeros(s, **i64),
            seed=torch.zeros(s, **i64),
        )

    def clear(self, slot: int, pad_id: int) -> None:
        self.last_c0[slot] = 0
        self.past_hidden[slot].zero_()
        self.position[slot] = 0
        self.num_frames[slot] = 0
        self.rep_mask[slot].zero_()
        self.text_ids[slot].fill_(pad_id)
        self.text_len[slot] = 0
        self.seed[slot] = 0
