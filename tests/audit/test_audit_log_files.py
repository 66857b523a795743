"""The audit log's format, writer and reader, without an engine: parameters read back equal,
the logprobs hash sees every bit, files are private and rotate, a full queue drops and counts,
close writes the queue out, and the reader skips a torn or corrupt line and says so."""

from __future__ import annotations

import json
import math
import stat
import threading

import pytest

from detlora.audit.format import (
    ids_sha256,
    logprobs_sha256,
    params_from_json,
    params_to_json,
    parse_time,
    utc_time,
)
from detlora.audit.reader import read_log
from detlora.audit.writer import AuditConfig, AuditWriter
from detlora.config import RequestOutputKind, SamplingParams, StructuredOutputsParams
from detlora.engine.fingerprint import FIELDS, fingerprint, fingerprint_fields

HEADER = {"id": "e1", "model": "m", "engine_args": {}, "hash_only": False}


def test_sampling_params_read_back_equal():
    cases = [
        SamplingParams(),
        SamplingParams(max_tokens=None, n=3, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05,
                       seed=2**64 - 1, logprobs=3, prompt_logprobs=0, ignore_eos=True,
                       stop_token_ids=(7, 9), min_tokens=2, stop=("\n\n", "END"),
                       include_stop_str_in_output=True, repetition_penalty=1.1,
                       presence_penalty=-0.5, frequency_penalty=0.25,
                       logit_bias={3: -100.0, 4: 0.1}, allowed_token_ids=(1, 2, 3),
                       output_kind=RequestOutputKind.DELTA, detokenize=False),
        SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"})),
        SamplingParams(structured_outputs=StructuredOutputsParams(choice=("a", "b"))),
        SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)),
        SamplingParams(temperature=0.1 + 0.2),  # a float that needs every digit
    ]
    for sp in cases:
        back = params_from_json(json.loads(json.dumps(params_to_json(sp))))
        assert back == sp and back.logit_bias == sp.logit_bias
    with pytest.raises(ValueError, match="does not know"):
        params_from_json({**params_to_json(SamplingParams()), "beam_width": 4})


def test_logprobs_hash_sees_every_bit_and_every_part():
    entries = [{5: -0.5, 7: -1.25}, {9: -0.0}]
    base = logprobs_sha256(entries)
    assert logprobs_sha256([{5: -0.5, 7: -1.25}, {9: 0.0}]) != base  # the sign of zero
    assert logprobs_sha256([{5: -0.5, 7: -1.25}, {8: -0.0}]) != base  # a token id
    assert logprobs_sha256([{7: -1.25, 5: -0.5}, {9: -0.0}]) != base  # the entries' order
    assert logprobs_sha256([{5: -0.5}, {7: -1.25, 9: -0.0}]) != base  # where positions split
    nudged = math.nextafter(-1.25, 0.0)
    assert logprobs_sha256([{5: -0.5, 7: nudged}, {9: -0.0}]) != base  # one ulp
    with_prompt = logprobs_sha256(entries, [None, {3: -2.0}])
    assert with_prompt != base != logprobs_sha256(entries, label_token_ids=[1, 2],
                                                  label_logprobs={1: -0.1, 2: -3.0})
    assert logprobs_sha256(entries, [None, {3: -2.0}]) == with_prompt  # deterministic
    assert ids_sha256([1, 2, 3]) != ids_sha256([1, 2, 4])


def test_times_are_iso_utc_and_parse_back():
    text = utc_time(1_700_000_000.25)
    assert text == "2023-11-14T22:13:20.250000Z"
    assert parse_time(text).timestamp() == 1_700_000_000.25
    assert parse_time("2023-11-14").tzinfo is not None
    with pytest.raises(ValueError, match="not an ISO date"):
        parse_time("yesterday")


def test_fingerprint_fields_name_what_differs():
    parts = {"weights": "w" * 64, "dtype": "bfloat16",
             "backend": {"device": "cuda", "determinism": "batch_invariant",
                         "lora_reduction": "in_gemm", "op.linear": "matmul.linear"},
             "settings": {}, "source": "s" * 64,
             "versions": {"torch": "2.13", "triton": "3.6", "detlora": "0.1"},
             "device": {"gpu": "NVIDIA H200", "cuda": "13.0", "capability": "9.0"}}
    base = fingerprint_fields(parts, "a" * 64)
    assert list(base) == list(FIELDS) and base["level"] == "batch_invariant"
    other = {**parts, "device": {**parts["device"], "gpu": "NVIDIA H100"}}
    assert [f for f in FIELDS if fingerprint_fields(other, "a" * 64)[f] != base[f]] == ["device"]
    assert [f for f in FIELDS if fingerprint_fields(parts, "b" * 64)[f] != base[f]] == ["adapter"]
    kernels = {**parts, "backend": {**parts["backend"], "op.linear": "cublas"}}
    assert [f for f in FIELDS if fingerprint_fields(kernels, None)[f]
            != fingerprint_fields(parts, None)[f]] == ["kernels"]
    assert fingerprint(parts, None) != fingerprint(other, None)


def _rec(i: int, pad: int = 0) -> dict:
    return {"v": 1, "kind": "request", "id": f"r{i}", "time": utc_time(1e9 + i),
            "pad": "x" * pad}


def test_writer_files_are_private_rotate_and_read_back(tmp_path):
    d = tmp_path / "audit"
    w = AuditWriter(AuditConfig(str(d), max_bytes=2_000), HEADER)
    for i in range(40):
        assert w.submit(lambda i=i: _rec(i, pad=100))
    w.close()
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    files = sorted(d.iterdir())
    assert len(files) > 2 and w.stats.files == len(files)  # rotated by size
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
        first = json.loads(f.read_text().splitlines()[0])
        assert first["kind"] == "engine" and first["id"] == "e1" and first["file"] == f.name
        assert f.stat().st_size <= 2_000 + 200  # one line may overshoot, never two
    log = read_log([d])
    assert [e.record["id"] for e in log.entries] == [f"r{i}" for i in range(40)]
    assert all(e.engine["id"] == "e1" for e in log.entries) and not log.skipped
    assert w.stats.lines_written == 40 and w.stats.lines_dropped == 0
    assert sum(w.stats.latency_counts) == 40
    assert w.stats.bytes_written == sum(len(f.read_bytes()) for f in files) - sum(
        len(f.read_text().splitlines()[0]) + 1 for f in files)
    assert not w.submit(lambda: _rec(99)) and w.stats.lines_dropped == 1  # closed


def test_a_full_queue_drops_and_counts_and_close_writes_the_rest(tmp_path):
    gate = threading.Event()
    w = AuditWriter(AuditConfig(str(tmp_path), queue_size=4), HEADER)

    def slow() -> dict:
        gate.wait(10)
        return _rec(0)

    assert w.submit(slow)
    while w.queued:  # the writer holds the slow one
        pass
    accepted = sum(w.submit(lambda i=i: _rec(i + 1)) for i in range(10))
    assert accepted == 4 and w.stats.lines_dropped == 6
    gate.set()
    w.close()
    ids = [e.record["id"] for e in read_log([tmp_path]).entries]
    assert ids == ["r0", "r1", "r2", "r3", "r4"]


def test_the_reader_skips_a_torn_or_corrupt_line_and_says_which(tmp_path):
    w = AuditWriter(AuditConfig(str(tmp_path)), HEADER)
    for i in range(3):
        w.submit(lambda i=i: _rec(i))
    w.close()
    (f,) = tmp_path.iterdir()
    lines = f.read_bytes().split(b"\n")
    # a corrupt line in the middle, a newer version, and a torn last line
    lines.insert(2, b'{"v": 1, "kind": "request", "id": "broken"')
    lines.insert(3, json.dumps({**_rec(7), "v": 99}).encode())
    f.write_bytes(b"\n".join(lines[:-1]) + b"\n" + json.dumps(_rec(9)).encode()[:-5])
    log = read_log([f])
    assert [e.record["id"] for e in log.entries] == ["r0", "r1", "r2"]
    assert [(s.line, s.reason) for s in log.skipped] == [(3, "corrupt"), (4, "unreadable"),
                                                         (7, "torn")]
    with pytest.raises(ValueError, match="does not exist"):
        read_log([tmp_path / "nope"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no audit log files"):
        read_log([empty])


def test_a_directory_it_cannot_make_is_refused_at_start(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="cannot be made"):
        AuditWriter(AuditConfig(str(blocker / "audit")), HEADER)
    with pytest.raises(ValueError, match=r"the audit log directory .*a_file"):
        AuditWriter(AuditConfig(str(blocker)), HEADER)
