"""The reaper's policy file read strictly (a review found a mistyped policy that turned a kill rule
on, or left a process the admin meant to protect unprotected, with no error): every key checked
for its name, type and range, and a bad one is a one-line error that names it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyalloc.gpumemd import reaper

from .conftest import gpumemd

GOOD = """\
grace_period = "5s"
cpu_sample = 0.5
audit_log = "/tmp/audit.jsonl"
subreapers = ["systemd", "tini"]
[idle]
enabled = true
window = "1s"
min_bytes = "1MiB"
cpu_percent = 2.5
[orphan]
enabled = false
[zombie]
signal_parent = "SIGCHLD"
[protect]
min_uid = 0
pids = [4242]
users = ["root", 1001]
commands = ["jupyter.*"]
allow_other_users = ["alice"]
"""


def _load(tmp_path: Path, text: str) -> reaper.Policy:
    path = tmp_path / "policy.toml"
    path.write_text(text)
    return reaper.Policy.load(path)


def test_a_good_policy_reads_as_written(tmp_path: Path) -> None:
    p = _load(tmp_path, GOOD)
    assert (p.idle.enabled, p.idle.window_s, p.idle.min_bytes, p.idle.cpu_percent) == (True, 1.0, 1 << 20, 2.5)
    assert not p.orphan.enabled and p.zombie.signal_parent == "SIGCHLD"
    assert (p.grace_s, p.cpu_sample_s, p.audit_log, p.subreapers) == (5.0, 0.5, "/tmp/audit.jsonl", ["systemd", "tini"])
    assert (p.min_uid, p.protected_pids, p.protected_users, p.protected_commands) == (0, [4242], ["root", "1001"],
                                                                                        ["jupyter.*"])
    assert p.other_users == ["alice"] and not p.allow_other_users


@pytest.mark.parametrize("text, named", [
    ('[idle]\nenabled = "false"\n', "idle.enabled must be true or false"),  # was: bool("false") is True
    ("[orphan]\nenabled = 0\n", "orphan.enabled must be true or false"),
    ('[protect]\ncommand = ["holder"]\n', "unknown key protect.command"),  # was: ignored
    ('[protect]\nusers = "root"\n', "protect.users must be a list"),  # was: read as "r", "o", "o", "t"
    ('[protect]\ncommands = "holder"\n', "protect.commands must be a list"),
    ("[protect]\npids = 5\n", "protect.pids must be a list"),
    ("[protect]\npids = [-3]\n", "protect.pids: -3 is not a process id"),
    ('[protect]\nmin_uid = "abc"\n', "protect.min_uid must be a whole number"),
    ('[protect]\ncommands = ["(unclosed"]\n', "protect.commands: '(unclosed' is not a regular expression"),
    ("orphan = 3\n", "orphan must be a table"),
    ("protect = [1]\n", "protect must be a table"),
    ("audit_log = 5\n", "audit_log must be a path"),
    ('subreapers = "systemd"\n', "subreapers must be a list"),
    ("[idle]\nmin_bytes = -5\n", "idle.min_bytes must be a size >= 0"),
    ('[idle]\nmin_bytes = "lots"\n', "idle.min_bytes:"),
    ("[idle]\ncpu_percent = -1\n", "idle.cpu_percent must be a number from 0 to 100"),
    ('[idle]\ncpu_percent = "high"\n', "idle.cpu_percent must be a number"),
    ('[idle]\nwindow = "soon"\n', "idle.window: not a duration"),
    ("[idle]\nwindow = -2\n", "idle.window must be a duration >= 0"),
    ('[idle]\nenabeld = true\n', "unknown key idle.enabeld"),
    ('grace = "1s"\n', "unknown key grace"),
    ('[stale_heartbeat]\naction = "nuke"\n', "stale_heartbeat.action must be kill or report"),
])
def test_a_bad_policy_value_is_an_error_naming_its_key(tmp_path: Path, text: str, named: str) -> None:
    with pytest.raises(ValueError, match="policy .*policy.toml: ") as caught:
        _load(tmp_path, text)
    assert named in str(caught.value), caught.value


def test_reap_with_a_mistyped_policy_stops_with_one_line_and_decides_nothing(tmp_path: Path, reg_dir: Path) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text('[idle]\nenabled = "false"\nwindow = "1s"\nmin_bytes = "1MiB"\n[protect]\nmin_uid = 0\n')
    audit = tmp_path / "audit.jsonl"
    out = gpumemd("reap", "--policy", str(policy), "--audit-log", str(audit), "--no-nvml", reg=reg_dir)
    assert out.returncode != 0 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "idle.enabled must be true or false" in out.stderr, out.stderr
    assert not audit.exists() or audit.read_text() == ""


def test_a_policy_duration_that_is_infinite_or_past_a_year_is_refused(tmp_path) -> None:
    """cpu_sample = inf made `reap` end in an OverflowError traceback (a review's finding)."""
    from pyalloc.gpumemd import reaper

    for text in ("cpu_sample = inf\n", 'cpu_sample = "400d"\n', '[idle]\nwindow = "١s"\n'):
        path = tmp_path / "p.toml"
        path.write_text(text)
        with pytest.raises(ValueError, match="duration"):
            reaper.Policy.load(str(path))
