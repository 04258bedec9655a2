"""Iteration-level FCFS scheduling with a token budget, chunked prefill and gang preemption.

Each step: running requests first (oldest first: one token per decoding sequence, the next chunk
for a prefilling one), then swapped-out requests come back, then waiting requests are admitted
while the token budget, the sequence limit and the free blocks allow. When a running request
cannot get its slots, the newest running request is preempted as a whole: dropped and recomputed
later ("recompute") or moved to the CPU block pool ("swap"; recompute when swap space is full).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hf_paged.engine.kv_cache_manager import KVCacheManager
from hf_paged.engine.sequence import Request, Sequence, Status


@dataclass
class ScheduledBatch:
    work: list[tuple[Request, Sequence, int]] = field(default_factory=list)  # (request, seq, new tokens)
    rejected: list[tuple[Request, str]] = field(default_factory=list)  # requests that can never fit

    @property
    def num_tokens(self) -> int:
        return sum(n for _, _, n in self.work)


class Scheduler:
    def __init__(
        self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int, preemption_mode: str,
    ):
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.preemptions = {"recompute": 0, "swap": 0}

    # ------------------------------------------------------------------ queue management
    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out of whatever queue holds it and free its blocks (finish or abort)."""
        for queue in (self.waiting, self.running, self.swapped):
            if request in queue:
                queue.remove(request)
        for seq in request.seqs + request.finished_seqs:
            self.kv.free(seq)
        request.status = Status.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def _num_running_seqs(self) -> int:
        return sum(len(r.live_seqs) for r in self.running)

    @staticmethod
    def _width(request: Request) -> int:
        """Sequences the request will run at once (after its prompt forks)."""
        return max(len(request.live_seqs), request.params.n, request.params.num_beams)

    # ------------------------------------------------------------------ the step
    def _work(self, request: Request, budget: int) -> list[tuple[Sequence, int]]:
        """Tokens to compute for each live sequence: 1 when decoding, else the next chunk.

        Sequences that get nothing this step (budget spent, or already computed and waiting for
        their beam siblings) are left out.
        """
        work = []
        for seq in request.live_seqs:
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n > 0:
                work.append((seq, n))
                budget -= n
        return work

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running):
            request = self.running[i]
            work = self._work(request, budget)
            if not work:
                i += 1
                continue
            while not self.kv.can_append(work):
                victim = self.running[-1]
                if victim is request and len(self.running) == 1 and not self.swapped and not self.waiting:
                    batch.rejected.append((request, "the request alone needs more KV blocks than the cache has"))
                    self.running.remove(request)
                    work = []
                    break
                self._preempt(victim)
                preempted = True
                if victim is request:
                    work = []
                    break
            if not work:
                continue
            self.kv.append(work)
            batch.work += [(request, seq, n) for seq, n in work]
            budget -= sum(n for _, n in work)
            i += 1
        if not preempted:
            budget = self._swap_in(batch, budget)
        if not preempted and not self.swapped:
            self._admit(batch, budget)
        return batch

    def _swap_in(self, batch: ScheduledBatch, budget: int) -> int:
        while self.swapped and budget > 0:
            request = self.swapped[0]
            seqs = request.live_seqs
            if self._num_running_seqs() + len(seqs) > self.max_num_seqs:
                break
            if not self.kv.can_swap_in(seqs, reserve=len(seqs)):
                break
            self.swapped.popleft()
            self.kv.swap_in(seqs)
            request.status = Status.RUNNING
            self.running.append(request)
            work = self._work(request, budget)
            if work and self.kv.can_append(work):
                self.kv.append(work)
                batch.work += [(request, seq, n) for seq, n in work]
                budget -= sum(n for _, n in work)
        return budget

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if self._num_running_seqs() + self._width(request) > self.max_num_seqs and self.running:
                break
            seqs = request.live_seqs
            for seq in seqs:
                if not self.kv.holds(seq):
                    seq.num_computed_tokens = self.kv.allocate_prefix(seq)
            work = self._work(request, budget)
            needed_alone = sum(self.kv.blocks_for(seq.num_tokens + 1) for seq in seqs)
            if any(self.kv.waits_for_inflight(seq) for seq in seqs):
                for seq in seqs:
                    self.kv.free(seq)
                    seq.num_computed_tokens = 0
                break
            if not work or not self.kv.can_append(work):
                if not self.running and not self.swapped and needed_alone > self.kv.num_blocks:
                    self.waiting.popleft()
                    batch.rejected.append((request, "the request needs more KV blocks than the cache has"))
                    for seq in seqs:
                        self.kv.free(seq)
                    continue
                for seq in seqs:  # give adopted prefix blocks back; they stay cached
                    self.kv.free(seq)
                    seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            for seq in seqs:
                self.kv.record_prefix_lookup(seq)
                self.kv.mark_inflight(seq)
            self.kv.append(work)
            request.status = Status.RUNNING
            self.running.append(request)
            batch.work += [(request, seq, n) for seq, n in work]
            budget -= sum(n for _, n in work)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        seqs = request.live_seqs
        if self.preemption_mode == "swap" and self.kv.can_swap_out(seqs):
            self.kv.swap_out(seqs)
            request.status = Status.SWAPPED
            self.swapped.append(request)
            self.preemptions["swap"] += 1
            return
        for seq in seqs:
            self.kv.free(seq)
            seq.num_computed_tokens = 0
        request.status = Status.WAITING
        self.waiting.appendleft(request)
        self.preemptions["recompute"] += 1
