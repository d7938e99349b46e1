"""The engine processes' wire format: engine values as JSON and back, losslessly.

Requests carry ``SamplingParams``; a generate stream is one JSON line per
``RequestOutput``; ``EngineStats`` answers the stats call in its own JSON form
(``EngineStats.to_json`` / ``from_json``: an older engine's still parses, a newer engine's
extra figures are dropped). Decoding rebuilds the engine's own types, so ``SamplingParams``
validates what arrives (a bad field raises ValueError or TypeError naming it).
``logit_bias`` travels as a list of [token id, bias] pairs (JSON object keys are strings);
``structured`` (a structured-output spec) travels in the spec's own JSON
form (``spec_to_json``). Those three are left out when unset, so an engine from before them
still takes the requests that don't use them; a malformed spec is refused by name
(GrammarError, a ValueError). ``speculative`` is sent only when a request opts out (False),
for the same reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from loramux.engine import (
    EngineStats,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
    spec_from_json,
    spec_to_json,
)

_TUPLE_PARAMS = ("stop", "stop_token_ids")
_OPTIONAL_PARAMS = ("prompt_logprobs", "logit_bias", "structured")  # sent only when set


def params_to_json(params: SamplingParams) -> dict[str, Any]:
    # The spec is not asdict'ed: its own JSON form is what spec_from_json reads back.
    data = dataclasses.asdict(dataclasses.replace(params, structured=None))
    for key in _OPTIONAL_PARAMS:
        if data[key] is None:
            del data[key]
    if params.speculative:  # the default: an engine from before the opt-out takes the rest
        del data["speculative"]
    if params.logit_bias is not None:
        data["logit_bias"] = [[token, bias] for token, bias in params.logit_bias.items()]
    if params.structured is not None:
        data["structured"] = spec_to_json(params.structured)
    return data


def params_from_json(data: dict[str, Any]) -> SamplingParams:
    fields = {key: tuple(value) if key in _TUPLE_PARAMS else value for key, value in data.items()}
    if fields.get("logit_bias") is not None:
        fields["logit_bias"] = _pairs_to_dict("logit_bias", fields["logit_bias"])
    if fields.get("structured") is not None:
        fields["structured"] = spec_from_json(fields["structured"])
    return SamplingParams(**fields)


def _pairs_to_dict(name: str, pairs: Any) -> dict:
    try:
        return {token: bias for token, bias in pairs}
    except (TypeError, ValueError):
        raise ValueError(
            f"{name} must be a list of [token id, bias] pairs, got {pairs!r}"
        ) from None


def output_to_json(out: RequestOutput) -> dict[str, Any]:
    return dataclasses.asdict(out)


def _token_logprobs(item: dict[str, Any]) -> TokenLogprobs:
    return TokenLogprobs(item["token_id"], item["logprob"], [tuple(t) for t in item["top"]])


def output_from_json(data: dict[str, Any]) -> RequestOutput:
    fields = dict(data)
    fields["logprobs"] = [_token_logprobs(item) for item in data.get("logprobs", [])]
    prompt = data.get("prompt_logprobs")
    fields["prompt_logprobs"] = (
        None
        if prompt is None
        else [None if item is None else _token_logprobs(item) for item in prompt]
    )
    metrics = data.get("metrics")
    fields["metrics"] = None if metrics is None else _metrics(metrics)
    return RequestOutput(**fields)


def _metrics(data: dict[str, Any]) -> RequestMetrics:
    """A request's metrics; figures this version does not know (a newer engine's) are
    dropped, so engines can be upgraded before the platforms that call them."""
    known = {f.name for f in dataclasses.fields(RequestMetrics)}
    return RequestMetrics(**{k: v for k, v in data.items() if k in known})


def stats_to_json(stats: EngineStats) -> dict[str, Any]:
    return stats.to_json()


def stats_from_json(data: dict[str, Any]) -> EngineStats:
    return EngineStats.from_json(data)
