"""Paged talker-KV allocator over ints (torch-free).

The pool owns page ids 0..num_pages-1 of the `PagedKVCache`; the model runner adds one more
physical page (id `num_pages`, the dummy page) that padding rows of a graph batch point at and that
is never leased. A sequence holds one `Lease`: the pages its tokens occupy, in order, plus an
optional reservation (pages promised to it but not yet taken, so that the 'reserve' policy can never
run dry mid-sequence). Every page is in exactly one place: the free list or one lease.

    page p of a lease covers token positions [p * page_size, (p + 1) * page_size)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Hashable


class OutOfPages(RuntimeError):
    """The pool has fewer unpromised free pages than asked for."""


@dataclass
class Lease:
    pages: list[int] = field(default_factory=list)
    reserved: int = 0  # pages promised beyond `pages`, still on the free list


class KVPool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        assert num_pages >= 1 and page_size >= 1, (num_pages, page_size)
        self.num_pages = num_pages
        self.page_size = page_size
        self.free_page_ids: deque[int] = deque(range(num_pages))
        self.leases: dict[Hashable, Lease] = {}
        self.num_reserved = 0

    # --- queries ----------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages neither leased nor promised to a lease."""
        return len(self.free_page_ids) - self.num_reserved

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free_page_ids)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_free

    def pages(self, owner: Hashable) -> list[int]:
        return self.leases[owner].pages

    # --- lease lifecycle --------------------------------------------------------------------------

    def open(self, owner: Hashable, num_tokens: int, reserve_tokens: int = 0) -> Lease:
        """New lease holding pages for `num_tokens`, plus a promise of pages up to `reserve_tokens`."""
        assert owner not in self.leases, f"KVPool: {owner!r} already holds a lease"
        need = self.pages_for(num_tokens)
        promise = max(0, self.pages_for(reserve_tokens) - need)
        if not self.can_allocate(need + promise):
            raise OutOfPages(f"need {need + promise} pages, {self.num_free} free")
        lease = self.leases[owner] = Lease()
        self._take(lease, need)
        lease.reserved = promise
        self.num_reserved += promise
        return lease

    def grow(self, owner: Hashable, num_tokens: int) -> None:
        """Make the lease cover `num_tokens` tokens; reserved pages are used first."""
        lease = self.leases[owner]
        need = self.pages_for(num_tokens) - len(lease.pages)
        if need <= 0:
            return
        from_reserve = min(need, lease.reserved)
        if not self.can_allocate(need - from_reserve):
            raise OutOfPages(f"{owner!r} needs {need - from_reserve} more pages, {self.num_free} free")
        lease.reserved -= from_reserve
        self.num_reserved -= from_reserve
        self._take(lease, need)

    def close(self, owner: Hashable) -> int:
        """Return every page of `owner` (leased and promised); returns how many were leased."""
        lease = self.leases.pop(owner)
        self.free_page_ids.extend(lease.pages)
        self.num_reserved -= lease.reserved
        return len(lease.pages)

    def _take(self, lease: Lease, n: int) -> None:
        lease.pages.extend(self.free_page_ids.popleft() for _ in range(n))

    # --- invariants -------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        leased = [p for lease in self.leases.values() for p in lease.pages]
        free = list(self.free_page_ids)
        everything = sorted(leased + free)
        if everything != list(range(self.num_pages)):
            raise RuntimeError(
                f"KVPool integrity check failed: free({len(free)}) + leased({len(leased)}) pages are not "
                f"a permutation of range({self.num_pages}) (duplicates or losses)")
        promised = sum(lease.reserved for lease in self.leases.values())
        if promised != self.num_reserved or self.num_reserved > len(free):
            raise RuntimeError(f"KVPool integrity check failed: reserved {self.num_reserved}, "
                               f"sum of leases {promised}, free {len(free)}")
