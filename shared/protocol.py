"""Wire messages: msgspec Structs, msgpack-encoded, one tagged union per stream/channel.

Schema evolution: new fields get defaults and are appended; a field never changes type.
Every message has `v`; a decoder refuses a newer major version with ProtocolVersionError.

- request stream  `req`          : GenerateJob                      (api -> scheduler)
- token channel   `tok:{shard}`  : TokenBatch, one per scheduler step (scheduler -> detokenizer)
- output channel  `out:{api_id}` : TextBatch, one per detokenizer batch (detokenizer -> api)
- control channel `ctl`          : AbortRequests | Reattach | PauseGeneration |
                                   ContinueGeneration | FlushCache | UpdateWeights
                                                                    (anyone -> everyone)
Per-request entries carry `rid`, `epoch` (owner fencing token) and `seq` (index of the entry's
first new token) so receivers can drop stale owners and detect gaps or duplicates.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

PROTOCOL_VERSION = 1


class ProtocolVersionError(ValueError):
    pass


GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf", "structural_tag"]


class Grammar(msgspec.Struct, omit_defaults=True):
    """A constraint on the output (structured output): a JSON schema (text), any JSON object,
    a regex, an EBNF grammar (xgrammar's dialect, rule `root`) or a structural tag (JSON).
    The api checked it compiles; schedulers compile it again, cached by its text."""

    kind: GrammarKind
    text: str = ""


class SamplingParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False):
    """Engine-side sampling parameters (already validated by the api)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = whole vocabulary
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    seed: int | None = None
    # Checked by the scheduler on decoded tails so that a match finishes the request there.
    stop: list[str] = []
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    logit_bias: dict[int, float] = {}
    grammar: Grammar | None = None


class LogprobRequest(msgspec.Struct, omit_defaults=True):
    """What logprobs to compute (SGLang's return_logprob family)."""

    # First prompt position whose logprob is returned; -1 = output tokens only.
    start_len: int = -1
    top_n: int = 0  # top-k logprobs per position
    token_ids: list[int] = []  # logprobs of these ids at every position


class Logprobs(msgspec.Struct, omit_defaults=True):
    """Logprobs for a run of positions (output: the entry's new tokens; input: the prompt
    from start_len). Lists are per position; top/ids lists are empty when not requested."""

    token_logprobs: list[float] = []
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    requested_logprobs: list[list[float]] = []  # in LogprobRequest.token_ids order


class DetokParams(msgspec.Struct, omit_defaults=True):
    """What the detokenizer needs to know about one request."""

    api_id: str
    stop: list[str] = []
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False


class FinishReason(msgspec.Struct, omit_defaults=True):
    """SGLang's finish_reason: {type: stop|length|abort, matched | length | message}."""

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__struct_fields__ if getattr(self, f) is not None}


class GenerateJob(msgspec.Struct, tag="generate", omit_defaults=True):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    detok: DetokParams
    created_at: float = 0.0
    v: int = PROTOCOL_VERSION
    logprobs: LogprobRequest | None = None
    # Embedding job: prefill only, the finish entry carries the pooled last hidden state.
    embed: bool = False
    # SGLang's `priority`: schedulers start higher values first.
    priority: int = 0
    # Unix time past which the request ends with an error wherever it is (0 = none).
    deadline: float = 0.0


class TokenEntry(msgspec.Struct, omit_defaults=True):
    """New token ids of one request in one scheduler step."""

    rid: str
    epoch: int
    seq: int  # index in the output of token_ids[0]
    token_ids: list[int]
    prompt_tokens: int
    finish: FinishReason | None = None
    cached_tokens: int = 0
    # Sent with a request's first entry of an epoch (seq 0 or after a reclaim).
    detok: DetokParams | None = None
    output_logprobs: Logprobs | None = None  # one position per token_ids element
    input_logprobs: Logprobs | None = None  # on the request's first entry only
    embedding: list[float] | None = None
    # Seconds from submission to the step that started the request (its first entry only).
    queue_time: float | None = None
    # The weights that produced the request (its finish entry).
    weight_version: str | None = None


class TokenBatch(msgspec.Struct, tag="tokens", omit_defaults=True):
    worker_id: str
    entries: list[TokenEntry]
    v: int = PROTOCOL_VERSION


class TextEntry(msgspec.Struct, omit_defaults=True):
    """New text of one request. `token_ids` are the ids that advanced since the last entry."""

    rid: str
    epoch: int
    seq: int
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish: FinishReason | None = None
    cached_tokens: int = 0
    output_logprobs: Logprobs | None = None
    input_logprobs: Logprobs | None = None
    embedding: list[float] | None = None
    queue_time: float | None = None
    weight_version: str | None = None


class TextBatch(msgspec.Struct, tag="text", omit_defaults=True):
    entries: list[TextEntry]
    v: int = PROTOCOL_VERSION


class AbortRequests(msgspec.Struct, tag="abort", omit_defaults=True):
    rids: list[str]
    v: int = PROTOCOL_VERSION


class Reattach(msgspec.Struct, tag="reattach", omit_defaults=True):
    """`rids`' clients are now held by `api_id` (state:{rid}.api_id already says so): route
    their output there from now on. `from_seqs` (parallel to `rids`, -1 = none) asks the
    detokenizer to send the text again from that seq on: what the replica missed (a dead
    replica's last entries, or a gap after pub/sub dropped messages)."""

    rids: list[str]
    api_id: str
    from_seqs: list[int] = []
    v: int = PROTOCOL_VERSION


PauseMode = Literal["abort", "retract", "in_place"]


class PauseGeneration(msgspec.Struct, tag="pause", omit_defaults=True):
    """Every scheduler stops stepping (the `pause` key holds the mode for late joiners):
    `abort` ends its requests, `retract` returns them to its queue (KV freed), `in_place`
    keeps them with their KV. New jobs wait in the stream until ContinueGeneration."""

    mode: PauseMode = "abort"
    v: int = PROTOCOL_VERSION


class ContinueGeneration(msgspec.Struct, tag="continue", omit_defaults=True):
    v: int = PROTOCOL_VERSION


class FlushCache(msgspec.Struct, tag="flush_cache", omit_defaults=True):
    """Every scheduler empties its prefix cache (blocks in use stay)."""

    v: int = PROTOCOL_VERSION


class UpdateWeights(msgspec.Struct, tag="update_weights", omit_defaults=True):
    """The fleet's target weights changed (the `weights` hash holds them): schedulers load
    `model_path` as `weight_version`, all at once (`all`) or one at a time (`rolling`)."""

    model_path: str
    weight_version: str
    mode: Literal["all", "rolling"] = "all"
    v: int = PROTOCOL_VERSION


StreamMessage = GenerateJob
TokenMessage = TokenBatch
OutputMessage = TextBatch
ControlMessage = (
    AbortRequests | Reattach | PauseGeneration | ContinueGeneration | FlushCache | UpdateWeights
)

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, kind: Any) -> Any:
    """Decode `data` as `kind` (a Struct type or a Union of them); check the version."""
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    msg = decoder.decode(data)
    if msg.v > PROTOCOL_VERSION:
        raise ProtocolVersionError(f"protocol v{msg.v} is newer than v{PROTOCOL_VERSION}")
    return msg


class RequestState(msgspec.Struct, omit_defaults=True, kw_only=True):
    """The request-state hash `state:{rid}` (not a message: each field is a hash field,
    written as text by shared.request_state, which also decodes it). A field is None until
    its writer set it: the api at submit, the scheduler when it admits, then at finish."""

    status: str  # queued | running | finished | aborted
    api_id: str | None = None  # the api replica that holds the client
    worker: str | None = None  # the scheduler that runs it
    epoch: int | None = None  # the owner's fencing token
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: FinishReason | None = None  # JSON in the hash
    created_at: float | None = None  # unix time
    finished_at: float | None = None
    # Resumable streams (written by the api through shared.reattach): the rid whose event
    # log `events:{rid}` holds this request's SSE events (a batch's first rid); on that rid's
    # own hash, the response's render spec (JSON, api.stream_spec) and the one attachment
    # (api replica + HTTP response) that may append to the log.
    stream_rid: str | None = None
    stream_spec: str | None = None
    attach_id: str | None = None
    # The weights that produced the output (written at finish).
    weight_version: str | None = None
