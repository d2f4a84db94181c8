"""POST /v1/feedback: an explicit reward for one turn, from the client or a person.

Owns the body (`FeedbackRequest`) and the handler; the session store finds the turn and the
scorer combines the reward with its own (see scoring/judging.py). Each rule's message is the one this
endpoint has always given, whatever pydantic would have said; a number out of range says its
bound, as every endpoint does (protocol.validate).
"""

from __future__ import annotations

from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlproxy.api.edge import json_body, json_response
from rlproxy.api.sessions import find_session
from rlproxy.protocol import APIError, json_int, shown

# A failed field's message, by field: the endpoint's words since before this model existed.
MESSAGES = {"session_id": "session_id (string) is required",
            "reward": "reward must be a number in [-1, 1]",
            "comment": "comment must be a string", "turn": "turn may only be 'last'",
            "turn_uid": "turn_uid must be a string", "turn_id": "turn_id must be a string",
            "turn_index": "turn_index must be an integer",
            "step_index": "step_index must be an integer"}


class FeedbackRequest(BaseModel):
    """Which turn (by uid, index, turn id + step index, or the last) and its reward."""

    model_config = ConfigDict(strict=True, extra="ignore")  # strict: 1 is no bool, "1" no number
    session_id: str = Field(min_length=1)
    reward: float = Field(ge=-1, le=1)
    comment: str | None = None
    turn_uid: str | None = None
    turn_index: json_int() | None = None
    turn_id: str | None = None
    step_index: json_int() | None = None
    turn: Literal["last"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_unset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @model_validator(mode="after")
    def _names_a_turn(self) -> "FeedbackRequest":
        if (self.turn_uid, self.turn_index, self.turn_id, self.step_index, self.turn) == (
                None,) * 5:
            raise APIError(400, "name the turn: turn_uid, turn_index, turn_id (+ step_index) or "
                           "turn: 'last'", param="turn")
        return self


async def parse_feedback(request: web.Request) -> FeedbackRequest:
    try:
        return await json_body(request, FeedbackRequest)
    except APIError as e:
        field = (e.param or "").split(".")[0].split("[")[0]
        # pydantic's words; a number out of range (which has a code) keeps "must be at most N"
        if field in MESSAGES and e.code is None and e.message.startswith(f"{e.param}: "):
            raise APIError(400, MESSAGES[field], param=field) from None
        raise


async def feedback(request: web.Request) -> web.Response:
    body = await parse_feedback(request)
    sid = body.session_id
    store, scorer = await find_session(request, sid)  # the adapter whose session it is
    uid = store.find_turn(sid, uid=body.turn_uid, index=body.turn_index, turn_id=body.turn_id,
                          step_index=body.step_index, last=body.turn == "last") \
        if store is not None else None
    if uid is None:
        raise APIError(404, f"no such turn in session {shown(sid)} (open or recently closed)",
                       param="session_id", code="turn_not_found")
    status = await scorer.add_feedback(uid, sid, body.reward, body.comment)
    return json_response({"object": "feedback", "session_id": sid, "turn_uid": uid,
                          "reward": body.reward, "status": status})
