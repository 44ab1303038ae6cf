"""Streaming: a chunk for every message that brings tokens, its text empty where the tokens end inside a
character (the first byte of a two-byte one), as vLLM streams them, so a client's time to first token
is its first token's, not the next one's. A Router in this process over a worker answering from a
script (no model behind it)."""

from __future__ import annotations

import orjson
import pytest

from pdserve.proto.v1 import worker_pb2 as pb
from tests.router.conftest import MODEL, ScriptedCall, in_rotation, run

# "ק" is two bytes in UTF-8; a byte-level tokenizer may give each its own token: the first decodes to
# nothing yet, the second to the whole character
MESSAGES = [("", [201]), ("ק", [202]), ("", [203]), ("ק", [204])]


class _Decode:
    def Generate(self, request):
        last = len(MESSAGES) - 1
        return ScriptedCall([pb.GenerateResponse(token_ids=ids, text=text, finished=i == last,
                                                 finish_reason="length" if i == last else "")
                             for i, (text, ids) in enumerate(MESSAGES)])

    async def Abort(self, request, timeout=None):
        return pb.AbortResponse()


def _chunks(response) -> list[dict]:
    return [orjson.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("chat", [False, True])
def test_a_token_without_text_of_its_own_still_gets_its_chunk(make_client, chat):
    worker = in_rotation("decode")
    worker.stub = _Decode()
    client = make_client([worker])
    if chat:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
        r = run(client.post("/v1/chat/completions", json=body))
        texts = [c["choices"][0]["delta"].get("content") for c in _chunks(r)[1:]]  # (after the role's chunk)
    else:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True}
        r = run(client.post("/v1/completions", json=body))
        texts = [c["choices"][0]["text"] for c in _chunks(r)]
    assert r.status_code == 200, r.text
    assert texts[:3] == ["", "ק", ""] and "".join(t or "" for t in texts) == "קק"
    assert len(texts) == len(MESSAGES)
