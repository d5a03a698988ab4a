"""`checkpoint.interval_steps: auto`: the checkpoint interval from measured save cost and failure rate.

Young/Daly: with C the cost of one checkpoint to training, F the mean time between failures and R the cost
of a restart, the interval that minimises expected waste is, to first order (Daly 2006),

    T* = sqrt(2·C·(F + R)) − C        (for C < F/2; T* = F beyond)

and the waste at T* is about C/T* + (T*/2 + R)/F. Here:
- C is what a save really costs training: the time it blocks the loop, plus the extra time of the steps
  that ran while the save persisted in the background, the one in progress when it committed included (on a
  busy host those steps are slower);
- F is the mean time between failures: with a prior (`checkpoint.expected_mtbf_s`), (prior + supervised
  wall time) / (1 + failures), the prior counting as one pseudo-interval; without one, supervised wall time /
  (1 + failures), as if a failure were due now: short intervals while nothing is known (cheap with async
  saves), growing as the run stays healthy;
- R is the measured restart cost (failure → first step of the next attempt), 0 until one is seen.
T* becomes steps through the median step time, bounded by `min_interval_steps`/`max_interval_steps`, and
never below the steps a background save needs to finish (so saves never queue behind each other).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

MIN_OBSERVED_S = 10.0
COLD_START_STEPS = 50  # until a save and some steps have been measured
SETTLED_COSTS = 3  # a measured interval moves again only on the median of this many save costs
KEPT_STEP_TIMES = 100  # step times a supervisor restart carries over (state.json)


STEP_LOG_RESOLUTION_S = 1e-4  # the step log's times have four decimals


def young_daly(save_cost_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """The interval in seconds that minimises the expected waste (Daly's first-order form), never shorter than
    a save and never longer than the MTBF. Continuous and rising with the save cost: a cut-off at C = M/2 made a
    dearer save give a shorter interval (9.55 s at C=0.4999 s, M=1 s, R=100 s; 1 s at C=0.5 s)."""
    if save_cost_s <= 0:
        return 0.0
    first_order = math.sqrt(2 * save_cost_s * (mtbf_s + max(0.0, restart_s))) - save_cost_s
    return min(mtbf_s, max(save_cost_s, first_order))


def expected_waste(interval_s: float, save_cost_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Fraction of wall time lost with checkpoints every `interval_s`: saving, redoing half an interval and
    restarting per failure."""
    if interval_s <= 0:
        return 1.0
    return min(1.0, save_cost_s / interval_s + (interval_s / 2 + restart_s) / mtbf_s)


def mtbf_estimate(prior_s: float | None, observed_s: float, failures: int) -> float:
    if prior_s is not None:
        return (prior_s + observed_s) / (1 + failures)
    return max(observed_s, MIN_OBSERVED_S) / (1 + failures)


@dataclass(frozen=True)
class IntervalChoice:
    steps: int
    why: str
    seconds: float | None = None
    save_cost_s: float | None = None
    mtbf_s: float | None = None
    restart_s: float | None = None
    step_s: float | None = None

    def to_dict(self) -> dict[str, object]:
        return {"mode": "auto", "steps": self.steps, "seconds": _r(self.seconds), "why": self.why,
                "save_cost_s": _r(self.save_cost_s), "mtbf_s": _r(self.mtbf_s), "restart_s": _r(self.restart_s),
                "step_s": _r(self.step_s, 5)}


def _r(v: float | None, nd: int = 3) -> float | None:
    return None if v is None else round(v, nd)


class IntervalTuner:
    """Learns step time and save cost from the step log; `choose` applies Young/Daly."""

    def __init__(self, prior_mtbf_s: float | None, min_steps: int, max_steps: int):
        self.prior = prior_mtbf_s
        self.min_steps, self.max_steps = min_steps, max_steps
        self.step_dts: deque[float] = deque(maxlen=400)
        self.costs: deque[float] = deque(maxlen=10)
        self.persist: deque[float] = deque(maxlen=10)
        self._last: tuple[int, float] | None = None
        self._flight: dict[int, list[float]] = {}  # save step → durations of the steps run while it persisted
        self._blocking: dict[int, float] = {}
        self._closing: set[int] = set()  # committed saves whose flight ends with the step in progress
        self._committed: set[int] = set()  # a synchronous save commits before its blocking time is logged
        self.measured = 0  # saves whose cost (and persist time) is known: each one a reason to choose again

    # ---- what the supervisor sees ------------------------------------------------------------------

    def new_attempt(self) -> None:
        self._last = None
        self._flight.clear()
        self._blocking.clear()
        self._closing.clear()
        self._committed.clear()

    def on_step(self, step: int, t: float) -> None:
        if self._last is not None and step == self._last[0] + 1:
            dt = t - self._last[1]
            if self._flight:
                for durations in self._flight.values():
                    durations.append(dt)
            else:
                self.step_dts.append(dt)
        self._last = (step, t)
        for done in self._closing:  # each also in _flight and _blocking: on_commit closes only a save it holds
            self._close(done)
        self._closing.clear()

    def on_save(self, step: int, blocking_s: float) -> None:
        if self._last is not None:
            self._last = (self._last[0], self._last[1] + blocking_s)  # the blocked time is not a step's
        if step in self._committed:  # synchronous: nothing ran while it persisted
            self._committed.discard(step)
            self.costs.append(blocking_s)
            self.measured += 1
            return
        self._blocking[step] = blocking_s
        self._flight[step] = []

    def on_commit(self, step: int, persist_s: float) -> None:
        """A save committed. Its cost is counted once the step in progress is logged: that step ran beside the
        persist too (a persist shorter than a step commits inside the step after the save, whose slowdown was
        charged nothing before: measured on the goodput benchmark, that step took 88 ms against 53, while the
        save was charged its 9 ms of blocking alone)."""
        self.persist.append(persist_s)
        if step not in self._blocking:
            self._committed.add(step)
            return
        self._closing.add(step)

    def _close(self, step: int) -> None:
        blocking, during = self._blocking.pop(step), self._flight.pop(step)
        base = self.step_s
        slowdown = sum(max(0.0, d - base) for d in during) if base is not None else 0.0
        self.costs.append(blocking + slowdown)
        self.measured += 1

    # ---- across supervisor restarts -------------------------------------------------------------------

    def memory(self) -> dict[str, list[float]]:
        """What was measured, for the next supervisor of the run (it started from nothing and the interval
        flapped on the median of one or two saves)."""
        return {"step_dts": [round(v, 6) for v in list(self.step_dts)[-KEPT_STEP_TIMES:]],
                "costs": [round(v, 6) for v in self.costs], "persist": [round(v, 6) for v in self.persist]}

    def restore(self, memory: object) -> None:
        """Take back a `memory()`; what is not a finite, non-negative duration is left out."""
        if not isinstance(memory, dict):
            return
        for key, into in (("step_dts", self.step_dts), ("costs", self.costs), ("persist", self.persist)):
            values = memory.get(key)
            if isinstance(values, list):
                into.extend(float(v) for v in values
                            if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e6)

    @property
    def settled(self) -> bool:
        return len(self.costs) >= SETTLED_COSTS

    # ---- estimates -----------------------------------------------------------------------------------

    @property
    def step_s(self) -> float | None:
        return statistics.median(self.step_dts) if len(self.step_dts) >= 5 else None

    @property
    def save_cost_s(self) -> float | None:
        return statistics.median(self.costs) if self.costs else None

    def choose(self, observed_s: float, failures: int, restart_s: float | None) -> IntervalChoice:
        step_s, cost = self.step_s, self.save_cost_s
        if step_s is not None:
            step_s = max(step_s, STEP_LOG_RESOLUTION_S)  # steps faster than the log's 0.1 ms read as 0
        if step_s is None or cost is None:
            steps = max(self.min_steps, min(self.max_steps, COLD_START_STEPS))
            return IntervalChoice(steps, f"cold start: {steps} steps until a save and the step time are measured")
        mtbf = mtbf_estimate(self.prior, observed_s, failures)
        restart = restart_s or 0.0
        t_opt = young_daly(cost, mtbf, restart)
        steps = max(1, round(t_opt / step_s))
        # Long enough for a save to persist before the next begins (the median of the recent ones: one stalled
        # save must not hold the interval up for ten saves); the job's max_interval_steps is the last word.
        floor = math.ceil(statistics.median(self.persist) / step_s) if self.persist else 1
        bounded = min(self.max_steps, max(self.min_steps, floor, steps))
        prior = f"prior {self.prior:.0f}s" if self.prior else "no prior"
        why = (f"Young/Daly: save cost {cost:.3f}s, MTBF {mtbf:.0f}s ({prior}, {failures} failure(s) in "
               f"{observed_s:.0f}s), restart {restart:.1f}s → T*={t_opt:.1f}s = {steps} steps of {step_s * 1e3:.1f}ms")
        if bounded != steps:
            why += f", bounded to {bounded}"
        return IntervalChoice(bounded, why, t_opt, cost, mtbf, restart, step_s)
