"""Issue 24 item 8: limits a configuration could blow past, and trace files that made the CLI
print a traceback. Each gets one line naming the problem, and nothing half-applied."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import pyalloc
from pyalloc.pytorch.run import STATS_ENV
from allocator_fixture import fresh_conf


@pytest.mark.parametrize(("conf", "message"), [
    ("devices=64,trace=16777216", "needs 49152 MiB of trace rings; at most 1024 MiB"),
    ("capacity=1", "capacity 1 bytes is less than one 2 MiB granule"),
    ("capacity=1MiB", "less than one 2 MiB granule"),
])
def test_a_configuration_that_cannot_work_is_refused_and_nothing_changes(conf: str, message: str) -> None:
    pyalloc.configure(fresh_conf("host"))
    before = pyalloc.config()
    with pytest.raises(pyalloc.PyallocError, match=message):
        pyalloc.configure(conf)
    assert pyalloc.config() == before


def test_configure_changes_only_the_keys_it_names() -> None:
    # Issue 24 item 8 saw `devices` carried over from an earlier call: that is the contract for
    # every key (README, Configuration), and config() shows what is in force.
    pyalloc.configure(fresh_conf("host", "devices=2,trace=100"))
    pyalloc.configure("max_cached=1MiB")
    settings = pyalloc.config()
    assert (settings["devices"], settings["trace"], settings["max_cached"]) == (2, 100, 1 << 20)
    assert pyalloc.device_count() == 2
    pyalloc.configure(fresh_conf("host"))  # fresh_conf names every layout key again
    assert pyalloc.device_count() == 1


def test_a_bad_configure_string_is_named_as_such_not_as_pyalloc_conf(monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 24 item 8: with no PYALLOC_CONF set, an error blamed it.
    monkeypatch.delenv("PYALLOC_CONF", raising=False)
    pyalloc.configure(fresh_conf("host"))
    with pytest.raises(pyalloc.PyallocError, match="^pyalloc_configure: bad value 'lots' for capacity"):
        pyalloc.configure("capacity=lots")


def test_one_device_may_still_keep_the_largest_trace() -> None:
    pyalloc.configure(fresh_conf("host", "devices=1,trace=16777216"))
    assert pyalloc.config()["trace"] == 16777216
    pyalloc.configure(fresh_conf("host"))


BAD_TRACES = {
    "empty.jsonl": b"",
    "junk.jsonl": b"not json\n",
    "array.jsonl": b"[1, 2]\n",
    "v2.jsonl": b'{"version": 2}\n',
    "free_of_nothing.jsonl": b'{"version": 1}\n{"op": "free", "id": 3}\n',
    "negative.jsonl": b'{"version": 1}\n{"op": "alloc", "id": 1, "size": -5}\n',
    "size_2_64.jsonl": b'{"version": 1}\n{"op": "alloc", "id": 1, "size": 18446744073709551616}\n',
    "nested.jsonl": b"[" * 100000 + b"\n",
    "broken.jsonl.gz": b"\x1f\x8bgarbage",
    "too_big_here.jsonl": b'{"version": 1}\n{"op": "alloc", "id": 1, "size": 1099511627776000}\n',
    # the header's fields checked as TRACE_FORMAT.md defines them (a review saw these accepted,
    # the bad capacities silently replaced by 80 GiB)
    "version_true.jsonl": b'{"version": true}\n',
    "negative_capacity.jsonl": b'{"version": 1, "device_capacity": -5}\n',
    "text_capacity.jsonl": b'{"version": 1, "device_capacity": "80GiB"}\n',
    "float_capacity.jsonl": b'{"version": 1, "device_capacity": 1.5}\n',
    "number_source.jsonl": b'{"version": 1, "source": 7}\n',
}


@pytest.mark.parametrize("command", ["replay", "selftest"])
def test_bad_trace_files_are_one_line_errors(tmp_path: Path, command: str) -> None:
    for name, data in BAD_TRACES.items():
        if command == "replay" and name == "too_big_here.jsonl":
            continue  # the sim backend replays any size: nothing wrong with it there
        path = tmp_path / name
        path.write_bytes(data)
        done = subprocess.run([sys.executable, "-m", "pyalloc.cli", command, str(path)], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 1, (name, done.stdout, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in done.stderr, (name, done.stderr)
        assert str(path) in lines[0], (name, lines[0])


def test_the_selftest_table_lines_up_whatever_the_workload_names() -> None:
    # Issue 23 item 7: names longer than 10 characters pushed their rows out of line.
    from pyalloc.traces.trace import workloads_dir

    workloads = workloads_dir()
    paths = [str(workloads / "mlp.jsonl.gz"), str(workloads / "transformer_lm.jsonl.gz")]
    result = subprocess.run([sys.executable, "-m", "pyalloc.cli", "selftest", *paths],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    table = result.stdout.splitlines()[:3]
    assert table[0].startswith("workload") and table[1].startswith("mlp ") and table[2].startswith("transformer_lm ")
    assert len({len(line) for line in table}) == 1, table
    for column in ("ops", "time"):  # right-aligned: every line ends each column at the same place
        end = table[0].index(column) + len(column)
        assert all(line[end - 1] != " " and (end == len(line) or line[end] == " ") for line in table), table


@pytest.mark.parametrize(("args", "message"), [
    # keys the replay sets itself, or that define the policy: they ran something other than what
    # the report named (a review saw a minimum capacity below the peak of live bytes, a host run
    # labelled sim, arenas labelled "plain segments only")
    (["--conf", "capacity=1GiB", "--find-min-capacity"], "--conf capacity=1GiB: the replay sets capacity itself"),
    (["--conf", "backend=host"], "--conf backend=host: the replay sets backend itself (use --backend)"),
    (["--policy", "pyalloc-plain", "--conf", "vmm=on"], "policy pyalloc-plain is defined by vmm=off"),
    (["--policy", "native", "--conf", "share=0"], "--conf applies to the pyalloc policies only"),
])
def test_replay_refuses_conf_keys_that_would_change_what_it_reports(args: list[str], message: str) -> None:
    from pyalloc.traces.trace import workloads_dir

    done = subprocess.run([sys.executable, "-m", "pyalloc.cli", "replay", str(workloads_dir() / "mlp.jsonl.gz"),
                           *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == "", (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr


def test_replay_labels_a_run_with_extra_conf_keys(tmp_path: Path) -> None:
    import json

    from pyalloc.traces.trace import workloads_dir

    path = str(workloads_dir() / "mlp.jsonl.gz")
    done = subprocess.run([sys.executable, "-m", "pyalloc.cli", "replay", path, "--conf", "move=0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and ", with --conf move=0" in done.stdout.splitlines()[0], done.stdout
    done = subprocess.run([sys.executable, "-m", "pyalloc.cli", "replay", path, "--conf", "move=0", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert json.loads(done.stdout)["conf"] == "move=0"


@pytest.mark.parametrize("size", [9223372036854775807, 32 << 40])
def test_a_minimum_capacity_search_for_more_than_any_device_says_so(size: int, tmp_path: Path) -> None:
    path = tmp_path / "huge.jsonl"
    path.write_text(f'{{"version": 1}}\n{{"op": "alloc", "id": 1, "size": {size}}}\n')
    done = subprocess.run([sys.executable, "-m", "pyalloc.cli", "replay", str(path), "--find-min-capacity"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert f"{size:,} bytes live at once, more than the largest device the backends model (1 TiB)" in done.stderr, \
        done.stderr


@pytest.mark.parametrize("header, flags, said", [
    ('{"version": 1, "device_capacity": 2199023255552}', [],
     "the header's device_capacity of 2,199,023,255,552 bytes is more than the largest device the backends model"),
    ('{"version": 1}', ["--capacity", "2TiB"], "--capacity 2TiB: at most 1 TiB"),
    ('{"version": 1, "device_capacity": 1024}', [],
     "the header's device_capacity of 1,024 bytes is less than one 2 MiB granule"),
])
def test_a_capacity_outside_what_the_backends_model_is_one_line_naming_it(
        header: str, flags: list[str], said: str, tmp_path: Path) -> None:
    """It failed inside the library, naming a capacity in bytes that the user never gave."""
    path = tmp_path / "t.jsonl"
    path.write_text(header + '\n{"op": "alloc", "id": 1, "size": 4096}\n')
    done = subprocess.run([sys.executable, "-m", "pyalloc.cli", "replay", str(path), *flags],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode in (1, 2) and done.stderr.count("\n") == 1 and said in done.stderr, done.stderr
    assert "pyalloc_configure" not in done.stderr


def test_a_closed_pipe_ends_the_command_quietly() -> None:
    # `pyalloc config | head -1` printed a BrokenPipeError traceback, `pyalloc stress | head -1`
    # an error line (a review's finding): a shell tool stops quietly when its reader goes away.
    for command in (["config"], ["stress", "--quick", "--workloads", "mlp", "--policies", "pyalloc", "--no-progress"]):
        script = f"{sys.executable} -m pyalloc.cli {' '.join(command)} | head -c 1 > /dev/null; exit ${{PIPESTATUS[0]}}"
        # backend=host: without a GPU driver the cuda default adds its one-line notice on stderr.
        env = {**os.environ, "PYALLOC_CONF": "backend=host"}
        done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300, env=env)
        assert done.stderr == "", (command, done.stderr)
        assert done.returncode in (0, 141), (command, done.returncode)


def test_stress_refuses_a_plot_name_it_cannot_write_before_it_runs(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pyalloc.cli", "stress", "--quick", "--workloads", "mlp",
                           "--out", str(tmp_path / "out"), "--plot", str(tmp_path / "plot.txt")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "plot.txt: not an image file name" in done.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize(("snapshot", "args", "message"), [
    ({"device_traces": [None]}, [], "device 0's trace is not a list"),
    ({"device_traces": [[]]}, ["--snapshot-device", "-1"], "the snapshot has no device -1 (devices 0 to 0)"),
])
def test_a_snapshot_that_is_not_one_or_a_device_it_lacks_is_one_line(
        tmp_path: Path, snapshot: dict[str, object], args: list[str], message: str) -> None:
    import pickle

    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    for command in (["replay", str(path)], ["record", "--from-snapshot", str(path), "-o", str(tmp_path / "t.jsonl")]):
        if args and command[0] == "replay":
            continue  # replay reads device 0
        done = subprocess.run([sys.executable, "-m", "pyalloc.cli", *command, *args], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 1 and done.stderr.count("\n") == 1 and message in done.stderr, (command, done.stderr)
        assert not (tmp_path / "t.jsonl").exists()


def test_python_calls_with_the_wrong_kind_of_argument_say_so() -> None:
    # A review saw "size 18446744073709551615 is beyond any device" for -1, and AttributeErrors.
    with pytest.raises(pyalloc.PyallocError, match="size -1 is negative"):
        pyalloc.malloc(-1)
    with pytest.raises(TypeError, match="configure\\(\\) takes a PYALLOC_CONF string"):
        pyalloc.configure(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a pool is named by a string"), pyalloc.pool(None):  # type: ignore[arg-type]
        pass


def test_sizes_take_ascii_digits_only_as_pyalloc_conf_does() -> None:
    from pyalloc.sizes import parse_size

    assert parse_size("12GiB") == 12 << 30
    with pytest.raises(ValueError, match="bad size"):
        parse_size("\u0661\u0662GiB")  # Arabic-Indic digits: Python's \\d took them, the C parser does not


def test_a_fifo_or_a_device_given_as_a_trace_is_named_as_such(tmp_path: Path) -> None:
    # it was "no such file", for a path that exists
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/null")):
        for command in (["replay", str(path)], ["record", "--from-snapshot", str(path), "-o", str(tmp_path / "t")]):
            done = subprocess.run([sys.executable, "-m", "pyalloc.cli", *command], capture_output=True,
                                  text=True, timeout=120)
            assert done.returncode == 1 and done.stderr.strip().endswith(f"{path}: is not a regular file"), \
                (command, done.stderr)
            assert not (tmp_path / "t").exists()


def test_a_folder_given_as_a_trace_or_an_output_is_named_as_such(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pyalloc.cli", "replay", str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and f"{tmp_path}: is a folder, not a trace file" in done.stderr, done.stderr
    import pickle

    snapshot = tmp_path / "snapshot.pickle"
    snapshot.write_bytes(pickle.dumps({"device_traces": [[]]}))
    done = subprocess.run([sys.executable, "-m", "pyalloc.cli", "record", "--from-snapshot", str(snapshot),
                           "-o", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "-o names a folder, not a file" in done.stderr, done.stderr


def test_selftest_takes_a_snapshot_as_replay_does(tmp_path: Path) -> None:
    import pickle

    snapshot = tmp_path / "snapshot.pickle"
    entries = [{"action": "alloc", "addr": 4096 * (i + 1), "size": 1 << 20} for i in range(3)]
    entries += [{"action": "free_completed", "addr": 4096 * (i + 1)} for i in range(3)]
    snapshot.write_bytes(pickle.dumps({"device_traces": [entries]}))
    done = subprocess.run([sys.executable, "-m", "pyalloc.cli", "selftest", str(snapshot)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "selftest passed: 6 operations replayed" in done.stdout, done.stdout


def test_a_trace_is_never_written_over_a_fifo_a_device_or_standard_output(tmp_path: Path) -> None:
    """record -o replaced whatever was at the path with a new file: a FIFO, a device node (as root,
    -o /dev/null would have replaced it), and -o - wrote a file named '-' (a review's finding).
    Refused before recording; a symbolic link is replaced, never followed (another user's link in
    /tmp would have had root's write land where it points: a second review's finding)."""
    import pickle

    snapshot = tmp_path / "snapshot.pickle"
    snapshot.write_bytes(pickle.dumps({"device_traces": [[{"action": "alloc", "addr": 4096, "size": 512,
                                                           "stream": 0}]]}))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def record(output: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pyalloc.cli", "record", "--from-snapshot", str(snapshot),
                               "-o", output], capture_output=True, text=True, timeout=120, cwd=tmp_path)

    for output, message in ((str(fifo), "exists and is not a regular file"), ("/dev/null", "not a regular file"),
                            ("-", "a trace goes to a file, not to standard output")):
        done = record(output)
        assert done.returncode == 1 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert fifo.is_fifo() and not (tmp_path / "-").exists()
    target = tmp_path / "target.jsonl"
    target.write_text("old")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    done = record(str(link))
    assert done.returncode == 0, done.stderr
    assert not link.is_symlink() and link.read_text().startswith('{"version": 1') and target.read_text() == "old"


def test_corrupt_gzip_and_snapshot_values_that_no_trace_holds_are_one_line(tmp_path: Path) -> None:
    """A gzip trace corrupt mid-stream raised zlib.error; a corrupt pickle MemoryError or
    AttributeError; a snapshot's True size or 2^70 stream was written into the trace as is, which
    the replay then refused (a review's findings)."""
    import pickle

    from pyalloc.traces.trace import workloads_dir

    data = bytearray((workloads_dir() / "mlp.jsonl.gz").read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 64):  # mid-stream: zlib's error, not gzip's
        data[i] ^= 0x5A
    corrupt = tmp_path / "corrupt.jsonl.gz"
    corrupt.write_bytes(bytes(data))
    cases = [(corrupt, "cannot read the file")]
    for name, entry, message in (
            ("bool", {"action": "alloc", "addr": 4096, "size": True}, "'size' must be an integer, got True"),
            ("huge", {"action": "alloc", "addr": 4096, "size": 512, "stream": 1 << 70}, "'stream' 1180591620717411303424 does not fit in a signed 64-bit integer")):
        path = tmp_path / f"{name}.pickle"
        path.write_bytes(pickle.dumps({"device_traces": [[entry]]}))
        cases.append((path, message))
    garbage = tmp_path / "garbage.pickle"
    garbage.write_bytes(pickle.dumps({"device_traces": [[]]})[:3] + b"\xff" * 40)
    cases.append((garbage, "cannot read the snapshot pickle"))
    for path, message in cases:
        for args in (["replay", str(path)], ["record", "--from-snapshot", str(path), "-o", str(tmp_path / "o.jsonl")]):
            if args[0] == "record" and path.suffix == ".gz":
                continue
            done = subprocess.run([sys.executable, "-m", "pyalloc.cli", *args], capture_output=True, text=True,
                                  timeout=120)
            assert done.returncode == 1 and done.stderr.count("\n") == 1 and message in done.stderr, (args, done.stderr)
    assert not (tmp_path / "o.jsonl").exists()


def test_output_to_a_full_disk_is_one_line() -> None:
    """`pyalloc config > /dev/full` ended in an OSError traceback (a review's finding)."""
    env = {**os.environ, "PYALLOC_CONF": "backend=host"}
    for command in ("config", "config --json"):
        done = subprocess.run(["bash", "-c", f"{sys.executable} -m pyalloc.cli {command} > /dev/full"],
                              capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 1 and done.stderr == "pyalloc: error: cannot write the output: No space left on device\n", \
            done.stderr


def test_an_offload_stats_path_that_cannot_be_written_is_refused_before_the_program_runs(tmp_path: Path) -> None:
    """run --offload-stats DIR trained, then warned at exit and left a temporary file beside the
    folder (a review's finding): the path is checked before the program starts."""
    env = {**os.environ, "PYALLOC_CONF": "backend=host"}
    for path, message in ((str(tmp_path), "names a folder, not a file"),
                          ("/proc/stats.json", "cannot write in /proc"),
                          (str(tmp_path / "missing" / "s.json"), "missing is not a folder")):
        done = subprocess.run([sys.executable, "-m", "pyalloc.cli", "run", "--offload=1MiB", "--offload-stats", path,
                               "--", sys.executable, "-c", "print('ran')"], capture_output=True, text=True,
                              timeout=120, env=env)
        assert done.returncode == 2 and "ran" not in done.stdout, (done.stdout, done.stderr)
        assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []
    env[STATS_ENV] = "/proc/stats.json"  # the same, named by the environment instead (it ran, then warned)
    done = subprocess.run([sys.executable, "-m", "pyalloc.cli", "run", "--offload=1MiB", "--", sys.executable, "-c",
                           "print('ran')"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and "ran" not in done.stdout, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and "$PYALLOC_OFFLOAD_STATS /proc/stats.json: cannot write" in done.stderr


@pytest.mark.parametrize("command", [["replay", "mlp"], ["selftest"],
                                     ["stress", "--quick", "--workloads", "mlp", "--policies", "pyalloc", "--no-progress"],
                                     ["doctor", "--pyalloc", "--", sys.executable, "-c", "print('ran')"]])
def test_replays_refuse_a_bad_pyalloc_conf_as_every_command_does(command: list[str]) -> None:
    from pyalloc.traces.trace import workloads_dir

    args = [str(workloads_dir() / "mlp.jsonl.gz") if a == "mlp" and command[0] == "replay" else a for a in command]
    done = subprocess.run([sys.executable, "-m", "pyalloc.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYALLOC_CONF": "vmm=maybe"})
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert "$PYALLOC_CONF: bad value 'maybe' for vmm" in done.stderr


@pytest.mark.parametrize("policy", ["pyalloc", "native"])
@pytest.mark.parametrize("capacity", ["0", "0B", "1"])
def test_a_replay_capacity_below_one_granule_is_refused_for_every_policy(policy: str, capacity: str) -> None:
    """--capacity 0 ran at the default capacity; the native models ran at 1 byte (a review's finding)."""
    from pyalloc.traces.trace import workloads_dir

    done = subprocess.run([sys.executable, "-m", "pyalloc.cli", "replay", str(workloads_dir() / "mlp.jsonl.gz"),
                           "--policy", policy, f"--capacity={capacity}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "at least one 2 MiB granule" in done.stderr, done.stderr


def test_stress_refuses_report_paths_it_cannot_write_before_it_runs(tmp_path: Path) -> None:
    for flag, path, said in (("--json", "/proc/x.json", "cannot write in /proc"),
                             ("--plot", "/proc/x.png", "cannot write in /proc"),
                             ("--out", "/proc/r", "cannot write in /proc"),
                             ("--json", str(tmp_path), "is a folder, not a file")):  # (it ran the suite first)
        done = subprocess.run([sys.executable, "-m", "pyalloc.cli", "stress", "--quick", "--workloads", "mlp",
                               "--policies", "pyalloc", "--no-progress", flag, path], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 1 and done.stdout == "" and said in done.stderr, done.stderr


_METADATA_OOM = """
import resource, pyalloc
pyalloc.configure("backend=sim,capacity=1TiB,oom_report=0,registry=0")
pyalloc.memory_stats()  # the library loaded, the device made, no arena yet
with open("/proc/self/statm") as f:
    vm = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (vm + (32 << 20), resource.RLIM_INFINITY))  # < the arena's ~128 MiB
try:
    pyalloc.malloc(1 << 20)
    print("allocated")
except pyalloc.PyallocError as e:
    print(e)
pyalloc.check()
s = pyalloc.memory_stats()
print(s["segment.all.current"], s["reserved_bytes.all.current"])
"""


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/statm and RLIMIT_AS")
def test_host_memory_running_out_for_an_arenas_metadata_leaves_the_device_as_it_was() -> None:
    # the arena was filed before its per-granule metadata was made: a bad_alloc there left a
    # segment of no granules, and pyalloc_check failed (I9) after only valid calls
    done = subprocess.run([sys.executable, "-c", _METADATA_OOM], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["pyalloc: out of host memory for allocator metadata", "0 0"], done.stdout
