"""Answers that arrive in pieces (:class:`service.jobs.Answer`, Redis): relayed as they land.

safetensors: the header goes out first (the worker wrote it before any data, with every size),
then each piece as the worker's write reaches Redis; ``Content-Length`` is known up front, so a
client can preallocate. If the attempt writing the answer stops mid-way, the stream raises before
its last piece and the connection is cut short of ``Content-Length``: the client sees a broken
transfer, never a short answer taken for whole. JSON needs the numbers: the pieces are read
straight into arrays allocated once (the SDK's own reader), then written row by row.
"""

from __future__ import annotations

from fastapi import Request, Response
from starlette.background import BackgroundTask

from psgrad._wire import SAFETENSORS
from service.api.body import ReleasingResponse, json_response, wants_safetensors
from service.jobs import Answer, read_answer

__all__ = ["answer_response"]


async def answer_response(
    request: Request,
    answer: Answer,
    *,
    headers: dict[str, str] | None = None,
    background: BackgroundTask | None = None,
    consume: bool = False,
) -> Response:
    """The answer in the form the client accepts: safetensors relayed piece by piece, or JSON.

    ``consume``: the answer is relayed once and then forgotten, so its pieces leave Redis as
    they are read (see :meth:`service.jobs.Answer.pieces`).
    """
    if wants_safetensors(request):
        return ReleasingResponse(
            answer.pieces(consume=consume),
            media_type=SAFETENSORS,
            headers={**(headers or {}), "content-length": str(answer.size)},
            background=background,
        )
    response = await json_response(await read_answer(answer, consume=consume), headers=headers)
    response.background = background
    return response
