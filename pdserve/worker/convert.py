"""Worker side of the wire: protobuf requests to engine dataclasses, engine outputs to protobuf.

The router side is router/worker_client.py; the two agree on the messages of proto/v1.
"""

from __future__ import annotations

import json
import math

from pdserve.engine.request import Logprob, RequestOutput
from pdserve.engine.sampling_params import InvalidRequestError, SamplingParams
from pdserve.proto.v1 import worker_pb2 as pb


def sampling_from_proto(m: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=m.temperature, top_p=m.top_p, top_k=m.top_k, min_p=m.min_p,
        presence_penalty=m.presence_penalty, frequency_penalty=m.frequency_penalty,
        repetition_penalty=m.repetition_penalty, seed=m.seed if m.HasField("seed") else None,
        max_tokens=m.max_tokens if m.HasField("max_tokens") else None, min_tokens=m.min_tokens,
        stop=tuple(m.stop), stop_token_ids=tuple(m.stop_token_ids), ignore_eos=m.ignore_eos,
        logprobs=m.logprobs if m.HasField("logprobs") else None, skip_special_tokens=m.skip_special_tokens,
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
        include_stop_str_in_output=m.include_stop_str_in_output, priority=m.priority,
    )


def queue_timeout_from_proto(seconds: float) -> float | None:
    """A request's ``queue_timeout_s``: None for 0 (no bound); a negative or non-finite value is refused."""
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidRequestError("queue_timeout_s", f"must be a finite number of seconds >= 0, not {seconds}")
    return seconds or None


def _lp(lp: Logprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank)


def output_to_proto(out: RequestOutput) -> pb.GenerateResponse:
    # A handoff ends the request here, not for the client: on the wire it is still running.
    finished = out.finished and out.finish_reason != "handoff"
    msg = pb.GenerateResponse(
        request_id=out.request_id, token_ids=out.new_token_ids, text=out.new_text, finished=finished,
        finish_reason=(out.finish_reason or "") if finished else "", num_prompt_tokens=out.num_prompt_tokens,
        num_output_tokens=out.num_output_tokens, num_cached_tokens=out.num_cached_tokens,
    )
    if isinstance(out.stop_reason, str):
        msg.stop_str = out.stop_reason
    elif isinstance(out.stop_reason, int):
        msg.stop_token_id = out.stop_reason
    for lp in out.new_logprobs or ():
        msg.logprobs.append(pb.PositionLogprobs(sampled=_lp(lp.sampled), top=[_lp(t) for t in lp.top]))
    for lp in (out.prompt_logprobs or [None])[1:]:  # position 0 has none
        msg.prompt_logprobs.append(pb.PositionLogprobs(sampled=_lp(lp.sampled), top=[_lp(t) for t in lp.top]))
    return msg


def encode_invalid(e: InvalidRequestError) -> str:
    """An engine validation error as a gRPC status detail (router/worker_client.py decodes it)."""
    return json.dumps({"field": e.field, "code": e.code, "message": str(e)})
