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
    """Device state of all slots (+1 dummy row). S = num_slots + 1, H = talker hidden, Q = text queue."""

    last_c0: torch.Tensor      # [S] int64, c0 sampled at the previous talker step
    past_hidden: torch.Tensor  # [S, H] model dtype, final-norm talker hidden that c0 was sampled from
    rep_mask: torch.Tensor     # [S, V] bool, c0 ids generated so far (repetition penalty)
    text_queue: torch.Tensor   # [S, Q, H] model dtype, trailing text rows (frame t adds row t)
    text_len: torch.Tensor     # [S] int64, valid rows of text_queue (past them: E_pad)
    seed: torch.Tensor         # [S] int64, uniform stream of the sequence
    # per-slot sampling parameters ([S] each): talker and code predictor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    repetition_penalty: torch.Tensor
    greedy: torch.Tensor
    sub_temperature: torch.Tensor
    sub_top_k: torch.Tensor
    sub_top_p: torch.Tensor
    sub_greedy: torch.Tensor

    @classmethod
    def allocate(cls, num_slots: int, hidden: int, vocab: int, queue: int,
                 dtype: torch.dtype, device: torch.device | str) -> SlotState:
        s = num_slots + 1
        i64 = dict(dtype=torch.int64, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        b = dict(dtype=torch.bool, device=device)
        return cls(
            last_c0=torch.zeros(s, **i64), past_hidden=torch.zeros(s, hidden, dtype=dtype, device=device),
            rep_mask=torch.zeros(s, vocab, **b),
            text_queue=torch.zeros(s, queue, hidden, dtype=dtype, device=device),
            text_len=torch.zeros(s, **i64), seed=torch.zeros(s, **i64),
            temperature=torch.ones(s, **f32), top_k=torch.zeros(s, **i64), top_p=torch.ones(s, **f32),
            repetition_penalty=torch.ones(s, **f32), greedy=torch.ones(s, **b),
            sub_temperature=torch.ones(s, **f32), sub_top_k=torch.zeros(s, **i64),
            sub_top_p=torch.ones(s, **f32), sub_greedy=torch.ones(s, **b),
        )

    def load_sampling(self, slot: int, p) -> None:
        """Write SamplingParams `p` into the slot's parameter rows."""
        self.temperature[slot] = p.temperature
        self.top_k[slot] = p.top_k
        self.top_p[slot] = p.top_p
        self.repetition_penalty[slot] = p.repetition_penalty
        self.greedy[slot] = p.greedy
        self.sub_temperature[slot] = p.subtalker_temperature
        self.sub_top_k[slot] = p.subtalker_top_k
        self.sub_top_p[slot] = p.subtalker_top_p
        self.sub_greedy[slot] = p.cp_greedy
        self.seed[slot] = p.seed
