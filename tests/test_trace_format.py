"""The trace reader rejects each kind of bad line with its line number and reason."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from pyalloc.traces.trace import ALLOC, FREE, MARK, TraceError, load, parse_lines, workloads_dir

HEADER = '{"version": 1, "source": "hand-built"}'


def test_a_valid_trace_is_read_with_marks_streams_and_peak() -> None:
    trace = parse_lines([
        HEADER,
        '{"op": "alloc", "id": 1, "size": 100, "stream": 3, "t": 1}',
        '{"op": "alloc", "id": 2, "size": 50}',
        '{"op": "mark", "name": "iteration"}',
        '{"op": "free", "id": 1, "stream": 3, "extra": "ignored"}',
        '{"op": "alloc", "id": 1, "size": 10}',
    ])
    assert trace.ops == [ALLOC, ALLOC, MARK, FREE, ALLOC]
    assert trace.streams == [3, 0, 0, 3, 0]
    assert trace.marks == [(2, "iteration")]
    assert trace.num_ops == 4
    assert trace.peak_live_bytes() == 150


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{not json", "not valid JSON"),
        ('["a", "list"]', "must be a JSON object"),
        ('{"op": "realloc", "id": 9, "size": 1}', "unknown op 'realloc'"),
        ('{"op": "alloc", "id": 9}', "positive 'size'"),
        ('{"op": "alloc", "id": 9, "size": 0}', "positive 'size'"),
        ('{"op": "alloc", "id": 9, "size": -4}', "positive 'size'"),
        ('{"op": "alloc", "id": 9, "size": "12"}', "'size' must be an integer"),
        ('{"op": "free", "id": 42}', "free of id 42, which is not live"),
        ('{"op": "alloc", "id": 1, "size": 8}', "alloc of id 1, which is already live"),
        ('{"op": "free"}', "needs an integer 'id'"),
        ('{"op": "mark"}', "needs a string 'name'"),
    ],
)
def test_each_kind_of_bad_line_is_rejected_with_its_number(line: str, reason: str) -> None:
    lines = [HEADER, '{"op": "alloc", "id": 1, "size": 100}', line, '{"op": "free", "id": 1}']
    with pytest.raises(TraceError) as err:
        parse_lines(lines, "t.jsonl")
    assert err.value.line == 3
    assert reason in err.value.reason
    assert str(err.value).startswith("t.jsonl:3: ")


def test_a_header_without_version_1_is_rejected() -> None:
    with pytest.raises(TraceError, match=r":1: the header must carry"):
        parse_lines(['{"version": 2}'], "t")


def test_an_empty_trace_is_rejected() -> None:
    with pytest.raises(TraceError, match="no header"):
        parse_lines([], "t")


def test_gzip_and_plain_files_read_the_same(tmp_path: Path) -> None:
    text = "\n".join([HEADER, '{"op": "alloc", "id": 1, "size": 100}', '{"op": "free", "id": 1}']) + "\n"
    plain = tmp_path / "t.jsonl"
    plain.write_text(text)
    packed = tmp_path / "t.jsonl.gz"
    packed.write_bytes(gzip.compress(text.encode()))
    assert load(plain).ops == load(packed).ops == [ALLOC, FREE]


def test_a_missing_or_unreadable_file_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        load(tmp_path / "missing.jsonl")
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(b"\x1f\x8b" + b"garbage")
    with pytest.raises(TraceError, match="cannot read"):
        load(broken)


def test_the_shipped_workloads_are_valid_traces() -> None:
    names = sorted(p.name for p in workloads_dir().glob("*.jsonl.gz"))
    assert {"mlp.jsonl.gz", "seq2seq.jsonl.gz"} <= set(names)
    for name in ("mlp.jsonl.gz", "seq2seq.jsonl.gz"):
        assert load(workloads_dir() / name).num_ops > 900
