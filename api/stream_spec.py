"""What rendering a streaming response needs, stored with the request at submit
(`state:{log rid}.stream_spec`, JSON) so that ANY replica can go on rendering it after a
re-attach, in the original request's format: the route kind, the OpenAI head (id, created,
model), stream options, per member (choice / batch item) its rid, prompt tokens and logprob
options. Prompts are not stored: after a takeover a member that had sent nothing yet shows
empty input logprobs."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import msgspec

from shared import protocol

if TYPE_CHECKING:
    from api.req_state import GenerateReq, ReqState

Kind = Literal["generate", "completion", "chat"]


class MemberSpec(msgspec.Struct, omit_defaults=True):
    rid: str
    prompt_tokens: int
    logprobs: protocol.LogprobRequest | None = None
    return_text_in_logprobs: bool = False
    skip_special_tokens: bool = True


class StreamSpec(msgspec.Struct, omit_defaults=True):
    kind: Kind
    members: list[MemberSpec] = []
    created_time: float = 0.0  # unix time the request was registered (e2e_latency)
    is_single: bool = True  # /generate: one prompt, no batch index on chunks
    incremental: bool = False  # /generate: deltas instead of cumulative chunks
    n: int = 1  # OpenAI: samples per prompt (usage counts a prompt once)
    head_id: str = ""  # OpenAI: the id, created and model of every chunk
    created: int = 0
    model: str = ""
    include_usage: bool = False
    continuous_usage: bool = False
    tool_parser: str = ""  # chat with tools: how calls are parsed out of the text
    reasoning_parser: str = ""  # chat from a thinking model: how its thinking is split out
    echo: bool = False  # completions: the prompt leads each choice's first chunk

    def encode(self) -> str:
        return msgspec.json.encode(self).decode()

    @staticmethod
    def decode(text: str) -> StreamSpec:
        return msgspec.json.decode(text, type=StreamSpec)

    @property
    def rids(self) -> list[str]:
        return [m.rid for m in self.members]

    def fill(self, reqs: list[GenerateReq], created_time: float) -> None:
        """Complete the spec once the requests are tokenized (prompt token counts)."""
        self.created_time = created_time
        self.members = [
            MemberSpec(
                rid=req.rid,
                prompt_tokens=len(req.input_ids),
                logprobs=req.logprobs,
                return_text_in_logprobs=req.return_text_in_logprobs,
                skip_special_tokens=req.skip_special_tokens,
            )
            for req in reqs
        ]

    def member_req(self, index: int) -> GenerateReq:
        """A stand-in for the member's original request, as rendering reads it."""
        from api.req_state import GenerateReq

        m = self.members[index]
        return GenerateReq(
            rid=m.rid,
            prompt=[],
            sampling=protocol.SamplingParams(),
            max_new_tokens=None,
            stream=True,
            incremental=self.incremental or self.kind != "generate",
            skip_special_tokens=m.skip_special_tokens,
            logprobs=m.logprobs,
            return_text_in_logprobs=m.return_text_in_logprobs,
            openai=self.kind != "generate",
        )


def new_attach_id(api_id: str) -> str:
    """An attachment: this replica and one HTTP response (a replica may attach twice)."""
    return f"{api_id}/{uuid.uuid4().hex[:12]}"


@dataclass
class StreamSetup:
    """A streaming response being submitted: its spec, its attachment, and (set by the
    TokenizerManager when it registers them) its members' states."""

    spec: StreamSpec
    attach_id: str
    states: list[ReqState] = field(default_factory=list)

    @property
    def stream_rid(self) -> str:
        return self.spec.members[0].rid
