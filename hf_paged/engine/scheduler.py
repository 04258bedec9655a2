"""Iteration-level scheduling with a token budget, chunked prefill and gang preemption.

Each step: running requests first (oldest first: one token per decoding sequence, the next chunk
for a prefilling one), then swapped-out requests come back, then waiting requests are admitted
while the token budget, the sequence limit and the free blocks allow. When a running request
cannot get its slots, the newest running request is preempted as a whole: dropped and recomputed
later ("recompute") or moved to the CPU block pool ("swap"; recompute when swap space is full).

Two policies order the queues (vLLM's ``scheduling_policy``): ``"fcfs"``, first come first served,
as above; ``"priority"``, every queue in order of the requests' ``priority`` (lower first), then
arrival: the running request preempted is the one that comes last in that order, and a waiting
request that comes before every swapped-out one is admitted without waiting for them.

The scheduler is the only writer of KV state: :meth:`Scheduler.schedule` allocates (and
preempts), :meth:`Scheduler.update_from_output` caches, forks and frees what the step's
outcome says, :meth:`Scheduler.finish_request` frees an aborted request. A step whose execution
failed is closed by :meth:`Scheduler.abandon` instead: nothing it computed enters the prefix
cache, and it names the requests the failed step may have left with incomplete K/V.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from hf_paged.engine.kv_cache_manager import BlockPairs, KVCacheManager
from hf_paged.engine.scheduler_output import (GroupBlocks, PromptLogprobRows, ScheduledSequence, SchedulerOutput,
                                              StateMoves)
from hf_paged.engine.sequence import Request, Sequence, Status
from hf_paged.engine.speculative import NgramProposer
from hf_paged.engine.step_result import FinishRequest, ForkSequence, FreeSequence, StepResult

SCHEDULING_POLICIES = ("fcfs", "priority")


def check_scheduling_policy(policy: str) -> None:
    if policy not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {policy!r}")


def priority_order(request: Request) -> tuple[int, float]:
    """Where a request stands under the ``"priority"`` policy: lower priority values first, then
    earlier arrivals (equal ones keep the order they were queued in)."""
    return request.priority, request.arrival


@dataclass
class _StepPlan:
    """What one ``schedule()`` call has decided so far (turned into a ``SchedulerOutput``)."""

    num_groups: int
    work: list[tuple[Request, Sequence, int]] = field(default_factory=list)  # (request, seq, new tokens)
    rejected: list[tuple[Request, str]] = field(default_factory=list)  # requests that can never fit
    copies: list[BlockPairs] = field(default_factory=list)  # per layer group
    swap_out: list[BlockPairs] = field(default_factory=list)
    swap_in: list[BlockPairs] = field(default_factory=list)
    state_swap_out: BlockPairs = field(default_factory=list)  # (device slot, CPU slot)
    state_swap_in: BlockPairs = field(default_factory=list)  # (CPU slot, device slot)
    moved: list[Request] = field(default_factory=list)  # requests swapped out or in by this step
    drafts: dict[int, tuple[int, ...]] = field(default_factory=dict)  # seq_id -> its draft (speculative decoding)

    def __post_init__(self):
        self.copies, self.swap_out, self.swap_in = ([[] for _ in range(self.num_groups)] for _ in range(3))

    def add(self, request: Request, work: list[tuple[Sequence, int]]) -> int:
        total = 0
        for seq, n in work:
            self.work.append((request, seq, n))
            total += n
        return total

    @staticmethod
    def extend(into: list[BlockPairs], per_group: list[BlockPairs]) -> None:
        for pairs, new in zip(into, per_group):
            pairs += new


class Scheduler:
    """``split_prompts`` False (models whose recurrent layers cannot continue a prefill from a
    saved state, :mod:`hf_paged.kinds.recurrent`): a sequence's known tokens are computed in one
    forward, in a step whose budget they fit (or, longer than the whole budget, over it).

    ``proposer`` (speculative decoding, :mod:`hf_paged.engine.speculative`): decoding sequences of
    requests without beams compute a draft after their last token where the blocks for it are free
    and the token budget has room (never at the cost of a preemption); :meth:`update_from_output`
    rolls their blocks back to the tokens that stood."""

    def __init__(
        self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int, preemption_mode: str,
        split_prompts: bool = True, policy: str = "fcfs", proposer: NgramProposer | None = None,
        max_loras: int | None = None,
    ):
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        check_scheduling_policy(policy)
        self.policy = policy
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.split_prompts = split_prompts
        self.proposer = proposer
        self.max_loras = max_loras  # vLLM's: the most LoRA adapters the running requests use at once
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.preemptions = {"recompute": 0, "swap": 0}
        self.num_computed_prompt_tokens = 0
        self._scheduled: dict[int, Sequence] | None = None  # the last output's sequences until it is applied
        self._touched: list[Request] = []  # the last output's requests: scheduled, swapped out or in
        self._state_copies: list[tuple[int, int]] = []  # forks settled by the last update, for the next step
        self._forked: list[Request] = []  # their requests
        self._request_of: dict[int, Request] = {}  # the last output's sequences' requests
        self._rejoining: list[Request] = []  # running requests whose other sequences wait to fork

    # ------------------------------------------------------------------ queue management
    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        self._enqueue(self.waiting, request)

    def _enqueue(self, queue: deque[Request] | list[Request], request: Request, front: bool = False) -> None:
        """Queue ``request``: FCFS at the back (``front``: a preempted request, at the front);
        by priority in :func:`priority_order`."""
        if self.policy == "priority":
            queue.insert(bisect.bisect_right(queue, priority_order(request), key=priority_order), request)
        elif front:
            queue.appendleft(request)
        else:
            queue.append(request)

    def _before_swapped(self, request: Request) -> bool:
        """Whether a waiting request may be admitted while requests are swapped out: only by
        priority, where it comes before all of them (FCFS: they come back first)."""
        return not self.swapped or (self.policy == "priority"
                                    and priority_order(request) < priority_order(self.swapped[0]))

    def finish_request(self, request: Request) -> None:
        """Take a request out of whatever queue holds it and free its blocks (finish or abort)."""
        for queue in (self.waiting, self.running, self.swapped):
            if request in queue:
                queue.remove(request)
        for seq in request.seqs + request.finished_seqs:
            self.kv.free(seq)
        request.status = Status.FINISHED

    def _release(self, seqs: list[Sequence]) -> None:
        """Free the sequences' blocks; what they had computed must be computed again."""
        for seq in seqs:
            self.kv.free(seq)
            seq.num_computed_tokens = 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def _num_running_seqs(self) -> int:
        return sum(len(r.live_seqs) for r in self.running)

    def _lacks_state_slots(self, request: Request) -> bool:
        """Whether the running requests and ``request`` could need more state slots than there are
        (each request as many as it will run sequences at once: forks take theirs later)."""
        if not self.kv.has_states:
            return False
        return sum(self._width(r) for r in self.running) + self._width(request) > self.kv.num_state_slots

    def _lacks_lora_slot(self, request: Request) -> bool:
        """Whether ``request``'s adapter would be one more than ``max_loras`` among the running
        requests' (vLLM's limit on the adapters of one batch)."""
        if self.max_loras is None or not request.lora_int_id:
            return False
        active = {r.lora_int_id for r in self.running if r.lora_int_id}
        return request.lora_int_id not in active and len(active) >= self.max_loras

    @staticmethod
    def _width(request: Request) -> int:
        """Sequences the request will run at once (after its prompt forks)."""
        return max(len(request.live_seqs), request.params.n, request.params.num_beams)

    # ------------------------------------------------------------------ the step
    def _work(self, request: Request, budget: int,
              drafts: dict[int, tuple[int, ...]] | None = None) -> list[tuple[Sequence, int]]:
        """Tokens to compute for each live sequence: 1 when decoding, else the next chunk.

        Sequences that get nothing this step (budget spent, or already computed and waiting for
        their beam siblings) are left out. With ``drafts`` (a dict to fill), decoding sequences of a
        request without beams also compute the proposer's draft after their last token.
        """
        work = []
        for seq in request.seqs if request.rejoin_at is None else request.live_seqs[:1]:
            if seq.finish_reason is not None:
                continue
            n = len(seq.token_ids) - seq.num_computed_tokens
            if request.rejoin_at is not None:  # the shared part alone (the others fork from it after)
                n = request.rejoin_at - seq.num_computed_tokens
            if self.split_prompts or n <= 1:
                n = min(n, budget)
            elif n > budget and n <= self.max_num_batched_tokens:
                n = 0  # whole or not at all: a later step has room (one longer than any budget runs over it)
            if (drafts is not None and n == 1 and budget > 1 and request.forked and request.beam is None
                    and seq.num_computed_tokens == seq.num_tokens - 1):  # decoding: its last token is due
                draft = self.proposer.propose(request, seq, budget - 1)
                if draft:
                    drafts[seq.seq_id] = draft
                    n += len(draft)
            if n > 0:
                work.append((seq, n))
                budget -= n
        return work

    def schedule(self) -> SchedulerOutput:
        """Decide the next step: who computes which tokens, with what slots, copies and swaps.
        Each output must go back through :meth:`update_from_output` before the next call."""
        if self._scheduled is not None:
            raise RuntimeError("Scheduler.schedule() called again before update_from_output() of the last step")
        plan = _StepPlan(len(self.kv.groups))
        if self._rejoining:
            self._rejoin_ready()
        budget, preempted = self._append_all_running(plan), False
        if budget is None:  # they do not all fit: preempt (or reject) one request at a time
            budget, preempted = self._append_running_preempting(plan)
        if not preempted:
            budget = self._swap_in(plan, budget)
        if not preempted and self.waiting and self._before_swapped(self.waiting[0]):
            self._admit(plan, budget)
        return self._output(plan)

    def _append_all_running(self, plan: _StepPlan) -> int | None:
        """The common step: the work of every running request fits in the free blocks, so one check
        and one append serve them all (the same slots and copies, in the same order, as one request
        at a time). Returns the budget left, or None (nothing planned) when they do not fit."""
        drafts = {} if self.proposer is not None and self.proposer.drafts_now(self._num_running_seqs()) else None
        budget, works, every = self._running_work(drafts)
        self.kv.release_out_of_window(every)
        if drafts and not self.kv.can_append(every):  # no room for the drafts: plain decode steps
            drafts = None
            budget, works, every = self._running_work(drafts)
        if not self.kv.can_append(every):
            return None
        if drafts:
            plan.drafts = drafts
        plan.extend(plan.copies, self.kv.append(every))
        for request, work in works:
            plan.add(request, work)
        return budget

    def _running_work(self, drafts: dict[int, tuple[int, ...]] | None
                      ) -> tuple[int, list[tuple[Request, list[tuple[Sequence, int]]]], list[tuple[Sequence, int]]]:
        """The work of every running request in order, within the token budget: (budget left,
        work per request, every sequence's work)."""
        budget = self.max_num_batched_tokens
        works = []
        every = []
        for request in self.running:
            work = self._work(request, budget, drafts)
            if work:
                works.append((request, work))
                every += work
                for _, n in work:
                    budget -= n
        return budget, works, every

    def _append_running_preempting(self, plan: _StepPlan) -> tuple[int, bool]:
        """One running request at a time, preempting from the back of the queue until each fits
        (or rejecting one that cannot fit alone). Alone, a request is preempted only under
        recompute and when recomputed its sequences would fit, sharing their common part (they
        may share less now, e.g. beams); else it is rejected: swapped back, or recomputed as it
        is, it would need the same blocks again, forever (a single sequence once went from the
        front of the queue to preempting itself and back, endlessly, while others waited).
        Returns the budget left and whether it preempted."""
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running):
            request = self.running[i]
            work = self._work(request, budget)
            if not work:
                i += 1
                continue
            self.kv.release_out_of_window(work)
            while not self.kv.can_append(work):
                victim = self.running[-1]
                if victim is request and len(self.running) == 1 and (
                        self.preemption_mode == "swap" or not self._fits_recomputed(request)):
                    plan.rejected.append((request, "the request alone needs more KV blocks than the cache has"))
                    self.running.remove(request)
                    self._release(request.live_seqs)  # for this step's admissions (a state slot once ran out)
                    work = []
                    break
                self._preempt(victim, plan)
                preempted = True
                if victim is request:
                    work = []
                    break
            if not work:
                continue
            plan.extend(plan.copies, self.kv.append(work))
            budget -= plan.add(request, work)
            i += 1
        return budget, preempted

    def _swap_in(self, plan: _StepPlan, budget: int) -> int:
        """Swapped-out requests come back in order while their blocks fit with a block to spare for
        each sequence's next token. With nothing running the spare blocks are not asked for (its
        next tokens are checked as it runs, and it is rejected alone if they cannot fit), and one
        whose blocks do not fit the whole pool, which can never come back, is rejected (such a
        request once waited forever)."""
        while self.swapped and budget > 0:
            request = self.swapped[0]
            seqs = request.live_seqs
            if (self._num_running_seqs() + len(seqs) > self.max_num_seqs or self._lacks_state_slots(request)
                    or self._lacks_lora_slot(request)):
                break
            if not self.kv.can_swap_in(seqs, reserve=len(seqs) if self.running else 0):
                if not self.running and not self.kv.swap_in_fits_at_all(seqs):
                    self.swapped.popleft()
                    plan.rejected.append((request, "the request needs more KV blocks than the cache has"))
                    continue
                break
            self.swapped.popleft()
            plan.extend(plan.swap_in, self.kv.swap_in(seqs))
            plan.state_swap_in += self.kv.swap_in_states(seqs)
            plan.moved.append(request)
            request.status = Status.RUNNING
            self._enqueue(self.running, request)
            work = self._work(request, budget)
            if work:
                self.kv.release_out_of_window(work)
            if work and self.kv.can_append(work):
                plan.extend(plan.copies, self.kv.append(work))
                budget -= plan.add(request, work)
        return budget

    def _admit(self, plan: _StepPlan, budget: int) -> None:
        """Admit waiting requests in order while they fit. One whose LoRA adapter would exceed
        ``max_loras`` is passed over for this step (as vLLM's scheduler does), keeping its place."""
        passed_over = []
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if not self._before_swapped(request):
                break
            if self._lacks_lora_slot(request):
                passed_over.append(self.waiting.popleft())
                continue
            if self._num_running_seqs() + self._width(request) > self.max_num_seqs and self.running:
                break
            if self._lacks_state_slots(request):
                if self.running or self.swapped:
                    break
                self.waiting.popleft()
                plan.rejected.append((request, f"the request runs {self._width(request)} sequences at once, and the "
                                               f"engine has {self.kv.num_state_slots} recurrent-state slots"))
                continue
            read_cache = not request.skip_reading_prefix_cache
            fits_alone = self._fits_alone(request.live_seqs, request.rejoin_at)
            seqs = self._allocate(request, read_cache)
            work = self._work(request, budget)
            if read_cache and any(self.kv.waits_for_inflight(seq) for seq in seqs):
                self._unadmit(request, seqs)
                break
            if not work or not self.kv.can_append(work, reserve=self._rejoin_reserve(request)):
                if not self.running and not self.swapped and not fits_alone:
                    self.waiting.popleft()
                    plan.rejected.append((request, "the request needs more KV blocks than the cache has"))
                    self._release(seqs)
                    continue
                self._unadmit(request, seqs)  # give adopted prefix blocks back; they stay cached
                break
            self.waiting.popleft()
            if not request.num_preemptions:  # vLLM's num_cached_tokens: the first admission's hit
                request.num_cached_tokens = seqs[0].num_computed_tokens
            for seq in seqs:
                if read_cache:  # as vLLM's, a request that skips the lookup is not counted
                    self.kv.record_prefix_lookup(seq)
                self.kv.mark_inflight(seq)
            plan.extend(plan.copies, self.kv.append(work))
            request.status = Status.RUNNING
            self._enqueue(self.running, request)
            if request.rejoin_at is not None and request not in self._rejoining:
                self._rejoining.append(request)
            budget -= plan.add(request, work)
        self.waiting.extendleft(reversed(passed_over))

    def _unadmit(self, request: Request, seqs: list[Sequence]) -> None:
        """Admission fell through: the sequences give their blocks back (cached ones stay cached)
        and a request that was to rejoin still is."""
        self._release(seqs)
        if request.num_preemptions:
            request.rejoin_at = self._common_part(request.live_seqs)

    def _allocate(self, request: Request, read_cache: bool) -> list[Sequence]:
        """Give the sequences of a request being admitted their cached prefix blocks; returns those
        that now hold blocks. A request rejoining after a recompute (:attr:`Request.rejoin_at`)
        allocates its first sequence alone, unless the prefix cache already holds their common
        part: then every sequence takes it from there, shared."""
        seqs = request.live_seqs
        if request.rejoin_at is not None:
            leader = seqs[0]
            if not self.kv.holds(leader):
                leader.num_computed_tokens = self.kv.allocate_prefix(leader, read=read_cache)
            if leader.num_computed_tokens < request.rejoin_at:
                return [leader]
            request.rejoin_at = None
        for seq in seqs:
            if not self.kv.holds(seq):
                seq.num_computed_tokens = self.kv.allocate_prefix(seq, read=read_cache)
        return seqs

    @property
    def prefill_chunk(self) -> int | None:
        """The most tokens a sequence computes in one step (None: a prompt is computed whole)."""
        return self.max_num_batched_tokens if self.split_prompts else None

    def _fits_alone(self, seqs: list[Sequence], common: int | None) -> bool:
        """Whether a request's sequences, their known tokens and one more each, fit the cache alone,
        sharing the full blocks of their first ``common`` tokens (windows hold less: a model whose
        layers all slide was refused prompts longer than the cache its windows needed)."""
        return self.kv.fits_alone([seq.num_tokens + 1 for seq in seqs], common or 0, self.prefill_chunk)

    def _fits_recomputed(self, request: Request) -> bool:
        """Whether a request of several sequences would fit the cache alone once recomputed (its
        sequences then share their common part: :meth:`_preempt`)."""
        seqs = request.live_seqs
        return len(seqs) > 1 and self._fits_alone(seqs, self._common_part(seqs))

    def _rejoin_reserve(self, request: Request) -> int:
        """Blocks a rejoining request admitted with its first sequence alone needs once the others
        fork (their own tokens, a copy of the shared partial block each, the first's own tokens):
        admitted without them free, it would be preempted again as soon as they fork. Nothing when
        nothing else runs: it then fits alone (or is refused), and windows need less than this counts."""
        if request.rejoin_at is None or not (self.running or self.swapped):
            return 0
        leader, *others = request.live_seqs
        shared = request.rejoin_at // self.kv.block_size
        return (sum(self.kv.blocks_for(seq.num_tokens) - shared for seq in others)
                + self.kv.blocks_for(leader.num_tokens) - self.kv.blocks_for(request.rejoin_at))

    def _rejoin_ready(self) -> None:
        """Fork the waiting sequences of each rejoining request whose first sequence has computed
        their common part: they share its blocks (the partial last one is copied on write)."""
        for request in list(self._rejoining):
            if request.status is Status.RUNNING and request.rejoin_at is not None:
                leader, *others = request.live_seqs
                if leader.num_computed_tokens < request.rejoin_at:
                    continue
                for seq in others:
                    self.kv.fork(leader, seq)
                    seq.num_computed_tokens = leader.num_computed_tokens
                request.rejoin_at = None
                if self.kv.has_states:  # the leader's state after the common part: copied before this step
                    self._state_copies += self.kv.settle_state_forks()
                    self._forked.append(request)
            self._rejoining.remove(request)

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        self.running.remove(request)
        request.num_preemptions += 1
        seqs = request.live_seqs
        if self.preemption_mode == "swap" and request.rejoin_at is None and self.kv.can_swap_out(seqs):
            plan.state_swap_out += self.kv.swap_out_states(seqs)  # (before swap_out frees the sequences)
            plan.extend(plan.swap_out, self.kv.swap_out(seqs))
            plan.moved.append(request)
            request.status = Status.SWAPPED
            self._enqueue(self.swapped, request)
            self.preemptions["swap"] += 1
            return
        self._release(seqs)
        request.rejoin_at = self._common_part(seqs)
        request.status = Status.WAITING
        self._enqueue(self.waiting, request, front=True)
        self.preemptions["recompute"] += 1

    def _common_part(self, seqs: list[Sequence]) -> int | None:
        """How many leading tokens the sequences of a request dropped for recompute have in common,
        each one's last token left out (it must be computed by each, for its logits); None: one
        sequence, none in common, or recurrent states that cannot continue a prefill (the others
        would continue theirs from the forked state)."""
        if len(seqs) < 2 or (self.kv.has_states and not self.split_prompts):
            return None
        first, common = seqs[0].token_ids, min(seq.num_tokens for seq in seqs) - 1
        for seq in seqs[1:]:  # the prompt is common: compare what they generated
            common = next((i for i in range(seqs[0].num_prompt_tokens, common) if first[i] != seq.token_ids[i]),
                          common)
        return common or None

    # ------------------------------------------------------------------ the step's two ends
    def _output(self, plan: _StepPlan) -> SchedulerOutput:
        """Pack the plan in forward order (decode tokens first, longest context first, then the
        sequences with drafts, then prefill chunks) with every token's id, position and slot; the
        scheduled tokens count as computed from here on."""
        decode = sorted((w for w in plan.work if w[2] == 1), key=lambda w: -w[1].num_computed_tokens)
        chunks = [w for w in plan.work if w[2] > 1]
        if plan.drafts:  # the sequences with drafts first
            chunks.sort(key=lambda w: w[1].seq_id not in plan.drafts)
        ordered = decode + chunks
        bs, num_groups = self.kv.block_size, len(self.kv.groups)
        sequences, ids, positions, state_slots, prompt_rows = [], [], [], [], []
        slots, tables = [[] for _ in range(num_groups)], [[] for _ in range(num_groups)]
        drafts = plan.drafts
        for request, seq, n in ordered:
            start = seq.num_computed_tokens
            span = range(start, start + n)
            draft = drafts.get(seq.seq_id, ()) if drafts else ()
            sequences.append(ScheduledSequence(request.request_id, seq.seq_id, start, n,
                                               start + n - len(draft) == seq.num_tokens, draft, seq.lora_int_id))
            state_slots.append(self.kv.state_slot(seq))
            ids += seq.token_ids[start : start + n]
            if draft:
                ids += draft
            positions += span
            for g in range(num_groups):
                table = self.kv.block_table(seq, g)
                slots[g] += [table[p // bs] * bs + p % bs for p in span]
                tables[g].append(tuple(table))
            if start < seq.num_prompt_tokens:
                self.num_computed_prompt_tokens += min(n, seq.num_prompt_tokens - start)
                if request.prompt_logprobs is not None:
                    prompt_rows += _prompt_logprob_rows(len(sequences) - 1, request, seq, start, n)
            seq.num_computed_tokens = start + n
        self._scheduled = {seq.seq_id: seq for _, seq, _ in ordered}
        self._request_of = {seq.seq_id: request for request, seq, _ in ordered}
        self._touched = list({id(r): r for r in [r for r, _, _ in ordered] + plan.moved + self._forked}.values())
        groups = tuple(
            GroupBlocks(slot_mapping=tuple(slots[g]), block_tables=tuple(tables[g]), num_blocks=self.kv.pool_sizes[g],
                        block_copies=tuple(plan.copies[g]), swap_out=tuple(plan.swap_out[g]),
                        swap_in=tuple(plan.swap_in[g]))
            for g in range(num_groups)
        )
        states = StateMoves()
        if self.kv.has_states:
            states = StateMoves(slots=tuple(state_slots), copies=tuple(self._state_copies),
                                swap_out=tuple(plan.state_swap_out), swap_in=tuple(plan.state_swap_in))
        self._state_copies, self._forked = [], []
        return SchedulerOutput(
            sequences=tuple(sequences), input_ids=tuple(ids), positions=tuple(positions), groups=groups,
            rejected=tuple((request.request_id, why) for request, why in plan.rejected), states=states,
            prompt_logprobs=tuple(prompt_rows),
        )

    def update_from_output(self, output: SchedulerOutput, result: StepResult) -> None:
        """Apply a step's outcome to KV memory: newly full blocks enter the prefix cache (except
        those of requests that failed in the step), then the forks, frees and finished requests
        the output processor decided, in its order."""
        request_of = self._request_of
        scheduled = self._close_step()
        if output.has_drafts:
            self._roll_back_drafts(output, scheduled)
        for seq in output.sequences:
            if seq.request_id not in result.failed:
                self.kv.cache_full_blocks(scheduled[seq.seq_id])
        forked = {}
        for update in result.updates:
            match update:
                case ForkSequence(parent, child):
                    self.kv.fork(parent, child)
                    if parent.seq_id in request_of:
                        forked[id(request_of[parent.seq_id])] = request_of[parent.seq_id]
                case FreeSequence(seq):
                    self.kv.free(seq)
                case FinishRequest(request):
                    self.finish_request(request)
        self._state_copies = self.kv.settle_state_forks()  # after the frees: a beam step forks, then frees
        self._forked = list(forked.values()) if self._state_copies else []

    def _roll_back_drafts(self, output: SchedulerOutput, scheduled: dict[int, Sequence]) -> None:
        """Sequences that computed a draft keep the K/V of the tokens that stood: their last known
        token and the draft tokens the output processor took; the blocks past them go back (they
        hold K/V of tokens that were not taken)."""
        for s in output.sequences:
            if s.draft:
                seq = scheduled[s.seq_id]
                stood = min(s.start + s.num_tokens, seq.num_tokens - 1)
                if stood < seq.num_computed_tokens:
                    seq.num_computed_tokens = stood
                    self.kv.truncate(seq, stood)

    def abandon(self, output: SchedulerOutput) -> list[Request]:
        """Close a step that failed before its outcome was known (the forward, a block move or a
        broadcast raised). Nothing it computed enters the prefix cache. Returns the requests it
        may have left with incomplete K/V, which cannot continue: those it computed (their new
        slots and copy-on-write targets may be half written; those blocks are theirs alone, as a
        cached block is never written in place) and those it swapped out or in (the copies may
        not have run). The caller fails them (:meth:`finish_request` frees every block); the
        requests it rejected are in ``output.rejected``. Preempted-for-recompute requests had
        their blocks freed already and are recomputed later as usual."""
        touched = self._touched
        self._close_step()
        return [r for r in touched if r.status is not Status.FINISHED]

    def _close_step(self) -> dict[int, Sequence]:
        """End the step handed out by :meth:`schedule` (so a failure below cannot wedge the next)."""
        if self._scheduled is None:
            raise RuntimeError("Scheduler: no scheduled step to close (update_from_output() or abandon() "
                               "called twice)")
        scheduled, self._scheduled, self._touched = self._scheduled, None, []
        return scheduled


def _prompt_logprob_rows(index: int, request: Request, seq: Sequence, start: int, n: int) -> list[PromptLogprobRows]:
    """The rows of a chunk (tokens ``start .. start + n - 1`` of ``seq``, the step's sequence
    ``index``) that score prompt tokens not scored yet: position ``p`` scores token ``p + 1``, up to
    the prompt's last token; rows scored before a preemption are not scored again."""
    first = max(start, request.prompt_logprobs.num_rows)
    end = min(start + n, seq.num_prompt_tokens - 1)
    if first >= end:
        return []
    return [PromptLogprobRows(index, first, tuple(seq.token_ids[first + 1 : end + 1]), request.prompt_logprobs.k)]
