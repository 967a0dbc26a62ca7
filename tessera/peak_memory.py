"""A rank's live bytes walked along its action list: when the peak happens and what is alive then. No torch.

`tessera.memory` knows each component's size (model state, one micro-batch's activations per stage, the
transients); this module knows which of them coexist. A pipeline rank runs its lowered action list in order
(`tessera.execution`: the list the runtime executes), and each action changes what it holds, as the runtime's
objects do (tessera/pipeline/runtime.py, stage_comm.py, parallel/zero.py, parallel/data.py):

- F(s): stage s's activations of one micro-batch are saved; B(s) (or W after I) frees them and leaves the stage's
  full gradients (created by its first backward of the step, accumulated by the next);
- REDUCE / REDUCE_MB(s): the stage's gradients are flattened into a new buffer while they are still alive.
  ZeRO-1/2/3 keep one reduction in flight (its flat buffer and output live until the next launch, which waits
  for it before flattening: `ZeroStageComm._launch`) and a shard per stage for the result (a stage's first
  reduction's output; a later one's is added into it at that wait); ZeRO-2/3 then drop the full gradients,
  ZeRO-1 keeps them (and with depth-first accumulation reduce-scatters once per step, at the stage's last
  REDUCE: `ZeroStageComm.reduce`; the generated lists give ZeRO-1 one REDUCE per stage, so ``deferred_reduce``
  only skips a hand-written list's earlier ones). Plain data parallelism waits for the reduction in flight *before* flattening and adds it into its
  stage's running total (the stage's first flat buffer, kept to the step's end: `DataParallelStageComm`,
  `GradBucket`), then drops the gradients: one total per stage and one flat buffer in flight, however many micro-batches. At the end it
  writes each stage's total back as gradients (one more copy), stage by stage in ascending order. A stage
  holding a parameter tied to another rank's stage has no REDUCE in the list until its end (the lowering puts
  its one REDUCE after the EXCHANGE with the other rank: `tessera.pipeline.passes.add_tied_exchange`), so its
  gradients accumulate in place until then;
- EXCHANGE(s): nothing the walk counts (the received copy and the sum are one embedding table's gradient,
  after backward has freed the activations);
- GATHER / FREE(s) (ZeRO-3): the stage's full parameters are allocated / released;
- hybrid sharding with a reduce dtype narrower than fp32 (``replicated``): a stage's replica all-reduce sends a
  copy of its fp32 gradient shard in that dtype (`FlatStage.launch_replica_reduce`), made at the rank's first
  REDUCE after the stage's last one (when `ZeroStageComm._launch` waits for that last reduction), or at the end
  for the last reduced stage; every copy is held until the end waits for them all (`ZeroStageComm.finish`),
  and the end's moment notes them all, the last flat buffer released. (fp32: the all-reduce runs in place on the shard, nothing to count);
- the moment of a backward also holds its transient (`working`: the recomputed block, the logits' gradient);
- full recomputation (``held_inputs``): B(s) of a stage whose predecessor runs on the same rank leaves the
  input's gradient until B(s - 1) of the micro-batch (`StageBytes.held`; the input, the predecessor's output,
  is freed with B(s), whose root is the output's gradient edge); the masks a micro-batch's first replay on the
  rank builds again (its highest stage's B) live until its last backward there, the lowest stage's
  (`StageBytes.masks`).

The peak is the largest sum over these moments; the optimizer step's moment (state, the gradients held after
backward, the update's temporaries) and the parameters and optimizer state, alive throughout, are the caller's.

**Speed.** Which components coexist depends only on the action list, not on their sizes, so a walk is done
once symbolically (`compile_walk`): each moment is a sum of terms (a kind of size of a stage, times a count),
moments that another moment's terms cover are dropped, and `Walk.evaluate` prices the few that remain for
given sizes. The planner's search prices thousands of layouts that share a few hundred lists, so
`tessera.memory` caches the compiled walk of a rank's list, and builds only that rank's list
(`schedules.rank_steps` and `lowered_events`, the lowering passes' rules without the point-to-point actions,
which hold nothing the walk counts).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter

from tessera.pipeline.ir import Action, ActionKind
from tessera.pipeline.schedules import Step

__all__ = ["Moment", "StageBytes", "Walk", "compile_walk", "floor", "lowered_events", "walk"]

_K = ActionKind
# module constants: an enum member looked up on its class costs a descriptor call, per action of a long walk
_F, _B, _I, _W = _K.FORWARD, _K.BACKWARD, _K.BACKWARD_INPUT, _K.BACKWARD_WEIGHT
_REDUCE, _REDUCE_MB, _GATHER, _FREE = _K.REDUCE_GRAD, _K.REDUCE_MICROBATCH, _K.GATHER_PARAMS, _K.FREE_PARAMS
_EXCHANGE = _K.EXCHANGE_TIED

# What a term counts, and the component it belongs to (activations, grads, buffers, working).
(
    _ACT,
    _GRAD,
    _SHARD,
    _GATHERED,
    _PENDING,
    _FLAT,
    _WRITEBACK,
    _WORK,
    _WIRE,
    _TIED,
    _HELD,
    _MASKS,
    _FIRST,
    _OUT,
    _PART,
) = range(15)
_CATEGORY = (0, 1, 1, 2, 2, 2, 2, 3, 2, 1, 0, 3, 3, 2, 2)
_LABELS = (
    "activations",
    "gradients",
    "gradient shard",
    "gathered",
    "pending flat",
    "flat",
    "write-back",
    "working",
    "replica wire copy",
    "tied table gradient",
    "stage input and its gradient",
    "replayed masks",
    "working, the stage's first backward",
    "reduce-scatter output in flight",
    "reduced part cast to fp32",
)

Term = tuple[tuple[int, int], float]
"""((what, stage), count)."""

_STRIDE = 1 << 20
"""While walking, a term's (what, stage) is the one int ``what * _STRIDE + stage``: it hashes and sorts faster
than the pair (a walk sorts each moment's terms), in the same order (stages are below the stride);
`compile_walk` turns the kept moments back into pairs."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StageBytes:
    """Sizes the walk needs, in bytes, indexed by global stage."""

    activations: dict[int, float]
    """One micro-batch's activations saved by the stage (the last stage: with its head's)."""
    grads: dict[int, float]
    """The stage's full fp32 gradients (= its gathered parameters under ZeRO-3)."""
    flat: dict[int, float]
    """The stage's flattened gradients for the data-parallel reduction (reduce dtype)."""
    working: dict[int, float]
    """Transient of one backward of the stage (recomputed block, the logits' gradient on the last stage)."""
    zero: int
    dp: int
    deferred_reduce: bool = False
    """ZeRO-1 with depth-first accumulation: a stage's one reduce-scatter of the step is launched at its last
    REDUCE (full gradients stay; an earlier REDUCE, were a list to have one, launches nothing)."""
    uses: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """ZeRO-3: the stages whose flat buffers a stage's GATHER brings (default: its own; the head's stage also
    the tied embedding's owner); the head's backward also creates the tied table's gradient (``tied``)."""
    tied: float = 0.0
    """The tied table's gradient, part of the embedding's stage's (stage 0's) gradients, when the head's stage on
    the same rank uses it (``uses``): the head's backward creates it, alive from the head's first backward on
    while the rest of stage 0's gradients come with stage 0's own backward, the last of the step. Until
    2026-12-03 the walk created it with them, and a tied GPT on one rank with layered accumulation (gpt2-124m,
    2 layers, s 256, tensor 2 + SP, bf16, 8 micro-batches) fell 7.8 % under the dry run."""
    wire: dict[int, float] = field(default_factory=dict)
    """Hybrid sharding, reduce dtype narrower than fp32: the copy of the stage's gradient shard in that dtype that
    its replica all-reduce sends (`FlatStage.launch_replica_reduce`); empty otherwise (nothing to count)."""

    held: dict[int, float] = field(default_factory=dict)
    """A stage whose predecessor runs on the same rank (``held_inputs`` walks): what one micro-batch leaves alive
    from the stage's backward to its predecessor's, the input's gradient (``input_grads``, which that backward
    consumes; the input itself is freed with the stage's backward, `PipelineEngine._backward`); empty
    otherwise."""
    first: dict[int, float] = field(default_factory=dict)
    """A stage's first backward of the step, where it differs from ``working``: its transient with the gradients
    that backward has made by then, which the walk adds only once it is over (under full recomputation the last
    block's MLP output Linear's weight gradient, on the last stage the head's: `tessera.memory`); from its second
    backward on they are among the stage's gradients."""
    gathered: dict[int, float] = field(default_factory=dict)
    """ZeRO-3: what a stage's GATHER holds until its FREE where that is more than its parameters (``grads``'
    bytes): the last stage's output projection's compute-dtype copy, which autocast's cache keeps from the head's
    forward until that FREE (`zero3_cached_head_bytes`); empty otherwise."""
    masks: float = 0.0
    """``held_inputs`` walks: the masks a micro-batch's replays build again on the rank (`replay_mask_bytes`),
    alive from its first backward there (the rank's highest stage, whose ``working`` counts them while it runs)
    to the end of its last (the lowest), which frees its documents object; 0 without document masking or
    context parallelism."""

    def table(self, what: int) -> dict[int, float]:
        """The per-stage sizes of one kind of term."""
        if what == _SHARD:  # ZeRO's reduced gradient, fp32 whatever the reduce dtype (ZeroStage.wait_reduce)
            return {s: g / self.dp for s, g in self.grads.items()}
        if what == _OUT:  # a later reduction's own output, in the reduce dtype (`FlatStage.launch_reduce`)
            return {s: f / self.dp for s, f in self.flat.items()}
        if what == _PART:  # its fp32 cast at the wait (`FlatStage.wait_reduce`), none when it is fp32 already
            return {s: g / self.dp if self.flat.get(s, g) < g else 0.0 for s, g in self.grads.items()}
        return (
            self.activations,
            self.grads,
            None,
            {**self.grads, **self.gathered} if self.gathered else self.grads,
            self.flat,
            self.flat,
            self.grads,
            self.working,
            self.wire,
            {0: self.tied},
            self.held,
            dict.fromkeys(self.grads, self.masks),
            {**self.working, **self.first} if self.first else self.working,
        )[what]


@dataclass(slots=True)
class Moment:
    """What is alive at one point of the step, besides parameters and optimizer state (bytes)."""

    activations: float = 0.0
    grads: float = 0.0
    buffers: float = 0.0
    working: float = 0.0
    label: str = ""

    @property
    def total(self) -> float:
        return self.activations + self.grads + self.buffers + self.working


@dataclass(frozen=True, slots=True)
class Walk:
    """A walked action list, symbolically: its candidate peak moments and what it holds after backward."""

    moments: tuple[tuple[Term, ...], ...]
    labels: tuple[str, ...]
    after_backward: tuple[Term, ...]

    def evaluate(self, sizes: StageBytes) -> tuple[Moment, float]:
        """(the largest moment at these sizes, the gradient bytes held when backward is over)."""
        tables: dict[int, dict[int, float]] = {}
        value: dict[tuple[int, int], float] = {}
        for terms in (*self.moments, self.after_backward):
            for key, _ in terms:
                if key not in value:
                    what, stage = key
                    table = tables.get(what) or tables.setdefault(what, sizes.table(what))
                    value[key] = table.get(stage, 0.0)
        best, best_total = -1, 0.0
        for i, terms in enumerate(self.moments):
            total = sum([count * value[key] for key, count in terms])
            if total > best_total:
                best, best_total = i, total
        held = sum([count * value[key] for key, count in self.after_backward])
        if best < 0:
            return Moment(), held
        parts = [0.0, 0.0, 0.0, 0.0]
        for key, count in self.moments[best]:
            parts[_CATEGORY[key[0]]] += count * value[key]
        return Moment(*parts, label=self.labels[best]), held


@dataclass(slots=True)
class _Live:
    """The walk's state: what is alive, as counts per stage."""

    zero: int
    sharded: bool  # data parallelism (dp > 1)
    cls: dict[int, int]  # stage -> the stage whose sizes it shares (terms are counted per class)
    counts: dict[int, int] = field(default_factory=dict)  # (what, class) as an int (`_STRIDE`) -> alive now
    grads: set[int] = field(default_factory=set)
    shards: set[int] = field(default_factory=set)
    gathered: set[int] = field(default_factory=set)
    users: dict[int, int] = field(default_factory=dict)  # ZeRO-3: gathers not yet freed, per owner stage
    pending: set[int] = field(default_factory=set)  # plain data parallelism: stages with a running total
    inflight: int | None = None  # the stage whose flat buffer is being reduced
    out: int | None = None  # ZeRO: the stage whose later reduction's output (not its shard) is in flight
    replicated: bool = False  # hybrid sharding with a narrower reduce dtype: count the replica wire copies
    inflight_final: bool = False  # the reduction in flight is its stage's last of the step
    wired: set[int] = field(default_factory=set)  # stages whose replica all-reduce (wire copy) was launched
    grew: bool = True  # something was added since the last note
    extras: tuple = ()  # that note's transients
    dirty: tuple | None = None
    """A moment not yet noted (after F or B): the next note covers it unless something is released first,
    which flushes it (FREE, the end); half the notes of a walk, so half its time."""
    moments: dict[tuple, tuple] = field(default_factory=dict)  # terms (int, count) -> (stage, action)
    chains: dict[tuple, list] = field(default_factory=dict)
    """A shape's chain: [the counts of the one recorded before the last (None: none), the last's key, its counts]."""

    def add(self, what: int, s: int, n: int = 1) -> None:
        self.grew = self.grew or n > 0
        key = what * _STRIDE + self.cls.get(s, s)
        count = self.counts.get(key, 0) + n
        if count:
            self.counts[key] = count
        else:
            del self.counts[key]  # counts holds only what is alive: a note copies it as it is

    def flush(self) -> None:
        if self.dirty is not None:
            self.note(self.dirty)

    def note(
        self,
        label: tuple,
        flat: int | None = None,
        writeback: tuple[int, ...] = (),
        working: int | None = None,
        first: bool = False,
    ) -> None:
        self.dirty = None  # nothing was released since it: this moment holds at least as much
        extras = (flat, working, writeback, first)
        if not self.grew and extras == self.extras:  # only releases since the last moment: it covers this one
            return
        self.grew, self.extras = False, extras
        if flat is None and working is None and not writeback:  # most notes: the counts as they are
            key = tuple(sorted(self.counts.items()))
            if key in self.moments:  # a steady state repeats its moments exactly
                return
            self._record(key, label)
            return
        terms = dict(self.counts)
        cls = self.cls
        if flat is not None:
            key = _FLAT * _STRIDE + cls.get(flat, flat)
            terms[key] = terms.get(key, 0) + 1
        if working is not None:  # a stage's first backward: with the gradients it has made by its moment
            key = (_FIRST if first else _WORK) * _STRIDE + cls.get(working, working)
            terms[key] = terms.get(key, 0) + 1
        for w in writeback:
            key = _WRITEBACK * _STRIDE + cls.get(w, w)
            terms[key] = terms.get(key, 0) + 1
        key = tuple(sorted(terms.items()))
        if key in self.moments:
            return
        self._record(key, label)

    def _record(self, key: tuple[tuple[int, int], ...], label: tuple) -> None:
        """Keep a new moment, and drop the previous of its shape (the same terms, other counts) if it lies
        between the one before and this one: it never exceeds both ends, and the earlier end comes first on a
        tie. Ramps (warm-up forwards, a backward sweep) and steady states that grow by the same step each
        period collapse to their ends."""
        # its terms, and their counts in that order
        shape, counts = zip(*key, strict=True) if key else ((), ())
        chain = self.chains.get(shape)
        if chain is None:
            self.chains[shape] = [None, key, counts]
        else:
            first, mid_key, mid = chain
            if first is not None and _between(first, mid, counts):
                self.moments.pop(mid_key, None)  # the first stays the first
            else:
                chain[0] = mid
            chain[1], chain[2] = key, counts
        self.moments[key] = label

    def grad(self, s: int, alive: bool) -> None:
        """The stage's full gradients appear (first backward) or are dropped."""
        if (s in self.grads) != alive:
            (self.grads.add if alive else self.grads.discard)(s)
            self.add(_GRAD, s, 1 if alive else -1)

    def reduce(self, s: int, label: tuple, final: bool = False) -> None:
        """REDUCE of stage ``s`` (``final``: its last of the step, as far as hybrid sharding's replica all-reduce
        is concerned)."""
        if self.zero == 0:
            if self.sharded:
                self.settle()
                self.note(label, flat=s)  # flattened beside the gradients
                self.inflight = s
                self.add(_FLAT, s)
                self.grad(s, False)
            return
        # the previous reduction is waited for before this stage is flattened (`ZeroStageComm._launch`), which
        # frees its flat copy and output; its replica all-reduce (hybrid sharding) is launched right after
        waited, final_before = self.inflight, self.inflight_final
        self.wait_zero(label)
        if self.replicated and waited is not None and final_before:
            self.wire(waited)
        self.note(label, flat=s)
        self.inflight = s if self.sharded else None
        self.inflight_final = final
        if self.inflight is not None:
            self.add(_FLAT, s)
        if self.zero >= 2:  # dropped once flattened, before the collective's output exists
            self.grad(s, False)
        # the reduce-scatter's output (`FlatStage.launch_reduce`: allocated after the flat copy): the stage's
        # shard once waited on its first reduction of the step; on a later one a new buffer, alive in flight
        # with the flat copy until the next launch waits for it and adds it into the shard (without data
        # parallelism the flattened copy is the output)
        if s not in self.shards:
            self.shards.add(s)
            self.add(_SHARD, s)
        else:
            self.out = s
            self.add(_OUT, s)
        if self.sharded or self.out is not None:
            # beside the flat copy and, under ZeRO-1, the gradients it keeps
            self.note(label)

    def wait_zero(self, label: tuple) -> None:
        """ZeRO: wait for the reduction in flight (`FlatStage.wait_reduce`): a later reduction's output is cast
        to fp32 (a copy only when the reduce dtype is narrower) and added into the stage's shard; then its flat
        copy and output are freed."""
        if self.inflight is None and self.out is None:
            return
        self.flush()  # what the last action left: the moment before the wait
        if self.out is not None:
            self.add(_PART, self.out)
            self.note(label)
            self.add(_PART, self.out, -1)
            self.add(_OUT, self.out, -1)
            self.out = None
        if self.inflight is not None:
            self.add(_FLAT, self.inflight, -1)
            self.inflight = None

    def wire(self, s: int) -> None:
        """Hybrid sharding: stage ``s``'s replica all-reduce is launched; its wire copy lives to the end."""
        if s not in self.wired:
            self.wired.add(s)
            self.add(_WIRE, s)

    def finish_replicas(self) -> None:
        """The end (`ZeroStageComm.finish`): the reduction in flight is waited (its flat buffer freed), then
        the replica all-reduces still owed are launched, each with its wire copy, all alive together."""
        self.wait_zero((None, "finish replica all-reduce"))
        for s in sorted(self.shards):
            self.wire(s)
        self.note((None, "finish replica all-reduce"))

    def settle(self) -> None:
        """Plain data parallelism: the reduction in flight is waited and added into its stage's total (its
        first flat buffer becomes the total; a later one is freed)."""
        s, self.inflight = self.inflight, None
        if s is None:
            return
        self.flush()  # the moment before (a backward's gradients beside the buffer) is the larger one
        if s not in self.pending:
            self.pending.add(s)
            self.add(_PENDING, s)
        self.add(_FLAT, s, -1)

    def write_back(self) -> None:
        """Plain data parallelism's end of step: each stage's total becomes its gradients, stage by stage."""
        self.settle()
        for s in sorted(self.pending):
            self.note((s, "finish"), writeback=(s,))
            self.add(_PENDING, s, -1)
            self.grad(s, True)
        self.pending.clear()


def _between(first: tuple[int, ...], mid: tuple[int, ...], last: tuple[int, ...]) -> bool:
    """``mid`` lies on the segment from ``first`` to ``last`` (counts: exact integer arithmetic). The three
    are the counts of moments of one shape (a chain's), term by term in the same order."""
    a0 = b0 = 0
    for f, m, la in zip(first, mid, last, strict=True):  # the first term that moves gives the direction
        a0 = m - f
        if a0:
            b0 = la - m
            break
    if a0 * b0 <= 0:
        return False
    for f, m, la in zip(first, mid, last, strict=True):  # noqa: SIM110 - a loop, not all(generator): a walk asks ~1e5 times
        if (m - f) * b0 != (la - m) * a0:
            return False
    return True


def _covers(big: dict[tuple[int, int], float], small: dict[tuple[int, int], float]) -> bool:
    get = big.get
    for k, n in small.items():  # noqa: SIM110 - a loop, not all(generator): a walk asks ~1e5 times
        if get(k, 0) < n:
            return False
    return True


def _label(where: tuple) -> str:
    stage, what = where
    text = what.value if isinstance(what, ActionKind) else what
    return text if stage is None else f"{stage}{text}" if isinstance(what, ActionKind) else f"{text}{stage}"


def compile_walk(
    events: Iterable[tuple[ActionKind, int]],
    *,
    zero: int,
    sharded: bool,
    deferred_reduce: bool = False,
    uses: dict[int, tuple[int, ...]] | None = None,
    classes: dict[int, int] | None = None,
    replicated: bool = False,
    held_inputs: bool = False,
) -> Walk:
    """Walk one rank's lowered actions, given as (kind, stage), for any sizes (see the module docstring).
    ``sharded``: data parallelism (dp > 1); ``classes``: stage -> a stage of equal sizes, whose sizes its
    terms then use (equal blocks: few distinct terms however many stages a rank holds); ``replicated``: hybrid
    sharding whose replica all-reduce sends a narrower copy of each shard (`StageBytes.wire`); ``held_inputs``:
    a stage's backward (B, or I) leaves its input and the input's gradient (`StageBytes.held`) where the
    previous stage runs on the same rank, until that stage's backward of the micro-batch; the other arguments
    as in `StageBytes`."""
    live = _Live(zero, sharded, classes or {}, replicated=replicated and zero > 0 and sharded)
    uses = uses or {}
    events = list(events)
    highest = max(map(itemgetter(1), events), default=0)
    if highest >= _STRIDE:  # its terms' ints would read as another kind's
        raise ValueError(f"compile_walk: stages are numbered below {_STRIDE}; got stage {highest}")
    # where each stage's last REDUCE is: its gradient shard is final once that reduction is waited for
    last_reduce = {s: i for i, (kind, s) in enumerate(events) if kind is _REDUCE or kind is _REDUCE_MB}
    seen: dict[tuple, int] = {}
    # bound once: the loop runs ~1e6 times per search, mostly forwards and backwards
    counts, grads, cls_of, note, n_events = live.counts, live.grads, live.cls.get, live.note, len(events)
    first = events[0][1] if events else None
    # stages whose predecessor is on this rank: their backward's input and its gradient wait for its backward
    chained = {s for _, s in events if s - 1 >= 0} & {s + 1 for _, s in events} if held_inputs else set()
    # a micro-batch's backward on the rank starts at its highest stage and ends at its lowest
    top, bottom = (
        (max(s for _, s in events), min(s for _, s in events)) if held_inputs and events else (-1, -1)
    )
    tied_alive = False  # the tied table's gradient, made by the head's backward before stage 0's own
    i = 0
    while i < n_events:
        kind, s = events[i]
        # a steady state's period starts with a forward after something else (not inside a warm-up's ramp)
        if kind is _F and s == first and i and events[i - 1][0] is not _F:
            i = _skip_repeats(live, events, i, seen)
            kind, s = events[i]
        i += 1
        if kind is _F:  # live.add(_ACT, s), inlined
            key = _ACT * _STRIDE + cls_of(s, s)
            count = counts.get(key, 0) + 1
            if count:
                counts[key] = count
            else:
                del counts[key]
            live.grew = True
            live.dirty = (s, kind)
        elif kind is _B or kind is _I or kind is _W:
            # the highest stage's transient: its replay builds the masks again; a first backward's, with the
            # gradients it has made by then (`StageBytes.first`)
            note((s, kind), working=s, first=kind is _B and s not in grads)
            # one count for the rank (under the lowest stage: every stage's `masks` are the same bytes), so a
            # steady state's counts repeat and `_skip_repeats` finds its period; counted under the top stage
            # they grew by one a micro-batch there while the bottom's fell, and no state ever repeated
            if s == top and kind is not _W:  # the masks stay for the micro-batch's later backwards here
                live.add(_MASKS, bottom)
            if s == bottom and kind is not _I:  # its last backward frees the documents object
                live.add(_MASKS, bottom, -1)
            if chained and kind is not _W:
                # the input gradient is made (kept for the previous stage's backward, with the input it belongs
                # to); this backward consumes the next stage's (its output's gradient) and frees that output
                if s in chained:
                    live.add(_HELD, s)
                if s + 1 in chained and counts.get(_HELD * _STRIDE + cls_of(s + 1, s + 1), 0) > 0:
                    live.add(_HELD, s + 1, -1)
            if kind is not _I:  # I keeps the graph (and its activations) for W
                key = _ACT * _STRIDE + cls_of(s, s)  # live.add(_ACT, s, -1), inlined
                count = counts.get(key, 0) - 1
                if count:
                    counts[key] = count
                else:
                    del counts[key]
                if s not in grads:  # live.grad(s, True)
                    grads.add(s)
                    live.add(_GRAD, s)
                    if s == 0 and tied_alive:  # stage 0's gradients hold the table's, alive since the head's
                        tied_alive = False
                        live.add(_TIED, 0, -1)
                # the head's backward makes the tied table's gradient, which stage 0's gradients hold once it runs
                if s in uses and 0 not in grads and not tied_alive:
                    tied_alive = True
                    live.add(_TIED, 0)
            live.dirty = (s, kind)
        elif kind is _REDUCE or kind is _REDUCE_MB:
            final = last_reduce[s] == i - 1
            # ZeRO-1 depth-first: once, at the stage's last (`ZeroStageComm.reduce`)
            if final or not deferred_reduce:
                live.reduce(s, (s, kind), final=final)
        elif kind is _GATHER and zero >= 3 and sharded:
            for owner in uses.get(s, (s,)):
                live.users[owner] = live.users.get(owner, 0) + 1
                if owner not in live.gathered:
                    live.gathered.add(owner)
                    live.add(_GATHERED, owner)
            live.note((s, kind))
        elif kind is _FREE:
            live.flush()
            for owner in uses.get(s, (s,)):
                live.users[owner] = max(0, live.users.get(owner, 0) - 1)
                if not live.users[owner] and owner in live.gathered:
                    live.gathered.discard(owner)
                    live.add(_GATHERED, owner, -1)
    live.flush()
    if live.replicated:
        live.finish_replicas()
    elif zero:  # the end (`ZeroStageComm.finish`) waits for the reduction in flight before the optimizer step
        live.wait_zero((None, "finish"))
    if zero == 0 and sharded:
        live.write_back()
    moments = _pareto(live.moments)
    after = [(divmod(k, _STRIDE), float(n)) for k, n in sorted(live.counts.items()) if n]
    return Walk(
        moments=tuple(tuple([(divmod(k, _STRIDE), n) for k, n in m]) for m, _ in moments),
        labels=tuple(_label(lb) for _, lb in moments),
        after_backward=tuple([(k, n) for k, n in after if k[0] in (_GRAD, _SHARD)]),
    )


def _skip_repeats(live: _Live, events: list, i: int, seen: dict) -> int:
    """Where to go on from event ``i``. If the walk was in this same state at an earlier event j and the
    L = i - j events from i repeat those from j n times, each repetition repeats the same moments: skip all
    but the last. Steady states of long lists (m micro-batches, v stages) cost a period this way instead of m."""
    state = (
        tuple(sorted(live.counts.items())),
        frozenset(live.grads),
        frozenset(live.shards),
        frozenset(live.gathered),
        tuple(sorted(live.users.items())),
        frozenset(live.pending),
        live.inflight,
        live.out,
        live.inflight_final,
        frozenset(live.wired),
        live.dirty,
        live.grew,
        live.extras,
    )
    j = seen.get(state)
    seen[state] = i
    if j is None:
        return i
    period = events[j:i]
    length, n = i - j, 0
    while events[i + n * length : i + (n + 1) * length] == period:
        n += 1
    if n < 2:
        return i
    seen[state] = i + (n - 1) * length
    return i + (n - 1) * length


_MATRIX_FROM = 256
"""Kept moments from which `_pareto` checks a moment against them all at once (a numpy comparison) rather than
one by one: a list that does not settle into a repeated period (a schedule of ~1e3 micro-batches) leaves ~1e4
moments of which ~2e3 are kept, ~1e7 pairwise checks. Below this the loop, which stops at the first kept moment
that covers, is as fast, and numpy is not imported: at 64, the 1T search on 3072 GPUs imported it and took
6.9 s of CPU instead of 6.3 s."""


def _pareto(moments: dict[tuple[Term, ...], tuple]) -> list[tuple[tuple[Term, ...], tuple]]:
    """The moments no other moment covers (term by term at least as large), in walk order: only these can be
    the largest for some sizes (and where a covered one ties, every component ties too). A moment is checked
    against the ones kept before it (largest total first), one by one, or, once `_MATRIX_FROM` are kept, all at
    once on a matrix of their counts: the same comparisons (`_covers`), the same moments kept."""
    items = [(i, key, label, dict(key)) for i, (key, label) in enumerate(moments.items())]
    items.sort(key=lambda item: -sum(item[3].values()))  # a moment is covered only by one at least as large
    kept: list[tuple[int, tuple[Term, ...], tuple, dict[tuple[int, int], float]]] = []
    matrix = None
    for item in items:
        terms = item[3]
        if matrix is not None:
            if not matrix.covers(terms):
                kept.append(item)
                matrix.add(terms)
            continue
        for other in kept:  # a loop, not any(generator): a search checks ~2e5 pairs
            if _covers(other[3], terms):
                break
        else:
            kept.append(item)
            if len(kept) >= _MATRIX_FROM:
                matrix = _KeptCounts([other[3] for other in kept], items)
    return [(key, label) for _, key, label, _ in sorted(kept, key=lambda item: item[0])]


class _KeptCounts:
    """The kept moments' counts as rows of a matrix, one column per term of any moment (0 where a moment has
    none, as `_covers` reads a missing term), for `_pareto`'s checks at once."""

    def __init__(self, kept: list[dict[tuple[int, int], float]], items: list) -> None:
        import numpy as np  # here: only long lists need it, and its import is a share of `tessera plan`'s start-up

        self.np = np
        self.column = {k: j for j, k in enumerate(sorted({k for item in items for k in item[3]}))}
        self.rows = np.zeros((len(items), len(self.column)), dtype=np.float64)
        self.n = 0
        for terms in kept:
            self.add(terms)

    def add(self, terms: dict[tuple[int, int], float]) -> None:
        row = self.rows[self.n]
        for k, n in terms.items():
            row[self.column[k]] = n
        self.n += 1

    def covers(self, terms: dict[tuple[int, int], float]) -> bool:
        """Whether a kept moment covers ``terms`` (`_covers`: at least its count on each of its terms)."""
        np = self.np
        columns = [self.column[k] for k in terms]
        counts = np.fromiter(terms.values(), dtype=np.float64, count=len(columns))
        return bool((self.rows[: self.n, columns] >= counts).all(axis=1).any())


def walk(actions: Sequence[Action], sizes: StageBytes) -> tuple[Moment, float]:
    """The largest moment of one rank's step and the gradient bytes it holds when backward is over."""
    compiled = compile_walk(
        ((a.kind, a.stage) for a in actions),
        zero=sizes.zero,
        sharded=sizes.dp > 1,
        deferred_reduce=sizes.deferred_reduce,
        uses=sizes.uses,
        replicated=bool(sizes.wire),
    )
    return compiled.evaluate(sizes)


def floor(
    sizes: StageBytes, *, activations: float, reductions: int, reduced_backwards: bool = False
) -> tuple[float, float]:
    """Lower bounds of what any walk of one rank's lowered list holding ``sizes``' stages returns, without
    walking it: (the largest moment's total, the gradient bytes held after backward). ``activations``: a lower
    bound of the activations alive at their peak; ``reductions``: how many REDUCE actions the list has at least;
    ``reduced_backwards``: every backward is a whole B (no I/W split) followed by its REDUCE_MB (not so where a
    stage tied across ranks has its one REDUCE at the end).

    Each term is alive at a moment every such list has (module docstring for what an action holds); a stage's
    size is bounded by its rank's smallest (``min``) where which stage it is depends on the list:

    - the backward after the activations' peak (the first backward action that follows it: nothing freed them
      in between) notes them with its transient beside (``first``: a stage's first backward holds the gradients
      it made by its moment; a later one holds the stage's whole gradients, at least those), and under ZeRO-3 with data parallelism its stage's
      gathered parameters (a compute runs between its stage's GATHER and FREE); with ``reduced_backwards`` under
      ZeRO-2/3 its REDUCE_MB follows, with the activations less that backward's micro-batch beside its stage's
      gradients and their flat copy (and, on a one-stage list of several micro-batches, the gathered
      parameters: that B is not the last action, so the list's one FREE is still ahead);
    - the reduction after the list's last backward action (a B or W, which leaves its stage's gradients)
      flattens them beside those gradients, once the reduction in flight is waited for (its flat copy freed);
      ZeRO-1 keeps every stage's gradients (all complete by then) and, with data parallelism, allocates the
      reduce-scatter's output beside them and the flat copy (in the reduce dtype, ``flat / dp``; until
      2026-12-03 the floor left it out, though the walk counted it); ZeRO's earlier reductions left a shard
      per other stage. Plain data parallelism: only that flat buffer beside its gradients is counted.
    - after backward: every stage's gradients (no ZeRO, ZeRO-1) and ZeRO's shards.
    """
    grads, flat, zero = sizes.grads, sizes.flat, sizes.zero
    if sizes.deferred_reduce:  # ZeRO-1 depth-first launches one reduction per stage, at its last REDUCE
        reductions = min(reductions, len(grads))
    shards = sizes.table(_SHARD) if zero else {}
    # its transient: a first backward's with the gradients it made by then; a later one holds all of its stage's
    at_backward = activations + min(sizes.table(_FIRST).values(), default=0.0)
    gathered = min(grads.values(), default=0.0) if zero >= 3 and sizes.dp > 1 else 0.0
    at_backward += gathered
    if reduced_backwards and zero >= 2:
        after_peak = activations - max(sizes.activations.values()) + min(grads.values()) + min(flat.values())
        one_stage = len(grads) == 1 and reductions > 1
        at_backward = max(at_backward, after_peak + (gathered if one_stage else 0.0))
    at_reduce = 0.0
    if reductions and (zero or sizes.dp > 1):
        at_reduce = (sum(grads.values()) if zero == 1 else min(grads.values())) + min(flat.values())
        if zero == 1 and sizes.dp > 1:  # its reduce-scatter's output, allocated beside the flat copy
            at_reduce += min(flat.values()) / sizes.dp
        if shards:
            at_reduce += sum(shards.values()) - max(shards.values())
    after = (sum(grads.values()) if zero <= 1 else 0.0) + sum(shards.values())
    return max(at_backward, at_reduce), after


def lowered_events(
    steps: Sequence[Step], *, zero3: bool, every_microbatch: bool, exchanged: Sequence[int] = ()
) -> list[tuple[ActionKind, int]]:
    """One rank's compute list with what `tessera.pipeline.passes.lower` inserts, as (kind, stage), in the
    same order, less SEND/RECV (the walk counts no point-to-point buffer by action): REDUCE after the stage's
    last backward (REDUCE_MB after each with ``every_microbatch``), ZeRO-3's GATHER before and FREE after each
    run of one stage's computes, a FREE before a REDUCE at the same point; the rank's stages tied across ranks
    (``exchanged``, in the order the list exchanges them: `ExecutionPlan.exchanged_stages`) no REDUCE there
    but an EXCHANGE each at the end, then their REDUCEs, highest stage first. tests/unit/test_peak_memory.py
    checks it against ``lower`` on every named schedule, with and without tied stages."""
    last_backward = {s: i for i, (s, kind, _) in enumerate(steps) if kind is not _F}
    reduce_kind = _REDUCE_MB if every_microbatch else _REDUCE
    n, out = len(steps), []
    append = out.append
    for i, (s, kind, _) in enumerate(steps):
        if zero3 and (i == 0 or steps[i - 1][0] != s):
            append((_GATHER, s))
        append((kind, s))
        if zero3 and (i == n - 1 or steps[i + 1][0] != s):
            append((_FREE, s))
        if kind is not _F and (every_microbatch or last_backward[s] == i) and s not in exchanged:
            append((reduce_kind, s))
    out += [(_EXCHANGE, s) for s in exchanged]
    out += [(_REDUCE, s) for s in sorted(set(exchanged), reverse=True)]
    return out
