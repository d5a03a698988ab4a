"""Goodput from outside, the same way for every system, and the Young/Daly bound it is compared with.

Every trainer's rank 0 appends `{"step": N, "t": T}` per completed step (wall clock), `{"save": N,
"blocking_s": B}` per checkpoint, and the baseline `{"start": restart_count}` per (re)start. From those:

    goodput   = unique steps completed × ideal step time / (final step − launch)
                (not finished: the cap instead of the final step); the ideal step time is the median step
                time of the bare trainer (no checkpoints, no heartbeats) measured just before and just after
                the system (their mean)
    own pace  = the same with the system's own median step time instead of the bare trainer's: the share
                of the wall time not lost to startup, faults, redone steps and saves. Immune to the
                machine's drift between systems (the VM drifts 10-20 % over a benchmark), blind to a
                trainer's slower steps (train_entry's are within 1.4 % of the bare trainer's, paired).
    recovery  = SIGKILL → the first step of the first worker group that started training after it
    hang      = SIGSTOP → the same
    lost      = step completions − unique steps (work done twice)

Young/Daly, Daly's first-order form: the optimal interval is T* = sqrt(2·C·F) and the best achievable
goodput ≈ 1 − (sqrt(2C/F) + R/F) (C/T + T/2F at T*, plus R/F per failure). Two bounds, both from measured
numbers of the system's own run:

    bound          C the effective cost per save (median: blocking plus the slowdown of the steps that ran
                   while it persisted), F the run's measured mean time between failures (wall / faults it
                   met, the hang included), R the mean measured recovery over all of them (the hang's
                   detection budget included): the best a system with these costs could do
    bound_nominal  stricter: C the blocking time only, F the schedule's nominal --mtbf, R the median SIGKILL
                   recovery only (the hang left out)

Both leave out the launch → first step startup, which the measured goodput pays. Both are compared with the
goodput at the system's own pace: C is measured against that pace too, so the ratio says how close the
system came to what its own costs allow, whatever the machine's speed that half hour.
"""

from __future__ import annotations

import itertools
import math
import statistics
from typing import Any

from faults import HANG, KILL


def segments(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Split the records into worker-group lifetimes: a new step-log file (resilient's attempts) or a
    `start` line (the baseline under torchrun or ft_launcher) begins a new one."""
    out: list[list[dict[str, Any]]] = []
    current_file = None
    for r in records:
        if not out or r["file"] != current_file or "start" in r:
            out.append([])
            current_file = r["file"]
        out[-1].append(r)
    return out


def step_times(segs: list[list[dict[str, Any]]]) -> list[float]:
    """Time between consecutive steps within each worker group."""
    out = []
    for seg in segs:
        steps = [r for r in seg if "step" in r]
        out += [b["t"] - a["t"] for a, b in itertools.pairwise(steps) if b["step"] == a["step"] + 1]
    return out


def ideal_step_s(records: list[dict[str, Any]]) -> float | None:
    times = step_times(segments(records))
    return statistics.median(times) if times else None


def save_costs(segs: list[list[dict[str, Any]]], final_step: int, base_s: float | None,
               hang_t: float | None = None) -> tuple[list, list]:
    """Per save (the final one excluded: it follows the last step): the blocking seconds, and the effective
    cost, i.e. blocking plus the extra time (over `base_s`) of the steps that ran while it persisted in the
    background, up to the step in progress at its `commit` line, that one included. Synchronous saves (no
    commit lines) cost their blocking time. A step whose time spans the hang (`hang_t`) is the hang's, not the
    save's: a save in flight when a rank was stopped would otherwise be charged the whole hang."""
    blocking, effective = [], []
    if not any("commit" in r for seg in segs for r in seg):
        blocking = [r["blocking_s"] for seg in segs for r in seg if "save" in r and r["save"] != final_step]
        return blocking, list(blocking)
    for seg in segs:
        in_flight: dict[int, float] = {}  # save step → cost so far
        closing: set[int] = set()  # committed: closed by the step in progress
        last, owed = None, 0.0
        for r in seg:
            if "save" in r and r["save"] != final_step:
                blocking.append(r["blocking_s"])
                in_flight[r["save"]] = r["blocking_s"]
                owed += r["blocking_s"]  # the next step's time includes it: not a slowdown
            elif "commit" in r and r["commit"] in in_flight:
                closing.add(r["commit"])
            elif "step" in r:
                spans_hang = hang_t is not None and last is not None and last["t"] <= hang_t < r["t"]
                if last is not None and r["step"] == last["step"] + 1 and base_s is not None and not spans_hang:
                    extra = max(0.0, r["t"] - last["t"] - owed - base_s)
                    for k in in_flight:
                        in_flight[k] += extra
                last, owed = r, 0.0
                effective += [in_flight.pop(k) for k in sorted(closing)]
                closing.clear()
    return blocking, effective


def _first_step_after(segs: list[list[dict[str, Any]]], t: float) -> float | None:
    """The first step of the first worker group whose first step came after `t`."""
    firsts = [next((r["t"] for r in seg if "step" in r), None) for seg in segs]
    later = [f for f in firsts if f is not None and f > t]
    return min(later) if later else None


def young_daly(c_s: float | None, f_s: float | None, r_s: float | None) -> dict[str, float | None]:
    if c_s is None or not f_s or r_s is None:
        return {"t_opt_s": None, "bound": None}
    return {"t_opt_s": math.sqrt(2 * c_s * f_s), "bound": 1 - (math.sqrt(2 * c_s / f_s) + r_s / f_s)}


def breakdown(segs: list[list[dict[str, Any]]], obs: dict[str, Any], t_end: float, *, hang_t: float | None,
              hang_s: float | None, unique: int, lost: int, ideal_s: float, step_s: float | None,
              checkpoint_s: float) -> dict[str, float]:
    """Where the wall time went, in seconds: launch → first step; the hang (SIGSTOP → first new step); no
    training between worker groups otherwise; steps later redone; checkpoints (effective cost); the unique
    steps at the ideal step time; and the rest (steps slower than ideal; after the last step if unfinished)."""
    spans = sorted((s[0]["t"], s[-1]["t"]) for s in ([r for r in seg if "step" in r] for seg in segs) if s)
    window = (hang_t, hang_t + hang_s) if hang_t is not None and hang_s is not None else (0.0, 0.0)
    down = 0.0
    for (_, end), (start, _) in itertools.pairwise(spans):
        overlap = max(0.0, min(start, window[1]) - max(end, window[0]))
        down += max(0.0, start - end - overlap)
    out = {
        "startup": spans[0][0] - obs["t_launch"] if spans else t_end - obs["t_launch"],
        "hang": window[1] - window[0],
        "down_after_kills": down,
        "redone_steps": lost * (step_s or ideal_s),
        "checkpoints": checkpoint_s,
        "ideal_training": unique * ideal_s,
    }
    out["other"] = (t_end - obs["t_launch"]) - sum(out.values())
    return {k: round(v, 1) for k, v in out.items()}


def measure(obs: dict[str, Any], records: list[dict[str, Any]], *, steps: int, ideal_s: float,
            mtbf_s: float) -> dict[str, Any]:
    """One system's row: goodput and its parts, from what the harness observed and the step logs."""
    segs = segments(records)
    done = [r for r in records if "step" in r]
    unique = len({r["step"] for r in done})
    final = [r["t"] for r in done if r["step"] == steps]
    finished = bool(final)
    t_end = max(final) if finished else obs["t_end"]
    wall = t_end - obs["t_launch"]

    faults = obs["faults"]
    fault_times = sorted(f["t"] for f in faults)
    recoveries, overlapped = [], 0
    hang_s = None
    for f in faults:
        back = _first_step_after(segs, f["t"])
        if back is None:
            continue
        if f["kind"] == HANG:
            hang_s = back - f["t"]
        elif any(f["t"] < other < back for other in fault_times):
            overlapped += 1  # a second fault before recovery: the first fault's time is not its own
        else:
            recoveries.append(back - f["t"])

    run_steps = step_times(segs)
    step_s = statistics.median(run_steps) if run_steps else None
    hang_t = next((f["t"] for f in faults if f["kind"] == HANG), None)
    blocking, effective = save_costs(segs, steps, step_s, hang_t)
    c_s = statistics.median(blocking) if blocking else None
    c_eff = statistics.median(effective) if effective else None
    intervals = []
    for seg in segs:
        saved = [r["save"] for r in seg if "save" in r]
        intervals += [b - a for a, b in itertools.pairwise(saved)]
    r_s = statistics.median(recoveries) if recoveries else None
    # A hang never recovered from cost at least the time until the run ended (or was capped).
    hang_s_at_least = t_end - hang_t if hang_s is None and hang_t is not None else hang_s
    all_recoveries = recoveries + ([hang_s_at_least] if hang_s_at_least is not None else [])
    r_all = statistics.mean(all_recoveries) if all_recoveries else None
    f_measured = wall / len(faults) if faults else None
    yd = young_daly(c_eff, f_measured, r_all)
    yd_nominal = young_daly(c_s, mtbf_s, r_s)
    goodput = unique * ideal_s / wall if wall > 0 else None
    # At the system's own pace (its median step): the share of the wall time not lost to startup, faults,
    # redone steps and saves. This is what the bound models (C is measured against the same pace), and it
    # is immune to the machine's drift between systems; `goodput` also charges a trainer's slower steps.
    own = unique * step_s / wall if wall > 0 and step_s else None
    first = next((r["t"] for r in done), None)
    spent = breakdown(segs, obs, t_end, hang_t=hang_t, hang_s=hang_s, unique=unique, lost=len(done) - unique,
                      ideal_s=ideal_s, step_s=step_s, checkpoint_s=sum(effective) if effective else sum(blocking))
    return {
        "finished": finished,
        "timed_out": obs.get("timed_out", False),
        "exit_code": obs.get("exit_code"),
        "wall_s": round(wall, 2),
        "unique_steps": unique,
        "step_completions": len(done),
        "lost_steps": len(done) - unique,
        "goodput": _r(goodput),
        "goodput_own_pace": _r(own),
        "kills_injected": sum(1 for f in faults if f["kind"] == KILL),
        "hang_injected": any(f["kind"] == HANG for f in faults),
        "restarts": obs["self_report"].get("restarts"),
        "self_reported_goodput": obs["self_report"].get("goodput"),
        "last_interval_choice": obs["self_report"].get("checkpoint_interval"),
        "worker_groups_training": sum(1 for seg in segs if any("step" in r for r in seg)),
        "first_step_s": _r(first - obs["t_launch"]) if first is not None else None,
        "recoveries_s": [round(x, 2) for x in recoveries],
        "recoveries_overlapped": overlapped,
        "mean_recovery_s": _r(statistics.mean(recoveries)) if recoveries else None,
        "restart_cost_s": _r(r_s),
        "restart_cost_all_s": _r(r_all),
        "mtbf_measured_s": _r(f_measured, 1),
        "hang_recovery_s": _r(hang_s),
        "saves": len(blocking),
        "save_interval_steps": statistics.median(intervals) if intervals else None,
        "save_interval_range": [min(intervals), max(intervals)] if intervals else None,
        "checkpoint_cost_s": _r(c_s, 4),
        "checkpoint_cost_eff_s": _r(c_eff, 4),
        "step_s": _r(step_s, 4),
        "t_opt_s": _r(yd["t_opt_s"]),
        "t_opt_steps": round(yd["t_opt_s"] / ideal_s) if yd["t_opt_s"] is not None else None,
        "bound": _r(yd["bound"]),
        "goodput_over_bound": _r(own / yd["bound"]) if own is not None and yd["bound"] else None,
        "bound_nominal": _r(yd_nominal["bound"]),
        "goodput_over_bound_nominal": (_r(own / yd_nominal["bound"])
                                       if own is not None and yd_nominal["bound"] else None),
        "wall_breakdown_s": spent,
    }


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


COLUMNS = [
    ("system", "system"), ("goodput", "goodput"), ("goodput_own_pace", "at own pace"), ("bound", "Y/D bound"),
    ("goodput_over_bound", "own ÷ bound"),
    ("bound_nominal", "nominal bound"), ("goodput_over_bound_nominal", "÷ nominal"),
    ("mtbf_measured_s", "F s"), ("restart_cost_all_s", "R s"),
    ("finished", "finished"), ("wall_s", "wall s"), ("unique_steps", "steps"), ("kills_injected", "kills"),
    ("hang_injected", "hang"), ("restarts", "restarts"), ("mean_recovery_s", "mean recovery s"),
    ("hang_recovery_s", "hang → step s"), ("lost_steps", "lost steps"), ("save_interval_steps", "ckpt every"),
    ("checkpoint_cost_s", "C s"), ("checkpoint_cost_eff_s", "C eff s"), ("step_s", "step s"),
    ("ideal_step_s", "ref step s"), ("first_step_s", "launch → step s"),
]


def table(rows: dict[str, dict[str, Any]]) -> str:
    """A markdown table, one row per system."""
    def cell(v: Any) -> str:
        if v is None:
            return "—"
        if isinstance(v, bool):
            return "yes" if v else "no"
        return f"{v:g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |",
             "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for key, row in rows.items():
        row = {**row, "system": f"{key}: {row.get('name', key)}"}
        lines.append("| " + " | ".join(cell(row.get(k)) for k, _ in COLUMNS) + " |")
    return "\n".join(lines)


def breakdown_table(rows: dict[str, dict[str, Any]]) -> str:
    """Where each system's wall time went (seconds), one row per system."""
    keys = ["startup", "hang", "down_after_kills", "redone_steps", "checkpoints", "ideal_training", "other"]
    lines = ["| system | wall s | " + " | ".join(k.replace("_", " ") for k in keys) + " |",
             "|" + "|".join("---" for _ in range(len(keys) + 2)) + "|"]
    for key, row in rows.items():
        spent = row["wall_breakdown_s"]
        lines.append(f"| {key}: {row.get('name', key)} | {row['wall_s']:g} | "
                     + " | ".join(f"{spent[k]:g}" for k in keys) + " |")
    return "\n".join(lines)


def goals(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The lead's goals for `auto`, checked and stated (met, not met, or not measurable): (b), and (f), which
    is (b) with the stall rule."""
    out = []
    for key in ("b", "f"):
        auto = rows.get(key)
        if not auto:
            continue
        if auto.get("goodput_over_bound") is not None:
            ok = auto["goodput_over_bound"] >= 0.9
            out.append(f"({key}) auto ≥ 0.9 × its Young/Daly bound (measured C, F, R; goodput at its own pace): "
                       f"{auto['goodput_over_bound']:.2f} × — {'met' if ok else 'NOT met'}")
        if auto.get("goodput_over_bound_nominal") is not None:
            ok = auto["goodput_over_bound_nominal"] >= 0.9
            out.append(f"({key}) auto ≥ 0.9 × the stricter nominal bound (blocking C, F = --mtbf, kills only): "
                       f"{auto['goodput_over_bound_nominal']:.2f} × — {'met' if ok else 'NOT met'}")
        for base_key, what in (("c", "baseline (c), pg timeout tuned to --hang-timeout"),
                               ("e", "baseline (e), as the tutorial is written")):
            base = rows.get(base_key)
            if base and auto.get("goodput") and base.get("goodput"):
                ratio = auto["goodput"] / base["goodput"]
                own = (f"; at their own paces {auto['goodput_own_pace'] / base['goodput_own_pace']:.2f} ×"
                       if auto.get("goodput_own_pace") and base.get("goodput_own_pace") else "")
                out.append(f"({key}) auto ≥ 1.3 × {what}: {ratio:.2f} ×{own} — {'met' if ratio >= 1.3 else 'NOT met'}")
    return out
