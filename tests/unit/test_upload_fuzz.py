"""Whatever an upload's bytes, the Files API answers it whole or refuses it cleanly. Random
multipart bodies (fields missing, repeated or unknown; odd file names; contents that are not
JSON, not UTF-8, led by a byte-order mark, of any line ending; bodies cut short, boundaries
that lie, no boundary at all): never a 5xx, a refusal names its problem and leaves the tenant's
share as it was, and a file that is kept reads back byte for byte."""

from __future__ import annotations

import asyncio
import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.files import FileStore
from tests.unit.test_batch_uploads import app_with
from tests.unit.test_batches import Clock, _line

BOUNDARY = "fuzz-boundary"
AUTH = {"Authorization": "Bearer key-b"}

lines = st.one_of(
    st.integers(0, 30).map(_line),
    st.integers(0, 30).map(lambda i: _line(i, url="/v1/chat/completions")),
    st.just('{"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {}}'),
    st.just("not json"), st.just(""), st.just("[]"), st.just('{"custom_id": 7}'),
    st.text(max_size=40),
)
good = st.lists(st.integers(0, 30), min_size=1, max_size=12, unique=True).map(lambda ids: [_line(i) for i in ids])
contents = st.one_of(
    *[st.one_of(good, good, st.lists(lines, max_size=12)).flatmap(lambda ls: st.sampled_from(
        ["\n", "\r\n", "\r"]).flatmap(lambda end: st.sampled_from(["", end]).map(
            lambda last: (end.join(ls) + last).encode())))] * 3,
    st.binary(max_size=300),
).flatmap(lambda c: st.sampled_from([b"", b"", b"\xef\xbb\xbf", b"\xff\xfe"]).map(lambda bom: bom + c))
names = st.sampled_from(["file", "purpose", "expires_after[anchor]", "expires_after[seconds]", "model", "", "fi\"le"])
values = st.one_of(st.sampled_from([b"batch", b"batch_output", b"fine-tune", b"created_at", b"3600", b"-1",
                                    b"1e9", b"\xff"]), st.binary(max_size=20))
filenames = st.one_of(st.none(), st.sampled_from(["in.jsonl", "../../etc/passwd", "a\x00b", "résumé.jsonl", "",
                                                  "x" * 300]))


@st.composite
def bodies(draw) -> tuple[bytes, str]:
    often = st.sampled_from([True, True, True, False])  # hypothesis leans to the first
    parts = [("purpose", None, b"batch"), ("file", "in.jsonl", draw(contents))] if draw(often) else []
    if not draw(often):
        parts += draw(st.lists(st.tuples(names, filenames, st.one_of(values, contents)), min_size=1, max_size=4))
        parts = draw(st.permutations(parts))
    out = b""
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"' + ("" if filename is None else f'; filename="{filename}"')
        out += f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n".encode("utf-8", "surrogatepass")
        out += data + b"\r\n"
    out += f"--{BOUNDARY}--\r\n".encode()
    cut = None if draw(often) else draw(st.integers(0, len(out)))
    kind = f"multipart/form-data; boundary={BOUNDARY}" if draw(often) else draw(st.sampled_from(
        ["multipart/form-data", "multipart/form-data; boundary=other", "application/json", ""]))
    return (out if cut is None else out[:cut]), kind


def _file_part(body: bytes) -> bytes | None:
    """The content of the one `file` field of a body that was whole and well formed."""
    found = [p.split(b"\r\n\r\n", 1)[1][:-2] for p in body.split(f"--{BOUNDARY}".encode())
             if b'name="file"; filename=' in p.split(b"\r\n\r\n", 1)[0]]
    return found[0] if len(found) == 1 else None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sent=bodies())
def test_an_upload_is_kept_whole_or_refused_cleanly_whatever_its_bytes(tmp_path, sent):
    body, kind = sent
    app = app_with(tmp_path)
    files = FileStore(tmp_path, Clock())
    before = files.usage("b")

    async def go() -> tuple[httpx.Response, bytes | None]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as http:
            r = await http.post("/v1/files", content=body, headers={**AUTH, "Content-Type": kind})
            back = (await http.get(f"/v1/files/{r.json()['id']}/content", headers=AUTH)).content \
                if r.status_code == 200 else None
            return r, back

    r, back = asyncio.run(go())
    assert r.status_code < 500, (r.status_code, r.text)
    answer = r.json()
    if r.status_code == 200:
        assert back == _file_part(body), "the file kept is not the file sent"
        assert files.usage("b") == (before[0] + 1, before[1] + len(back))
    else:
        error = answer["error"]
        assert error["code"] and error["message"] and error["param"], f"a refusal names no field: {answer}"
        assert files.usage("b") == before, "a refused upload left something on the volume"
        json.dumps(answer)
