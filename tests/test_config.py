"""Job files: defaults, normalisation, --set, and the many ways a job file can be wrong."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from supervisor.config import load_job, parse_override
from supervisor.errors import ConfigError

GOOD = """\
name: tiny-gpt
entrypoint:
  module: train_entry
  args: [--steps, 100, --lr, 3e-4]
nproc_per_node: 2
checkpoint:
  interval_steps: 10
"""


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_defaults_and_normalisation(tmp_path):
    job = load_job(write(tmp_path, GOOD))
    assert job.name == "tiny-gpt"
    assert job.run_dir == (tmp_path / "runs/tiny-gpt").resolve()
    assert job.checkpoint.dir == job.run_dir / "checkpoints"
    assert job.entrypoint.args == ("--steps", "100", "--lr", "3e-4")
    assert job.nproc_per_node == "2" and job.nnodes == "1" and not job.elastic
    assert job.rdzv.id == "tiny-gpt" and job.rdzv.backend == "c10d" and job.rdzv.endpoint is None
    assert job.checkpoint.keep == 3 and job.checkpoint.async_save and job.checkpoint.verify == "size"
    assert job.restart.max_restarts == 10 and job.restart.backoff_s == 1.0
    assert job.heartbeat.timeout_s == 60.0 and job.collective_timeout_s == 600.0


def test_durations_paths_and_elastic_ranges(tmp_path):
    (tmp_path / "train.py").write_text("")
    job = load_job(write(tmp_path, """\
        name: x
        run_dir: out/run
        entrypoint: {script: train.py}
        nnodes: 1:4
        rdzv: {endpoint: "127.0.0.1:29400", conf: {last_call_timeout: 5}, local_addr: 10.0.0.7}
        heartbeat: {interval_s: 500ms, timeout_s: 2m, startup_timeout_s: 1h, stall_factor: 10}
        checkpoint: {interval_steps: auto, dir: /tmp/ck, expected_mtbf_s: 30m}
        collective_timeout_s: 90s
        env: {OMP_NUM_THREADS: 1, DEBUG: true}
    """))
    # YAML 1.1 would read the unquoted 1:4 as the base-60 integer 64.
    assert job.nnodes == "1:4" and job.nnodes_range == (1, 4) and job.elastic
    assert job.entrypoint.script == tmp_path / "train.py"
    assert job.run_dir == tmp_path / "out/run"
    hb = job.heartbeat
    assert hb.interval_s == 0.5 and hb.timeout_s == 120 and hb.startup_timeout_s == 3600 and hb.stall_factor == 10
    assert job.checkpoint.auto and job.checkpoint.expected_mtbf_s == 1800 and job.checkpoint.dir == Path("/tmp/ck")
    assert job.collective_timeout_s == 90.0
    assert job.env == {"OMP_NUM_THREADS": "1", "DEBUG": "1"}
    assert job.rdzv.conf == {"last_call_timeout": "5"} and job.rdzv.local_addr == "10.0.0.7"


def test_set_overrides_apply_before_validation(tmp_path):
    path = write(tmp_path, GOOD)
    job = load_job(path, ["checkpoint.interval_steps=auto", "nproc_per_node=1", "run_dir=elsewhere",
                          "entrypoint.args=[--steps, 5]", "restart.backoff_s=0"])
    assert job.checkpoint.auto and job.nproc_per_node == "1"
    assert job.run_dir == tmp_path / "elsewhere"
    assert job.entrypoint.args == ("--steps", "5") and job.restart.backoff_s == 0.0
    assert parse_override("nnodes=2:3").value == "2:3"
    assert load_job(path, ["heartbeat.timeout_s=1e9"]).heartbeat.timeout_s == 1e9  # "never", as users write it
    job = load_job(path, ["env.FOO=1", "rdzv.conf.join_timeout=30"])  # a key of a free-form map
    assert job.env["FOO"] == "1" and job.rdzv.conf["join_timeout"] == "30"
    # A section given as a mapping merges into the file's: it replaced it, and checkpoint.dir fell back to the
    # default root (a rerun started fresh beside its checkpoints).
    path = write(tmp_path, GOOD + "  dir: /tmp/ck\nenv: {OMP_NUM_THREADS: 1}\n")
    job = load_job(path, ["checkpoint={keep: 7, verify: size}", "env={BAR: 2}"])
    assert job.checkpoint.keep == 7 and job.checkpoint.dir == Path("/tmp/ck") and job.checkpoint.interval_steps == 10
    assert job.env == {"OMP_NUM_THREADS": "1", "BAR": "2"}
    with pytest.raises(ConfigError, match=r"checkpoint\.kep"):
        load_job(path, ["checkpoint={kep: 7}"])


def test_usage_errors_are_one_sentence_naming_the_command_and_its_help(cli):
    """click printed three lines (usage, a hint, the error) where the contract asks for one sentence."""
    for args, said in ((["run", "--bogus", "x"], "resilient run: No such option: --bogus"),
                       (["run"], "resilient run: Missing argument 'JOB.yaml'"),
                       (["gc", "--keep", "abc"], "resilient gc: Invalid value for '--keep'"),
                       (["nosuch"], "resilient: No such command 'nosuch'")):
        r = cli(*args)
        assert r.exit_code == 2 and r.stderr.startswith(said) and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.rstrip().endswith(f"see `{said.split(':')[0]} --help`."), r.stderr
    r = cli()  # no command at all: the help, as before
    assert r.exit_code == 2 and "Commands:" in r.output


def test_odd_arguments_and_a_self_containing_alias_are_one_sentence(tmp_path, cli, monkeypatch):
    job = write(tmp_path, GOOD + "extra: &a [*a]\n")
    r = cli("run", job)
    assert r.exit_code == 2 and "refers to the node that contains it" in r.stderr and "Traceback" not in r.output
    # The job file's limit on aliases of aliases holds for --set values too (audit 6: 12 s and 915 MB, then longer).
    levels = ["a: &a [x, x, x, x, x, x, x, x, x]"] + [
        f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]" for p, c in zip("abcdef", "bcdefg", strict=True)]
    r = cli("run", write(tmp_path, GOOD), "--set", "env={" + ", ".join(levels) + "}")
    assert r.exit_code == 2 and "expands to more than 100000 values" in r.stderr, r.output
    for port in ("99999", "-1"):
        r = cli("rdzv-store", "--port", port)
        assert r.exit_code == 2 and "a TCP port is 1 to 65535" in r.stderr, r.output
    r = cli("rdzv-store", "--host", "no-such-host.invalid", "--port", "29999")  # it hung ~50 s, blaming the port
    assert r.exit_code == 2 and "does not resolve" in r.stderr and "--port" not in r.stderr, r.output
    from supervisor.commands.rdzv_store import _local

    # Not this machine's: said at once (and the store tried, since a Service or a NAT may lead back here).
    assert _local("127.0.0.1") and _local("0.0.0.0") and not _local("192.0.2.1")
    for wait in ("nan", "-1"):
        r = cli("status", tmp_path, "--wait-ranks", "--wait-timeout", wait)
        assert r.exit_code == 2 and "--wait-timeout" in r.stderr, r.output
    monkeypatch.setenv("RESILIENT_DEBUG", "1")  # the traceback too, not another exit code or output
    r = cli("gc", tmp_path, "--keep", "0", "--json")
    assert r.exit_code == 2 and json.loads(r.stdout)["exit_code"] == 2 and "Traceback" in r.stderr


def test_a_node_name_that_is_not_a_folder_name_is_refused_before_anything_is_created(tmp_path, cli):
    path = write(tmp_path, GOOD)
    for bad in ("../../escaped", "/tmp/abs", "..", "a\n", "", "-x"):  # -x: a folder shells trip over (audit 18)
        result = cli("run", path, f"--node={bad}")
        assert result.exit_code == 2 and "a node name is 1 to 100 letters" in result.stderr, result.output
    assert not (tmp_path / "runs").exists()


# (job text, override, expected line, expected words in the message)
BAD = {
    "invalid yaml": ("name: x\nentrypoint:\n  module: m\n   args: []\n", None, 4, ["not valid YAML"]),
    "empty file": ("", None, 1, ["empty"]),
    "not a mapping": ("- a\n- b\n", None, 1, ["mapping"]),
    # A missing key has no line: the file is named, not its first line (which used to be `name:`).
    "missing name": ("entrypoint: {module: m}\n", None, None, ["job.yaml: required key 'name' is missing"]),
    "missing entrypoint": ("name: x\nnproc_per_node: 2\n", None, None,
                           ["job.yaml: required key 'entrypoint' is missing", "entrypoint: {module: train_entry}"]),
    "unknown top key": ("name: x\nentrypoint: {module: m}\nnproc: 2\n", None, 3, ['"nproc"', "nproc_per_node"]),
    "unknown entrypoint key": ("name: x\nentrypoint:\n  module: m\n  argv: []\n", None, 4, ['"entrypoint.argv"']),
    "unknown checkpoint key": ("name: x\nentrypoint: {module: m}\ncheckpoint:\n  intervall_steps: 5\n", None, 4,
                               ['"checkpoint.intervall_steps"', 'did you mean "interval_steps"']),
    "unknown restart key": ("name: x\nentrypoint: {module: m}\nrestart: {retries: 3}\n", None, 3,
                            ['"restart.retries"']),
    "unknown heartbeat key": ("name: x\nentrypoint: {module: m}\nheartbeat:\n  every: 1\n", None, 4,
                              ['"heartbeat.every"']),
    "unknown rdzv key": ("name: x\nentrypoint: {module: m}\nrdzv:\n  host: a\n", None, 4, ['"rdzv.host"']),
    "wrong type nproc": ("name: x\nentrypoint: {module: m}\nnproc_per_node: two\n", None, 3,
                         ["nproc_per_node must be", "'two'"]),
    "zero interval": ("name: x\nentrypoint: {module: m}\ncheckpoint:\n  interval_steps: 0\n", None, 4,
                      ["checkpoint.interval_steps must be"]),
    "negative interval": ("name: x\nentrypoint: {module: m}\ncheckpoint:\n  interval_steps: -5\n", None, 4,
                          ["checkpoint.interval_steps", "-5"]),
    "keep zero": ("name: x\nentrypoint: {module: m}\ncheckpoint: {keep: 0}\n", None, 3, ["checkpoint.keep", "≥ 1"]),
    "nnodes 4:1": ("name: x\nentrypoint: {module: m}\nnnodes: 4:1\n", None, 3, ["nnodes", "MIN ≤ MAX"]),
    "module and script": ("name: x\nentrypoint:\n  module: m\n  script: t.py\n", None, 2, ["both module and script"]),
    "neither module nor script": ("name: x\nentrypoint:\n  args: []\n", None, 2, ["needs module"]),
    "bad name": ("name: my job/1\nentrypoint: {module: m}\n", None, 1, ["name must be", "'my job/1'"]),
    "unknown --set key": (GOOD, "checkpoint.every=5", None, ["--set checkpoint.every=5", '"checkpoint.every"']),
    "bad --set value": (GOOD, "restart.max_restarts=-1", None, ["--set restart.max_restarts=-1", "≥ 0"]),
    "timeout below interval": ("name: x\nentrypoint: {module: m}\nheartbeat:\n  interval_s: 5\n  timeout_s: 2\n",
                               None, 5, ["heartbeat.timeout_s", "must exceed"]),
    "stall factor below 2": ("name: x\nentrypoint: {module: m}\nheartbeat:\n  stall_factor: 1.5\n", None, 4,
                             ["heartbeat.stall_factor must be null or a number ≥ 2"]),
    "duplicate key": ("name: x\nname: y\nentrypoint: {module: m}\n", None, 2, ["duplicate key 'name'"]),
    "args not a list": ("name: x\nentrypoint:\n  module: m\n  args: --steps 5\n", None, 4,
                        ["entrypoint.args must be a list"]),
    "bad env name": ("name: x\nentrypoint: {module: m}\nenv:\n  1BAD: x\n", None, 4, ["env.1BAD"]),
    "an env variable torchrun sets": ("name: x\nentrypoint: {module: m}\nenv:\n  OMP_NUM_THREADS: 1\n  RANK: 7\n",
                                      None, 5, ["env.RANK: torchrun sets it for each rank", "remove it"]),
    "an env variable resilient hands over": ("name: x\nentrypoint: {module: m}\nenv: {RESILIENT_CKPT_DIR: /x}\n", None,
                                             3, ["env.RESILIENT_CKPT_DIR: resilient hands it over"]),
    "a typo of {node} in local_dir": ("name: x\nentrypoint: {module: m}\ncheckpoint:\n  local_dir: /shm/{nod}\n", None,
                                      4, ["{node} is the one name filled in (not {nod})"]),
    "--set local_dir={node} unquoted": (GOOD, "checkpoint.local_dir={node}", None,
                                        ["quote one that begins with {node}", "which YAML reads as a mapping"]),
    "a YAML merge key": ("name: x\nentrypoint: {module: m}\nd: &d {keep: 4}\ncheckpoint:\n  <<: *d\n", None, 5,
                         ["YAML merge keys (<<:) are not read here; write the keys out"]),
    "bad verify": ("name: x\nentrypoint: {module: m}\ncheckpoint:\n  verify: md5\n", None, 4,
                   ["checkpoint.verify must be one of size, checksum"]),
    "bad bool": ("name: x\nentrypoint: {module: m}\ncheckpoint:\n  async: sometimes\n", None, 4,
                 ["checkpoint.async must be true or false"]),
    "missing script": ("name: x\nentrypoint:\n  script: nowhere.py\n", None, 3, ["does not exist"]),
    "multinode without endpoint": ("name: x\nentrypoint: {module: m}\nnnodes: 2\n", None, 3,
                                   ["rdzv.endpoint is required"]),
    "bad duration": ("name: x\nentrypoint: {module: m}\ncollective_timeout_s: ten minutes\n", None, 3,
                     ["collective_timeout_s must be a duration"]),
    "bad endpoint": ("name: x\nentrypoint: {module: m}\nrdzv: {endpoint: nohost}\n", None, 3,
                     ["rdzv.endpoint must be HOST:PORT"]),
    "section not a mapping": ("name: x\nentrypoint: {module: m}\nrestart: 3\n", None, 3,
                              ["restart must be a mapping"]),
    # Values that validated, then crashed the launch in a traceback (or every rank: inf overflows timedelta).
    "infinite duration": ("name: x\nentrypoint: {module: m}\nstop_timeout_s: .inf\n", None, 3,
                          ["stop_timeout_s must be a duration of at least 1s and at most 1e9 seconds", "inf"]),
    "huge duration": ("name: x\nentrypoint: {module: m}\ncollective_timeout_s: 1.0e+20\n", None, 3,
                      ["collective_timeout_s must be a duration of at least 1s and at most 1e9 seconds"]),
    "name ending in a newline": ('name: "x\\n"\nentrypoint: {module: m}\n', None, 1, ["name must be"]),
    "NUL in a path": ('name: x\nentrypoint: {module: m}\nrun_dir: "a\\0b"\n', None, 3,
                      ["run_dir must be a path without a NUL character"]),
    "NUL in env": ('name: x\nentrypoint: {module: m}\nenv: {A: "x\\0y"}\n', None, 3,
                   ["env.A must be a string without a NUL character"]),
    "folder name over 255 bytes": (f"name: x\nentrypoint: {{module: m}}\nrun_dir: runs/{'a' * 256}\n", None, 3,
                                   ["run_dir must be a path whose every folder and file name is at most 255 bytes"]),
    "dots as a name": ("name: ..\nentrypoint: {module: m}\n", None, 1, ["name must be", "not only dots"]),
    "a number as a name": ("name: 123\nentrypoint: {module: m}\n", None, 1,
                           ["name must be", "reads the value written there as the number 123: put it in quotes"]),
    "a list in env": ("name: x\nentrypoint: {module: m}\nenv: {A: [1]}\n", None, 3,
                      ["env.A must be a string or number, got [1]."]),
    "--set under a value": (GOOD, "checkpoint.keep.x=5", None, ["checkpoint.keep takes a value, not keys"]),
    "static rendezvous on two nodes": ("name: x\nentrypoint: {module: m}\nnnodes: 2\nrdzv:\n  backend: static\n"
                                       "  endpoint: h:1\n", None, 5, ["rdzv.backend static", "use backend c10d"]),
    "a duration in rdzv.conf": ("name: x\nentrypoint: {module: m}\nrdzv:\n  conf: {join_timeout: 10m}\n", None, 4,
                                ["rdzv.conf.join_timeout must be a number of seconds", "'10m'"]),
    # Values YAML recognises and cannot build, input without end, and values that validated and failed only
    # inside torchrun (or made it fork a rank per typo'd digit).
    "a date that is no date": ("name: x\nentrypoint: {module: m}\nrun_dir: 2024-13-45\n", None, 3,
                               ["YAML cannot read the value '2024-13-45' (month must be in 1..12)", "quote it"]),
    "an unknown tag": ("name: x\nentrypoint: {module: m}\nenv: {A: !foo 3}\n", None, 3,
                       ["not valid YAML (could not determine a constructor for the tag '!foo')"]),
    "nesting without end": ("name: x\nentrypoint: {module: m}\nenv: " + "[" * 5000 + "]" * 5000 + "\n", None,
                            None, ["nested thousands of levels deep"]),
    "a huge file without aliases": ("name: x\nentrypoint: {module: m}\nenv:\n"
                                    + "".join(f"  V{i}: x\n" for i in range(100_001)), None, None,
                                    ["holds more than 100000 values, where a job file has about a hundred"]),
    "aliases of aliases": ("name: x\nentrypoint: {module: m}\na0: &a0 [x, x, x, x, x, x, x, x, x, x]\n"
                           + "".join(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]\n" for i in range(1, 10)),
                           None, None, ["expands to more than 100000 values"]),
    "a superscript node count": ('name: x\nentrypoint: {module: m}\nnnodes: "²"\n', None, 3, ["nnodes must be"]),
    "a space in the endpoint": ('name: x\nentrypoint: {module: m}\nrdzv: {endpoint: "local host:29400"}\n', None, 3,
                                ["rdzv.endpoint must be HOST:PORT with a host name or IP address"]),
    "a scheme in the endpoint": ('name: x\nentrypoint: {module: m}\nrdzv: {endpoint: "http://h:29400"}\n', None, 3,
                                 ["rdzv.endpoint must be HOST:PORT"]),
    "port 0": ('name: x\nentrypoint: {module: m}\nrdzv: {endpoint: "h:0"}\n', None, 3, ["a port from 1 to 65535"]),
    "an empty label in the endpoint's host": ('name: x\nentrypoint: {module: m}\nrdzv: {endpoint: "n0..c:294"}\n',
                                              None, 3, ["rdzv.endpoint must be HOST:PORT"]),
    "{node} in the run dir": ('name: x\nentrypoint: {module: m}\nrun_dir: "runs/{node}"\n', None, 3,
                              ["run_dir 'runs/{node}' holds {node}, which is filled in only in checkpoint.local_dir"]),
    "a rank count with extra digits": ("name: x\nentrypoint: {module: m}\nnproc_per_node: 80000\n", None, 3,
                                       ["nproc_per_node must be an integer from 1 to 4096"]),
    "a 400-digit timeout": ("name: x\nentrypoint: {module: m}\nheartbeat: {timeout_s: " + "9" * 400 + "}\n", None, 3,
                            ["heartbeat.timeout_s must be a duration", "…"]),
    "a lone surrogate in a path": ('name: x\nentrypoint: {module: m}\nrun_dir: "\\ud800"\n', None, 3,
                                   ["run_dir must be a path of valid text"]),
    "a path longer than Linux takes": ("name: x\nentrypoint: {module: m}\nrun_dir: " + "/".join(["a" * 200] * 30)
                                       + "\n", None, 3, ["run_dir must be a path shorter than 4096 bytes"]),
    "a join timeout of nan": ("name: x\nentrypoint: {module: m}\nrdzv:\n  conf: {join_timeout: .nan}\n", None, 4,
                              ["rdzv.conf.join_timeout must be a number of seconds > 0"]),
    "a folder as the script": ("name: x\nentrypoint:\n  script: .\n", None, 3, ["is a folder, not a Python file"]),
    "a count with a leading zero (octal to YAML 1.1)": ("name: x\nentrypoint: {module: m}\ncheckpoint: {keep: 010}\n",
                                                        None, 3, ["YAML 1.1 reads 010 as an octal number, 8", "quote"]),
    "a timeout in hours:minutes:seconds": ("name: x\nentrypoint: {module: m}\nheartbeat:\n  timeout_s: 1:30:00\n",
                                           None, 4, ["reads 1:30:00 as a base-60 number, 5400"]),
    "an argument that YAML reads as base 60": ("name: x\nentrypoint:\n  module: m\n  args: [--time, 1:30:00]\n", None,
                                               4, ["base-60", "quote it to keep it as text"]),
    "--set with an octal-looking count": (GOOD, "checkpoint.keep=010", None, ["--set checkpoint.keep=010: YAML 1.1"]),
    "--set that refers to itself": (GOOD, "name=&a [*a]", None, ["--set name=&a [*a]: the value refers to itself"]),
    "--set with a date that is no date": (GOOD, "name=2024-13-45", None, ["YAML cannot read it; quote it"]),
    # Audit 15: accepted, then every attempt failed (the collective's connect timed out in 0 ms) or was a hang
    "a collective timeout of no time": ("name: x\nentrypoint: {module: m}\ncollective_timeout_s: 1e-30\n", None, 3,
                                        ["collective_timeout_s must be a duration of at least 1s"]),
    "a heartbeat interval of no time": ("name: x\nentrypoint: {module: m}\nheartbeat: {interval_s: 0.0001}\n", None,
                                        3, ["heartbeat.interval_s must be a duration of at least 0.01s"]),
    "a shell variable in a path": ("name: x\nentrypoint: {module: m}\nrun_dir: $HOME/rd\n", None, 3,
                                   ["run_dir must be a path written out: resilient does not expand $HOME (only a "
                                    "leading ~)"]),
    # Audit 15: a traceback from the launch (env), or three launches and a crash loop (args)
    "an env value with a lone surrogate": ('name: x\nentrypoint: {module: m}\nenv: {A: "\\ud800"}\n', None, 3,
                                           ["env.A must be a string of valid text"]),
    "an argument with a lone surrogate": ('name: x\nentrypoint:\n  module: m\n  args: ["\\ud800"]\n', None, 4,
                                          ["entrypoint.args must be a string of valid text"]),
    # Review 13: "$" matched before a final newline, so a block scalar's name made a run dir with a newline in it
    "a name that ends in a newline": ("name: |\n  x\nentrypoint: {module: m}\n", None, 1,
                                      ["1 to 100 ASCII letters, digits, '.', '_' or '-'"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_job_files_exit_2_with_one_line_naming_line_and_key(case, tmp_path, cli):
    text, override, line, words = BAD[case]
    path = write(tmp_path, text)
    args = ["run", path] + (["--set", override] if override else [])
    result = cli(*args)
    assert result.exit_code == 2, result.output
    msg = result.stderr.strip()
    assert len(msg.splitlines()) == 1, msg
    assert "Traceback" not in result.output
    if line is not None:
        assert f"job.yaml:{line}:" in msg, msg
    for w in words:
        assert w in msg, msg
    assert not (tmp_path / "runs").exists(), "a bad job file must create nothing"


def test_a_path_through_a_loop_of_links_is_one_sentence_for_every_command(tmp_path, cli):
    """Review 9: Python 3.11's Path.resolve raises RuntimeError on a link loop, which every command given the job
    file ended in as a traceback."""
    (tmp_path / "loop").symlink_to("loop")
    path = write(tmp_path, "name: x\nentrypoint: {module: m}\nrun_dir: loop/run\n")
    for command in (("run",), ("status",), ("gc", "--keep", "1")):
        result = cli(command[0], path, *command[1:])
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert "job.yaml:3: run_dir 'loop/run' leads through a loop of symbolic links" in result.stderr, result.output


def test_a_job_file_that_is_no_text_file_is_one_sentence_and_never_waited_on(tmp_path, cli):
    """A FIFO as the job file waited forever for a writer; bytes that are not UTF-8 gave no line and no fix; a
    folder (a run dir given as the job, to resume it) was a traceback."""
    import os

    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "latin1.yaml").write_bytes(b"name: x\nentrypoint: {module: m}\nenv: {A: caf\xe9}\n")
    (tmp_path / "folder.yaml").mkdir()
    for name, words in (("fifo.yaml", "is not a regular file (a FIFO or a socket)"),
                        ("folder.yaml", "is a folder, not a job file; pass the .yaml file"),
                        ("latin1.yaml", "latin1.yaml:3: the job file is not UTF-8 text (byte 0xe9); save it as UTF-8")):
        result = cli("run", tmp_path / name)
        assert result.exit_code == 2 and words in result.stderr and len(result.stderr.splitlines()) == 1, result.output
    assert not (tmp_path / "runs").exists()


def test_values_yaml_1_1_leaves_as_text_and_ipv6_endpoints_are_read(tmp_path):
    job = load_job(write(tmp_path, GOOD), ["heartbeat.stall_factor=1e1", "nnodes=2", 'rdzv.endpoint="[::1]:29400"'])
    assert job.heartbeat.stall_factor == 10.0 and job.rdzv.endpoint == "[::1]:29400"


def test_missing_job_file_is_a_usage_error(tmp_path, cli):
    result = cli("run", tmp_path / "nope.yaml")
    assert result.exit_code == 2 and "no such job file" in result.stderr


def test_config_errors_are_config_errors(tmp_path):
    with pytest.raises(ConfigError):
        load_job(write(tmp_path, "name: x\n"))


@pytest.mark.parametrize("key", ["checkpoint.dir", "checkpoint.local_dir"])
def test_a_checkpoint_root_the_filesystem_refuses_is_one_sentence_and_nothing_is_launched(tmp_path, cli, key):
    """/sys passes access() for root and refuses mkdir: the claim on the root once failed in a traceback, and a
    local tier refused so left the run dir's lock and the durable root's claim behind in a new run dir."""
    if not Path("/sys/kernel").is_dir():
        pytest.skip("no sysfs here")
    result = cli("run", write(tmp_path, GOOD), "--set", f"{key}=/sys/resilient-test-ckpt")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "/sys/resilient-test-ckpt: " in result.stderr and "nothing was launched" in result.stderr, result.stderr
    assert f"Point {key} at a writable folder." in result.stderr, result.stderr
    assert not (tmp_path / "runs").exists()


def test_a_local_tier_that_a_node_name_brings_onto_the_durable_root_is_refused_before_anything_runs(tmp_path, cli):
    """The job file's check sees `{node}` unfilled; the node's name can still make the two one folder, where gc
    and retention would delete by two rules."""
    shared = tmp_path / "shared"
    sets = ("--set", f"checkpoint.local_dir={shared}/{{node}}", "--set", f"checkpoint.dir={shared}/n1",
            "--set", "nnodes=2", "--set", "rdzv.endpoint=127.0.0.1:29999")
    result = cli("run", write(tmp_path, GOOD), *sets, "--node", "n1")
    assert result.exit_code == 2 and "not apart from checkpoint.dir" in result.stderr, result.output
    assert "on node 'n1'" in result.stderr and "Traceback" not in result.output
    assert result.stderr.startswith(f"resilient: --set checkpoint.local_dir={shared}/{{node}}: "), result.stderr
    assert not shared.exists() and not (tmp_path / "runs").exists()


def test_a_current_folder_that_shadows_resilient_or_is_gone_is_refused_before_anything_runs(tmp_path, cli,
                                                                                            monkeypatch):
    """Every helper and rank starts in the current folder with `python -m`, which imports from it first."""
    job = write(tmp_path, GOOD)
    for shadow in ("supervisor.py", "train_entry"):
        where = tmp_path / f"cwd-{shadow}"
        where.mkdir()
        (where / shadow).mkdir() if "." not in shadow else (where / shadow).write_text("print('mine')\n")
        monkeypatch.chdir(where)
        result = cli("run", job, "--run-dir", tmp_path / "run")
        assert result.exit_code == 2 and f"{where / shadow} shadows resilient's own" in result.stderr, result.output
    monkeypatch.chdir(tmp_path)  # audit 6: a job's PYTHONPATH shadowing it launched, and every attempt failed
    path = f"env.PYTHONPATH=/nowhere:{tmp_path}/cwd-supervisor.py"
    result = cli("run", job, "--run-dir", tmp_path / "run", "--set", path)
    assert result.exit_code == 2 and "supervisor.py shadows resilient's own `supervisor` package: PYTHONPATH's" \
        in result.stderr and "(from the job)" in result.stderr, result.output
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    result = cli("run", job, "--run-dir", tmp_path / "run")
    assert result.exit_code == 2 and "the current folder cannot be read" in result.stderr, result.output
    assert not (tmp_path / "run").exists()


def test_a_single_node_job_under_a_node_name_is_refused_while_another_supervisor_holds_the_run_dir(tmp_path, cli,
                                                                                                    monkeypatch):
    """--node (or an exported RESILIENT_NODE) gave a single-node job a folder of its own under nodes/: a second
    supervisor on a live run dir then trained a second job into the same checkpoints instead of exiting 3."""
    from supervisor.lock import RunLock

    run_dir = tmp_path / "run"
    with RunLock(run_dir):  # a live supervisor of this run dir, started without a node name
        result = cli("run", write(tmp_path, GOOD), "--run-dir", run_dir, "--node", "x")
        assert result.exit_code == 3 and "held by another live supervisor" in result.stderr, result.output
        monkeypatch.setenv("RESILIENT_NODE", "y")
        result = cli("run", write(tmp_path, GOOD), "--run-dir", run_dir)
        assert result.exit_code == 3 and "held by another live supervisor" in result.stderr, result.output
    assert not (run_dir / "nodes").exists()


@pytest.mark.parametrize(("sig", "code"), [("SIGTERM", 143), ("SIGINT", 130)])
def test_rdzv_store_stopped_by_a_signal_exits_as_the_exit_code_table_says(tmp_path, sig, code):
    """SIGTERM gave 0, as if the store had done its work, where the table says 143."""
    import signal

    from tests.proc import free_port, started, wait_for
    from tests.runs import resilient

    with started(resilient("rdzv-store", "--host", "127.0.0.1", "--port", free_port()), tmp_path,
                 log=tmp_path / "store.log") as store:
        wait_for(lambda: "listening" in store.output(), 60, "the store")
        store.signal(getattr(signal, sig))
        assert store.wait(30) == code, store.output()


def test_a_node_name_another_live_supervisor_holds_is_refused_with_the_node_named_as_the_fix(tmp_path, cli):
    """Audit 18: the hint said to pick another --run-dir, where another --node is what the user means."""
    from supervisor.lock import RunLock

    job = tmp_path / "mn.yaml"
    job.write_text(GOOD + 'nnodes: "1:2"\nrdzv: {endpoint: "127.0.0.1:29999"}\n')
    run_dir = tmp_path / "run"
    with RunLock(run_dir / "nodes" / "a"):
        result = cli("run", job, "--run-dir", run_dir, "--node", "a")
    assert result.exit_code == 3 and "held by another live supervisor" in result.stderr, result.output
    assert result.stderr.rstrip().endswith("stop it first, or pick another --node."), result.stderr
