"""The job file: one frozen dataclass per section, and the single loader that builds them.

`load_job` is the only place that reads YAML. It rejects unknown keys, wrong types and out-of-range values
with one sentence naming the file, the line and the key; it normalises durations to float seconds and
relative paths to absolute ones. Nothing past it sees a raw dict.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from supervisor.errors import ConfigError
from supervisor.layout import CHECKPOINTS_DIR, inside

NAME_RE = re.compile(r"^(?!\.+\Z)[A-Za-z0-9._-]{1,100}\Z")  # a file name (not . or ..) and a rendezvous id
MAX_DURATION_S = 1e9  # ~32 years, "never" in practice; beyond it what takes a timeout overflows (Event.wait, C++ ms)
NAME_MAX_BYTES = 255  # one folder or file name, on every Linux filesystem
PATH_MAX_BYTES = 4096  # a whole path, as Linux takes it
MAX_NPROC = 4096  # ranks per node: a typo of 80000 for 8 would have torchrun fork them
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
# A host name (labels of 1 to 63 characters: `node0..cluster` failed to encode, in a traceback), an IPv4 or an
# IPv6 address.
HOST_RE = re.compile(r"^(?=.{1,253}$)(?:[A-Za-z0-9_-]{1,63}(?:\.[A-Za-z0-9_-]{1,63})*\.?"
                     r"|[A-Fa-f0-9.:]*:[A-Fa-f0-9.:]*)$")
MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
NNODES_RANGE_RE = re.compile(r"^(\d+):(\d+)\Z")
# A number as YAML 1.1 leaves it text (1e9, no dot), and an optional unit.
DURATION_RE = re.compile(r"^\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(ms|s|m|min|h)?\s*$")
DURATION_UNITS = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
RDZV_BACKENDS = ("c10d", "etcd", "etcd-v2", "static")
# What torchrun sets in each rank's environment (with TORCHELASTIC_*): not for a job's `env`.
TORCHRUN_SETS = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                           "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
# The --rdzv-conf keys torch's rendezvous backends read (the sources of torch 2.7, 2.13 and 2.15; 2.15 reads
# cas_backoff_max_seconds too): torchrun passes any other key on silently, so a typo (`jion_timeout`) would change
# nothing. Said at `run`, not refused: a newer torch may read more.
RDZV_CONF_KEYS = frozenset({
    "join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout", "keep_alive_interval",
    "keep_alive_max_attempt", "is_host", "read_timeout", "store_type", "cas_backoff_max_seconds", "timeout", "rank",
    "protocol", "cert", "key", "cacert", "etcd_prefix", "ssl_cert", "ssl_cert_key", "ca_cert"})
NPROC_WORDS = ("auto", "cpu", "gpu")
VERIFY_MODES = ("size", "checksum")


@dataclass(frozen=True)
class EntrypointConfig:
    """What torchrun starts on every rank."""

    module: str | None = None
    """Run as `torchrun ... -m MODULE`; exclusive with `script`."""
    script: Path | None = None
    """Run as `torchrun ... SCRIPT`; relative paths resolve against the job file's folder."""
    args: tuple[str, ...] = ()
    """Passed through to the entry point unchanged."""


@dataclass(frozen=True)
class RdzvConfig:
    """torchrun's rendezvous: how the nodes of one job find each other."""

    backend: str = "c10d"
    """One of c10d, etcd, etcd-v2, static."""
    endpoint: str | None = None
    """HOST:PORT of the store. With one node and no endpoint, a free loopback port is chosen per launch;
    with several nodes it is required."""
    id: str = ""
    """The rendezvous id; defaults to the job name."""
    conf: Mapping[str, str] = field(default_factory=dict)
    """Extra `--rdzv-conf` entries, e.g. {last_call_timeout: 5, join_timeout: 600}."""
    local_addr: str | None = None
    """This node's address in the rendezvous (torchrun's --local-addr); defaults to its host name. The
    rendezvous numbers the nodes in the order of their addresses, so a node keeps its ranks (and can read its
    local checkpoint tier) while the set of nodes is unchanged. Several nodes on one host need one each."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often the entry point saves, and what the supervisor keeps."""

    dir: Path = Path()
    """Checkpoint root; defaults to <run_dir>/checkpoints."""
    interval_steps: int | None = 50
    """Save every N steps; None means "auto" (Young/Daly from measured save cost and failure rate)."""
    keep: int = 3
    """Retention: the newest `keep` valid checkpoints survive each new commit."""
    async_save: bool = True
    """Background persistence: training blocks only for the in-memory snapshot."""
    verify: str = "size"
    """Check before each relaunch: "size" (manifest sizes) or "checksum" (every byte)."""
    expected_mtbf_s: float | None = None
    """Prior for the mean time between failures, used by "auto" until failures are observed."""
    min_interval_steps: int = 1
    """Lower bound for "auto"."""
    max_interval_steps: int = 10_000
    """Upper bound for "auto"."""
    local_dir: Path | None = None
    """Node-local fast tier (NVMe, /dev/shm); may contain {node}. Ranks save there; each node's supervisor
    replicates to `dir`, the durable tier. None: one tier, `dir`."""
    keep_local: int = 2
    """Retention in the local tier (a checkpoint not yet replicated is kept regardless; see durable_outage_s)."""
    durable_outage_s: float = 3600.0
    """After the durable tier has failed this long, local checkpoints not yet replicated may be deleted to make
    room (status says so loudly)."""

    @property
    def auto(self) -> bool:
        return self.interval_steps is None

    def local_root(self, node: str) -> Path | None:
        """This node's local tier, `{node}` filled in."""
        root = None if self.local_dir is None else Path(str(self.local_dir).replace("{node}", node))
        if root is not None and (inside(root, self.dir) or inside(self.dir, root)):
            # The job file's check sees `{node}` unfilled: this node's name may still bring the two together.
            raise ConfigError(f"checkpoint.local_dir {str(self.local_dir)!r} is {root} on node {node!r}, which is "
                              f"not apart from checkpoint.dir ({self.dir}): the local tier is copied into the "
                              "durable one; give them folders apart.")
        return root


@dataclass(frozen=True)
class RestartConfig:
    """The supervisor's restart policy."""

    max_restarts: int = 10
    """Relaunches allowed over the whole run (preemptions the supervisor itself asked for do not count)."""
    backoff_s: float = 1.0
    """Wait before a relaunch; doubles per consecutive failure without progress."""
    max_backoff_s: float = 60.0
    """Ceiling for the doubling backoff."""
    crash_loop_attempts: int = 3
    """Consecutive failed attempts without a new valid checkpoint that make a crash loop."""


@dataclass(frozen=True)
class HeartbeatConfig:
    """Rank liveness: how often ranks beat and how long silence is tolerated."""

    interval_s: float = 1.0
    """Ranks write their heartbeat at most this often."""
    timeout_s: float = 60.0
    """A rank silent, or training without progress, this long is hung."""
    startup_timeout_s: float = 600.0
    """Allowance before the first heartbeat (imports, process-group setup, loading the checkpoint)."""
    save_timeout_s: float | None = None
    """A rank blocked in one save (a synchronous one, the stop's) this long is hung: a hung mount. None: as long
    as `startup_timeout_s`. Raise it for a state that takes longer to write than to load."""
    stall_factor: float | None = None
    """If set, a rank in training with no new step for this many times its slowest recent step (at least 3
    heartbeat intervals, at most `timeout_s`) is hung: hangs are caught in seconds on a job with regular steps."""


@dataclass(frozen=True)
class JobConfig:
    """A whole job file, validated and normalised."""

    name: str
    """Letters, digits, '.', '_', '-'."""
    run_dir: Path
    """Absolute; default runs/<name> beside the job file."""
    entrypoint: EntrypointConfig
    nnodes: str = "1"
    """"N" or "MIN:MAX" (elastic membership), exactly as torchrun takes it."""
    nproc_per_node: str = "1"
    """An integer, or auto / cpu / gpu as torchrun takes it."""
    rdzv: RdzvConfig = field(default_factory=RdzvConfig)
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment for the workers."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    restart: RestartConfig = field(default_factory=RestartConfig)
    heartbeat: HeartbeatConfig = field(default_factory=HeartbeatConfig)
    collective_timeout_s: float = 600.0
    """Handed to init_process_group(timeout=...)."""
    stop_timeout_s: float = 30.0
    """After SIGTERM, how long ranks get to checkpoint and exit before SIGKILL."""
    source: Path | None = None
    """The job file this came from (None when built in code)."""
    where: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    """Where each dotted key was set ("job.yaml:7" or "--set KEY=VALUE"), for errors found after loading."""

    @property
    def nnodes_range(self) -> tuple[int, int]:
        lo, _, hi = self.nnodes.partition(":")
        return int(lo), int(hi or lo)

    @property
    def elastic(self) -> bool:
        lo, hi = self.nnodes_range
        return lo != hi

    def to_dict(self, *, relative_to: Path | None = None) -> dict[str, Any]:
        """A JSON-ready copy (paths as strings), stored in the run dir for the light commands.

        Args:
            relative_to: the run dir: paths inside it are written relative to it (layout.recorded), so a
                copied or moved run dir stays whole.
        """
        d = dataclasses.asdict(self)
        del d["where"]
        return _jsonable(d, relative_to)

    def located(self, key: str) -> str:
        """"job.yaml:7" for a dotted key (or the file alone when the key was not written there)."""
        return self.where.get(key) or (str(self.source) if self.source else "the job")


def _jsonable(obj: Any, base: Path | None) -> Any:
    if isinstance(obj, dict):
        return {k: _jsonable(v, base) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v, base) for v in obj]
    if isinstance(obj, Path):
        if base is None:
            return str(obj)
        from supervisor.layout import recorded

        return recorded(obj, base)
    return obj


# --------------------------------------------------------------------------------------------------
# Located values: the YAML tree with each value's line, so every error can name it.


@dataclass
class _Loc:
    value: Any  # dict[str, _Loc] | list[_Loc] | scalar
    where: str  # "job.yaml:12" or "--set a.b=c"


MAX_JOB_BYTES = 16 << 20  # read from a job file at most (a job file is a few KiB)
MAX_NODES = 100_000  # YAML nodes read from one job file, its aliases expanded (a job file has about a hundred)


@dataclass
class _Seen:
    """What one job file's reading has met: its nodes, its collections (an alias is one met again)."""

    nodes: int = 0
    collections: set[int] = field(default_factory=set)
    aliased: bool = False


def _locate(node: yaml.Node, path: str, constructor: yaml.constructor.SafeConstructor, seen: _Seen) -> _Loc:
    where = f"{path}:{node.start_mark.line + 1}"
    seen.nodes += 1
    if seen.nodes > MAX_NODES:  # aliases of aliases ("billion laughs") expand without end in practice
        if seen.aliased:
            raise ConfigError(f"{where}: the job file expands to more than {MAX_NODES} values through its YAML "
                              "aliases (&name ... *name); write the values out.")
        # (audit 15: a big file without aliases was told to write its aliases out)
        raise ConfigError(f"{where}: the job file holds more than {MAX_NODES} values, where a job file has about a "
                          "hundred; pass the job's own file.")
    if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
        seen.aliased = seen.aliased or id(node) in seen.collections
        seen.collections.add(id(node))
    if isinstance(node, yaml.MappingNode):
        out: dict[str, _Loc] = {}
        for key_node, value_node in node.value:
            key = _construct(key_node, path, constructor)
            key_where = f"{path}:{key_node.start_mark.line + 1}"
            if not isinstance(key, str):
                raise ConfigError(f"{key_where}: key {key!r} is not a string; quote it or remove it.")
            if key in out:
                raise ConfigError(f"{key_where}: duplicate key {key!r}; keep only one of them.")
            loc = _locate(value_node, path, constructor, seen)
            if loc.value is None or isinstance(loc.value, (dict, list)):
                loc.where = key_where  # a section's errors point at its key, not its first child
            out[key] = loc
        return _Loc(out, where)
    if isinstance(node, yaml.SequenceNode):
        return _Loc([_locate(n, path, constructor, seen) for n in node.value], where)
    # YAML 1.1 reads an unquoted 1:4 as the base-60 integer 64; "MIN:MAX" must stay a string.
    if node.style is None and NNODES_RANGE_RE.match(node.value):
        return _Loc(node.value, where)
    value = _construct(node, path, constructor)
    if node.style is None and (surprise := _yaml11_surprise(node.value, node.tag, value)):
        raise ConfigError(f"{where}: {surprise}")
    return _Loc(value, where)


OCTAL_RE = re.compile(r"^[-+]?0[0-7_]+\Z")  # YAML 1.1's octal integers: 010 is 8


def _yaml11_surprise(text: str, tag: str, value: Any) -> str | None:
    """Half a sentence for a plain number YAML 1.1 reads other than as written (010 is 8, 1:30:00 is 5400),
    with the fix; None for any other value."""
    if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float"):
        return None
    if ":" in text:
        how = "a base-60 number"
    elif tag.endswith(":int") and OCTAL_RE.match(text):
        how = "an octal number"
    else:
        return None
    return (f"YAML 1.1 reads {text} as {how}, {value}; write the number you mean without leading zeros or "
            f"colons ({value}, if that is it), or quote it to keep it as text.")


def _construct(node: yaml.Node, path: str, constructor: yaml.constructor.SafeConstructor) -> Any:
    """One scalar's value. A value YAML recognises and then cannot build (`2024-13-45`, a date; `!!int abc`; an
    integer of more than 4300 digits) raised from inside the YAML library: one sentence at its line instead."""
    try:
        return constructor.construct_object(node, deep=True)
    except (ValueError, OverflowError, TypeError) as e:
        raise ConfigError(f"{path}:{node.start_mark.line + 1}: YAML cannot read the value {node.value!r} ({e}); "
                          "quote it to keep it as text, or correct it.") from None


def _yaml_error(e: yaml.YAMLError, path: str) -> ConfigError:
    """One line for a YAML error, at the line of the problem (PyYAML's own text is several, with a caret)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    line = f":{mark.line + 1}" if mark is not None else ""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    if "tag:yaml.org,2002:merge" in problem:  # `<<: *defaults`: the safe loader here reads no merge keys
        return ConfigError(f"{path}{line}: YAML merge keys (<<:) are not read here; write the keys out in the "
                           "mapping.")
    return ConfigError(f"{path}{line}: not valid YAML ({problem}); fix it there.")


def _parse_yaml(text: str, path: str) -> _Loc:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        raise _yaml_error(e, path) from None
    except RecursionError:  # the composer recurses once per level
        raise ConfigError(f"{path}: the YAML is nested thousands of levels deep; a job file is a few levels "
                          "deep: fix the brackets.") from None
    if node is None:
        raise ConfigError(f"{path}:1: the job file is empty; it needs at least `name` and `entrypoint`.")
    constructor = yaml.constructor.SafeConstructor()
    try:
        root = _locate(node, path, constructor, _Seen())
    except yaml.YAMLError as e:
        raise _yaml_error(e, path) from None
    except RecursionError:  # an alias inside its own anchor (`a: &a [*a]`), or nesting without end
        raise ConfigError(f"{path}: a YAML alias refers to the node that contains it (&name ... *name), or the "
                          "values nest thousands of levels deep; write the value out.") from None
    if not isinstance(root.value, dict):
        raise ConfigError(f"{root.where}: the job file must be a mapping of keys (name: ..., entrypoint: ...).")
    return root


# --------------------------------------------------------------------------------------------------
# Field checks. Each takes the located value and the dotted key, and returns the normalised value.

Check = Callable[[_Loc, str], Any]


def _plain(v: Any) -> Any:
    """A located value as the user wrote it (no locations), for messages."""
    if isinstance(v, _Loc):
        return _plain(v.value)
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def _fail(loc: _Loc, key: str, must: str) -> ConfigError:
    got = repr(_plain(loc.value))
    return ConfigError(f"{loc.where}: {key} must be {must}, got {got if len(got) <= 200 else got[:200] + '…'}.")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(minimum: int) -> Check:
    def check(loc: _Loc, key: str) -> int:
        if not isinstance(loc.value, int) or isinstance(loc.value, bool) or loc.value < minimum:
            raise _fail(loc, key, f"an integer ≥ {minimum}")
        return loc.value

    return check


def _factor(minimum: float) -> Check:
    def check(loc: _Loc, key: str) -> float:
        v = loc.value
        if isinstance(v, str) and (m := DURATION_RE.fullmatch(v)) and m.group(2) is None:
            v = float(m.group(1))  # YAML 1.1 leaves 1e1 (no dot) as text
        if not _is_number(v) or not minimum <= v <= MAX_DURATION_S:
            raise _fail(loc, key, f"null or a number ≥ {minimum:g} (a multiple of the slowest recent step)")
        return float(v)

    return check


def _duration(*, positive: bool = True, at_least: float = 0.0) -> Check:
    """Seconds as a number, or a string with a unit: 500ms, 30s, 5m, 2h; `at_least`: a floor below which the value
    can only fail every attempt (audit 15: a collective timeout of 1e-30 s crash-looped the run)."""

    def check(loc: _Loc, key: str) -> float:
        v = loc.value
        seconds: float | None = None
        if _is_number(v):
            seconds = float(v) if abs(v) <= MAX_DURATION_S else None  # float() of a 400-digit int overflows
        elif isinstance(v, str) and (m := DURATION_RE.fullmatch(v)):
            seconds = float(m.group(1)) * DURATION_UNITS[m.group(2)]
        if seconds is None or not max(0.0, at_least) <= seconds <= MAX_DURATION_S or (positive and seconds == 0):
            bound = f"of at least {at_least:g}s" if at_least else "> 0" if positive else "≥ 0"
            raise _fail(loc, key, f"a duration {bound} and at most 1e9 seconds (a number, or a string like 30s, "
                                  "5m, 2h)")
        return seconds

    return check


def _optional(check: Check) -> Check:
    def optional(loc: _Loc, key: str) -> Any:
        return None if loc.value is None else check(loc, key)

    return optional


def _bool(loc: _Loc, key: str) -> bool:
    if not isinstance(loc.value, bool):
        raise _fail(loc, key, "true or false")
    return loc.value


def _choice(choices: Sequence[str]) -> Check:
    def check(loc: _Loc, key: str) -> str:
        if loc.value not in choices:
            raise _fail(loc, key, "one of " + ", ".join(choices))
        return loc.value

    return check


def _string(pattern: re.Pattern[str], described: str) -> Check:
    def check(loc: _Loc, key: str) -> str:
        if _is_number(loc.value):  # `name: 123` is a YAML number: the fix is the quotes
            raise ConfigError(f"{loc.where}: {key} must be {described}; YAML reads the value written there as the "
                              f"number {loc.value!r}: put it in quotes.")
        if not isinstance(loc.value, str) or not pattern.fullmatch(loc.value):
            raise _fail(loc, key, described)
        return loc.value

    return check


def _path(loc: _Loc, key: str) -> str:
    if isinstance(loc.value, dict) and list(loc.value) == ["node"]:  # `{node}` unquoted: YAML reads a mapping
        raise _fail(loc, key, "a path; quote one that begins with {node} (\"{node}/ckpt\"), which YAML reads as a "
                              "mapping")
    if not isinstance(loc.value, str) or not loc.value.strip():
        raise _fail(loc, key, "a path (a non-empty string)")
    if key == "checkpoint.local_dir" and (odd := set(re.findall(r"\{[^{}]*\}", loc.value)) - {"{node}"}):
        raise _fail(loc, key, f"a path in which {{node}} is the one name filled in (not {', '.join(sorted(odd))})")
    if "\x00" in loc.value:
        raise _fail(loc, key, "a path without a NUL character")
    if var := re.search(r"\$(\w+|\{[^}]*\})", loc.value):  # audit 15: a folder named `$HOME` was made
        node = " ({node}, without the $, is the one name it fills in)" if var.group(0) == "${node}" else ""
        raise _fail(loc, key, f"a path written out: resilient does not expand {var.group(0)} (only a leading "
                              f"~){node}")
    try:
        encoded = os.fsencode(loc.value)
    except UnicodeEncodeError:  # a lone surrogate ("\ud800"), which YAML's escapes allow
        raise _fail(loc, key, "a path of valid text") from None
    if any(len(part) > NAME_MAX_BYTES for part in encoded.split(b"/")):
        raise _fail(loc, key, f"a path whose every folder and file name is at most {NAME_MAX_BYTES} bytes")
    if len(encoded) >= PATH_MAX_BYTES:
        raise _fail(loc, key, f"a path shorter than {PATH_MAX_BYTES} bytes")
    return loc.value


def _scalar_str(loc: _Loc, key: str) -> str:
    v = loc.value
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, str) and "\x00" in v:
        raise _fail(loc, key, "a string without a NUL character")
    if isinstance(v, str):
        try:
            v.encode()
        except UnicodeEncodeError:  # a lone surrogate ("\ud800"): a traceback in the launch, or a crash loop (audit 15)
            raise _fail(loc, key, "a string of valid text (no lone surrogate such as \\ud800)") from None
    if isinstance(v, (str, int, float)):
        return str(v)
    raise _fail(loc, key, "a string or number")


def _args(loc: _Loc, key: str) -> tuple[str, ...]:
    if not isinstance(loc.value, list):
        raise _fail(loc, key, 'a list of strings, e.g. ["--steps", "100"]')
    return tuple(_scalar_str(item, key) for item in loc.value)


def _str_map(key_pattern: re.Pattern[str] | None = None) -> Check:
    def check(loc: _Loc, key: str) -> dict[str, str]:
        if loc.value is None:
            return {}
        if not isinstance(loc.value, dict):
            raise _fail(loc, key, "a mapping of names to values")
        out = {}
        for name, item in loc.value.items():
            if key_pattern is not None and not key_pattern.fullmatch(name):
                raise ConfigError(
                    f"{item.where}: {key}.{name} is not a valid variable name "
                    "(letters, digits and '_', not starting with a digit)."
                )
            out[name] = _scalar_str(item, f"{key}.{name}")
        return out

    check.free_keys = True  # type: ignore[attr-defined]  # --set may name one of its keys
    return check


def _nnodes(loc: _Loc, key: str) -> str:
    v = loc.value
    if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
        return str(v)
    if isinstance(v, str):
        if v.isdecimal() and int(v) >= 1:  # isdigit() takes "²", which int() refuses
            return str(int(v))
        m = NNODES_RANGE_RE.fullmatch(v)
        if m and 1 <= int(m.group(1)) <= int(m.group(2)):
            return f"{int(m.group(1))}:{int(m.group(2))}"
    raise _fail(loc, key, 'an integer ≥ 1 or "MIN:MAX" with 1 ≤ MIN ≤ MAX')


def _nproc(loc: _Loc, key: str) -> str:
    v = loc.value
    if isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_NPROC:
        return str(v)
    if v in NPROC_WORDS:
        return v
    raise _fail(loc, key, f"an integer from 1 to {MAX_NPROC} or one of " + ", ".join(NPROC_WORDS))


def _endpoint(loc: _Loc, key: str) -> str:
    """HOST:PORT as torchrun parses it (an IPv6 address in brackets); a typo failed only inside torchrun."""
    v = loc.value
    if isinstance(v, str):
        host, sep, port = v.rpartition(":")
        bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if sep and HOST_RE.fullmatch(bare) and port.isdecimal() and 1 <= int(port) <= 65535:
            return f"{host}:{int(port)}"
    raise _fail(loc, key, 'HOST:PORT with a host name or IP address and a port from 1 to 65535, e.g. '
                          '"127.0.0.1:29400"')


def _interval(loc: _Loc, key: str) -> int | None:
    if loc.value == "auto":
        return None
    if isinstance(loc.value, int) and not isinstance(loc.value, bool) and loc.value >= 1:
        return loc.value
    raise _fail(loc, key, 'an integer ≥ 1 or "auto"')


# The schema: section -> key -> check. A nested dict is a section; its keys are checked the same way.
SCHEMA: dict[str, Any] = {
    "name": _string(NAME_RE, "1 to 100 ASCII letters, digits, '.', '_' or '-' (no spaces or slashes, not only "
                             "dots)"),
    "run_dir": _path,
    "entrypoint": {
        "module": _optional(_string(MODULE_RE, "a dotted Python module name, e.g. train_entry")),
        "script": _optional(_path),
        "args": _args,
    },
    "nnodes": _nnodes,
    "nproc_per_node": _nproc,
    "rdzv": {
        "backend": _choice(RDZV_BACKENDS),
        "endpoint": _optional(_endpoint),
        "id": _optional(_string(NAME_RE, "letters, digits, '.', '_' or '-'")),
        "conf": _str_map(),
        "local_addr": _optional(_string(HOST_RE, "a host name or IP address, e.g. 127.0.0.2")),
    },
    "env": _str_map(ENV_NAME_RE),
    "checkpoint": {
        "dir": _optional(_path),
        "interval_steps": _interval,
        "keep": _int(1),
        "async": _bool,
        "verify": _choice(VERIFY_MODES),
        "expected_mtbf_s": _optional(_duration()),
        "min_interval_steps": _int(1),
        "max_interval_steps": _int(1),
        "local_dir": _optional(_path),
        "keep_local": _int(1),
        "durable_outage_s": _duration(),
    },
    "restart": {
        "max_restarts": _int(0),
        "backoff_s": _duration(positive=False),
        "max_backoff_s": _duration(positive=False),
        "crash_loop_attempts": _int(1),
    },
    "heartbeat": {
        "interval_s": _duration(at_least=0.01),
        "timeout_s": _duration(at_least=1.0),
        "startup_timeout_s": _duration(at_least=1.0),
        "save_timeout_s": _optional(_duration(at_least=1.0)),
        "stall_factor": _optional(_factor(2.0)),
    },
    "collective_timeout_s": _duration(at_least=1.0),
    "stop_timeout_s": _duration(at_least=1.0),
}
REQUIRED = ("name", "entrypoint")
REQUIRED_EXAMPLE = {"name": "`name: my-job`", "entrypoint": "`entrypoint: {module: train_entry}`"}


def _allowed(section: Mapping[str, Any]) -> str:
    return ", ".join(section)


def _unknown_key(loc: _Loc, dotted: str, section: Mapping[str, Any]) -> ConfigError:
    leaf = dotted.rpartition(".")[2]
    close = difflib.get_close_matches(leaf, list(section), n=1)
    hint = f'did you mean "{close[0]}"? ' if close else ""
    parent = dotted.rpartition(".")[0] or "the top level"
    return ConfigError(
        f'{loc.where}: unknown key "{dotted}"; {hint}allowed in {parent}: {_allowed(section)}.'
    )


def _check_tree(tree: _Loc, schema: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """Validate a located mapping against `schema`; returns {key: normalised value} for present keys."""
    out: dict[str, Any] = {}
    for key, loc in tree.value.items():
        dotted = f"{prefix}{key}"
        if key not in schema:
            raise _unknown_key(loc, dotted, schema)
        spec = schema[key]
        if isinstance(spec, dict):
            if loc.value is None:
                loc = _Loc({}, loc.where)
            if not isinstance(loc.value, dict):
                raise _fail(loc, dotted, f"a mapping with keys {_allowed(spec)}")
            out[key] = _check_tree(loc, spec, f"{dotted}.")
        else:
            out[key] = spec(loc, dotted)
    return out


# --------------------------------------------------------------------------------------------------
# --set overrides


@dataclass(frozen=True)
class Override:
    """One `--set KEY=VALUE`, VALUE already parsed as YAML."""

    key: str
    value: Any
    text: str


def parse_override(text: str) -> Override:
    """Parse `KEY=VALUE`; VALUE is read as a YAML scalar or list (`10`, `auto`, `[a, b]`, `null`)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f'--set {text}: expected KEY=VALUE with a dotted key, e.g. --set checkpoint.keep=5.')
    if NNODES_RANGE_RE.match(raw.strip()):
        return Override(key, raw.strip(), text)
    try:
        node = yaml.compose(raw, Loader=yaml.SafeLoader) if raw.strip() else None
        if node is not None and _expanded_size(node) > MAX_NODES and not _holds_itself(node):  # aliases of aliases
            raise ConfigError(f"--set {key}=…: the value expands to more than {MAX_NODES} values through its YAML "
                              "aliases (&name ... *name); write the values out.")
        value = "" if node is None else yaml.constructor.SafeConstructor().construct_document(node)
    except (yaml.YAMLError, ValueError, OverflowError, TypeError, RecursionError):  # `2024-13-45`, `!!int abc`
        raise ConfigError(f"--set {text}: the value is not valid YAML, or YAML cannot read it; quote it.") from None
    plain = raw.strip()
    tag = yaml.resolver.Resolver().resolve(yaml.ScalarNode, plain, (True, False))
    if surprise := _yaml11_surprise(plain, tag, value):
        raise ConfigError(f"--set {text}: {surprise}")
    return Override(key, value, text)


def _expanded_size(node: yaml.Node) -> int:
    """How many values `node` holds with its aliases expanded, counted up to just past MAX_NODES (an alias of
    itself, `&a [*a]`, counts without end)."""
    count, stack = 0, [node]
    while stack and count <= MAX_NODES:
        count += 1
        stack.extend(_children(stack.pop()))
    return count


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [x for pair in node.value for x in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _holds_itself(node: yaml.Node) -> bool:
    """An alias inside its own anchor (`&a [*a]`): a cycle in the composed graph (said as such where applied)."""
    visiting, done = {id(node)}, set()
    stack = [(node, iter(_children(node)))]
    while stack:
        parent, rest = stack[-1]
        child = next(rest, None)
        if child is None:
            visiting.discard(id(parent))
            done.add(id(parent))
            stack.pop()
        elif id(child) in visiting:
            return True
        elif id(child) not in done:
            visiting.add(id(child))
            stack.append((child, iter(_children(child))))
    return False


def _to_loc(value: Any, where: str) -> _Loc:
    if isinstance(value, dict):
        return _Loc({str(k): _to_loc(v, where) for k, v in value.items()}, where)
    if isinstance(value, list):
        return _Loc([_to_loc(v, where) for v in value], where)
    return _Loc(value, where)


def _apply_override(root: _Loc, ov: Override) -> None:
    where = f"--set {ov.text}"
    parts = ov.key.split(".")
    node, schema = root, SCHEMA
    for i, part in enumerate(parts):
        dotted = ".".join(parts[: i + 1])
        if not isinstance(schema, dict) or part not in schema:
            section = schema if isinstance(schema, dict) else {}
            raise _unknown_key(_Loc(None, where), dotted, section)
        if i == len(parts) - 1:
            if isinstance(ov.value, dict) and (isinstance(schema[part], dict)
                                               or getattr(schema[part], "free_keys", False)):
                # A section's keys merge into the file's (`--set checkpoint={keep: 5}` keeps checkpoint.dir): a
                # section replaced whole lost the file's other keys, its checkpoint root among them.
                for k, v in ov.value.items():
                    _apply_override(root, Override(f"{ov.key}.{k}", v, ov.text))
                return
            node.value[part] = _to_loc(ov.value, where)
            return
        if not isinstance(schema[part], dict):
            if getattr(schema[part], "free_keys", False) and i == len(parts) - 2:  # env.NAME, rdzv.conf.NAME
                child = node.value.get(part)
                if child is None or not isinstance(child.value, dict):
                    child = node.value[part] = _Loc({}, where)
                child.value[parts[-1]] = _to_loc(ov.value, where)
                return
            if getattr(schema[part], "free_keys", False):
                raise ConfigError(f"{where}: {dotted} takes one level of names ({ov.key} has more); write "
                                  f"--set {dotted}.NAME=VALUE.")
            raise ConfigError(f"{where}: {dotted} takes a value, not keys under it ({ov.key}); "
                              f"write --set {dotted}=VALUE.")
        child = node.value.get(part)
        if child is None or not isinstance(child.value, dict):
            child = _Loc({}, where)
            node.value[part] = child
        node, schema = child, schema[part]


# --------------------------------------------------------------------------------------------------
# The loader


def load_job(path: str | os.PathLike, overrides: Sequence[str | Override] = (), *, to_launch: bool = True) -> JobConfig:
    """Read, validate and normalise a job file.

    Args:
        path: the YAML job file.
        overrides: `--set KEY=VALUE` strings (or parsed `Override`s), applied before validation.
        to_launch: check what only a launch needs (the entry script exists); the light commands, which find the
            run dir and checkpoint root through the job file, pass False (a script moved after training).

    Returns:
        The frozen `JobConfig`, with absolute paths.

    Raises:
        ConfigError: naming the file, the line and the key, for anything that does not validate.
    """
    path = Path(path)
    shown = str(path)
    root = _parse_yaml(_read_job_file(path, shown), shown)
    for given in overrides:
        ov = given if isinstance(given, Override) else parse_override(given)
        try:
            _apply_override(root, ov)
        except RecursionError:  # `&a [*a]`: a list that holds itself
            raise ConfigError(f"--set {ov.text}: the value refers to itself (&name ... *name) and never ends; write "
                              "it out.") from None
    return build_job(root, path, to_launch=to_launch)


def _read_job_file(path: Path, shown: str) -> str:
    """The job file's text, or one sentence: never a wait on a FIFO, never a traceback."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO opened so does not wait
    except FileNotFoundError:
        raise ConfigError(f"{shown}: no such job file; check the path.") from None
    except PermissionError:
        raise ConfigError(f"{shown}: this user may not read the job file (permission denied); give it read "
                          "access, or run as its owner.") from None
    except OSError as e:
        raise ConfigError(f"{shown}: cannot open the job file ({e.strerror or e}); check the path.") from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if stat.S_ISDIR(mode):  # checked before fdopen, which refuses a folder with a traceback's error
        os.close(fd)
        raise ConfigError(f"{shown}: is a folder, not a job file; pass the .yaml file (a run dir resumes as "
                          "`resilient run JOB.yaml --run-dir DIR`).")
    with os.fdopen(fd, "rb") as f:
        try:
            if not stat.S_ISREG(mode) and not stat.S_ISCHR(mode):  # /dev/null reads as an empty file
                raise ConfigError(f"{shown}: is not a regular file (a FIFO or a socket); pass the .yaml file.")
            data = f.read(MAX_JOB_BYTES + 1)
        except OSError as e:
            raise ConfigError(f"{shown}: cannot read the job file ({e.strerror or e}).") from None
    if len(data) > MAX_JOB_BYTES:  # /dev/zero, or a file that is not a job file
        raise ConfigError(f"{shown}: is larger than {MAX_JOB_BYTES >> 20} MiB, which no job file is (a job file is a "
                          "few KiB of YAML); pass the job file you mean.")
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ConfigError(f"{shown}:{line}: the job file is not UTF-8 text (byte {data[e.start]:#04x}); save it as "
                          "UTF-8.") from None


def _where(root: _Loc, dotted: str) -> str:
    """The location of `dotted` (or of its nearest present parent) for a cross-field error."""
    node = root
    for part in dotted.split("."):
        if not isinstance(node.value, dict) or part not in node.value:
            break
        node = node.value[part]
    return node.where


def build_job(root: _Loc, path: Path, *, to_launch: bool = True) -> JobConfig:
    values = _check_tree(root, SCHEMA, "")
    for key in REQUIRED:
        if key not in values:  # no line holds a missing key: name the file, not its first line
            raise ConfigError(f"{path}: required key {key!r} is missing; add it at the top level "
                              f"(e.g. {REQUIRED_EXAMPLE[key]}).")
    base = path.resolve().parent
    name = values["name"]

    def resolve(p: str, key: str) -> Path:
        try:
            return (base / os.path.expanduser(p)).resolve()
        except RuntimeError:  # Python 3.11's Path.resolve on a loop of links
            raise ConfigError(f"{_where(root, key)}: {key} {p!r} leads through a loop of symbolic links; fix the "
                              "link or choose another path.") from None

    ep = values["entrypoint"]
    ep_where = _where(root, "entrypoint")
    if (ep.get("module")) and (ep.get("script")):
        raise ConfigError(f"{ep_where}: entrypoint has both module and script; keep exactly one.")
    if not ep.get("module") and not ep.get("script"):
        raise ConfigError(f"{ep_where}: entrypoint needs module (e.g. train_entry) or script (a .py path).")
    script = resolve(ep["script"], "entrypoint.script") if ep.get("script") else None
    if script is not None and not script.is_file() and to_launch:
        where = _where(root, "entrypoint.script")
        what = "is a folder, not a Python file" if script.is_dir() else "does not exist"
        raise ConfigError(f"{where}: entrypoint.script {ep['script']!r} {what} (looked at {script}).")
    for var in values.get("env", {}):  # audit 6: `env: {RANK: "7"}` was accepted, and did nothing or worse
        if var in TORCHRUN_SETS or var.startswith(("TORCHELASTIC_", "RESILIENT_")):
            who = "resilient hands it over" if var.startswith("RESILIENT_") else "torchrun sets it for each rank"
            raise ConfigError(f"{_where(root, f'env.{var}')}: env.{var}: {who}, so a value here would be overridden or "
                              "would break the launch; remove it.")
    shared = {"run_dir": values.get("run_dir"), "checkpoint.dir": values.get("checkpoint", {}).get("dir")}
    for key, written in shared.items():  # {node} is filled in checkpoint.local_dir alone
        if isinstance(written, str) and "{node}" in written:
            raise ConfigError(f"{_where(root, key)}: {key} {written!r} holds {{node}}, which is filled in only in "
                              "checkpoint.local_dir: the nodes share one run dir (each has nodes/NAME/ in it) and "
                              "one durable root; remove {node} there.")
    entrypoint = EntrypointConfig(module=ep.get("module"), script=script, args=ep.get("args", ()))

    run_dir = resolve(values.get("run_dir") or f"runs/{name}", "run_dir")
    ck = values.get("checkpoint", {})
    ck_dir = resolve(ck["dir"], "checkpoint.dir") if ck.get("dir") else run_dir / CHECKPOINTS_DIR
    local_dir = resolve(ck["local_dir"], "checkpoint.local_dir") if ck.get("local_dir") else None
    ck_fields = {k: v for k, v in ck.items() if k not in ("dir", "async", "local_dir")}
    checkpoint = CheckpointConfig(dir=ck_dir, async_save=ck.get("async", True), local_dir=local_dir, **ck_fields)
    if local_dir is not None and (inside(local_dir, ck_dir) or inside(ck_dir, local_dir)):
        where = _where(root, "checkpoint.local_dir")
        raise ConfigError(f"{where}: checkpoint.local_dir must be apart from checkpoint.dir ({ck_dir}): the local "
                          "tier is copied into the durable one.")
    if checkpoint.min_interval_steps > checkpoint.max_interval_steps:
        where = _where(root, "checkpoint.min_interval_steps")
        raise ConfigError(f"{where}: checkpoint.min_interval_steps exceeds checkpoint.max_interval_steps.")

    restart = RestartConfig(**values.get("restart", {}))
    if restart.max_backoff_s < restart.backoff_s:
        where = _where(root, "restart.max_backoff_s")
        raise ConfigError(f"{where}: restart.max_backoff_s must be ≥ restart.backoff_s ({restart.backoff_s}).")
    heartbeat = HeartbeatConfig(**values.get("heartbeat", {}))
    if heartbeat.timeout_s <= heartbeat.interval_s:
        where = _where(root, "heartbeat.timeout_s")
        raise ConfigError(
            f"{where}: heartbeat.timeout_s ({heartbeat.timeout_s:g}) must exceed heartbeat.interval_s "
            f"({heartbeat.interval_s:g}); a few intervals at least."
        )

    rd = values.get("rdzv", {})
    rdzv = RdzvConfig(
        backend=rd.get("backend", "c10d"),
        endpoint=rd.get("endpoint"),
        id=rd.get("id") or name,
        conf=rd.get("conf", {}),
        local_addr=rd.get("local_addr"),
    )
    nnodes = values.get("nnodes", "1")
    if nnodes != "1" and rdzv.endpoint is None:
        where = _where(root, "nnodes")
        raise ConfigError(
            f'{where}: nnodes is {nnodes!r}, so rdzv.endpoint is required (HOST:PORT of the node that '
            'hosts the store, e.g. "node0:29400").'
        )
    if nnodes != "1" and rdzv.backend == "static":
        raise ConfigError(f"{_where(root, 'rdzv.backend')}: rdzv.backend static numbers no nodes (torchrun would "
                          f"need each node's --node-rank), so nnodes {nnodes!r} cannot work; use backend c10d.")
    for key in ("join_timeout", "last_call_timeout", "close_timeout"):  # torchrun reads them as seconds
        if key in rdzv.conf:
            try:
                seconds = float(rdzv.conf[key])
            except ValueError:
                seconds = float("nan")
            if not 0 < seconds <= MAX_DURATION_S:  # nan, inf and -5 read as numbers too
                raise ConfigError(f"{_where(root, f'rdzv.conf.{key}')}: rdzv.conf.{key} must be a number of "
                                  f"seconds > 0 and at most 1e9 (torchrun reads it so), got {rdzv.conf[key]!r}.")
    return JobConfig(
        name=name,
        run_dir=run_dir,
        entrypoint=entrypoint,
        nnodes=nnodes,
        nproc_per_node=values.get("nproc_per_node", "1"),
        rdzv=rdzv,
        env=values.get("env", {}),
        checkpoint=checkpoint,
        restart=restart,
        heartbeat=heartbeat,
        collective_timeout_s=values.get("collective_timeout_s", 600.0),
        stop_timeout_s=values.get("stop_timeout_s", 30.0),
        source=path.resolve(),
        where=_locations(root, ""),
    )


def _locations(tree: _Loc, prefix: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, loc in tree.value.items():
        out[prefix + key] = loc.where
        if isinstance(loc.value, dict):
            out.update(_locations(loc, f"{prefix}{key}."))
    return out
