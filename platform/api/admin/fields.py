"""The operator API's field types (names, priorities, weights, limits, deadlines, money)
with their bounds, and the dollar ↔ micro-dollar conversions of its bodies: money is
dollars (floats) in the API and integer micro-dollars behind it; an amount with more than
6 decimal places, a negative or a non-finite one is refused (422 naming the field).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import (
    AfterValidator,
    Field,
    StringConstraints,
)

from loramux.platform.db.models import (
    MAX_PRIORITY,
    MIN_PRIORITY,
    NAME_LENGTH,
)
from loramux.platform.services.tenants import (
    micro_usd_to_usd,
    usd_to_micro_usd,
)

MAX_USD = 1_000_000_000  # keeps every amount far inside a BIGINT of micro-dollars
MAX_PER_MINUTE = 2**31 - 1  # the limit columns are 32-bit integers
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: anything longer is a typo


def _whole_micro_usd(value: float) -> float:
    usd_to_micro_usd(value)  # raises ValueError (→ 422) when not whole micro-dollars
    return value


# Stripped before it is checked, so a name needs a character other than whitespace; the
# pattern says so in /openapi.json too (a client reading minLength alone would send "\t").
Name = Annotated[
    str,
    StringConstraints(strip_whitespace=True, min_length=1, max_length=NAME_LENGTH, pattern=r"\S"),
]
Priority = Annotated[
    int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY, description="0-9; higher is served first.")
]
Weight = Annotated[
    float,
    Field(gt=0, allow_inf_nan=False, description="Share among tenants of one priority (> 0)."),
]
PerMinute = Annotated[int, Field(gt=0, le=MAX_PER_MINUTE)]
TimeoutSeconds = Annotated[
    float,
    Field(
        gt=0,
        le=MAX_TIMEOUT_S,
        allow_inf_nan=False,
        description="Default deadline of the tenant's requests, in seconds (the server's "
        "maximum still applies; a request's `timeout` can only shorten it).",
    ),
]
PinQuota = Annotated[
    int,
    Field(
        ge=0,
        le=2**53,  # exact in a JSON number (a double), and 8 PiB is beyond any device
        description="Bytes of adapter weights the tenant may pin on the device (its "
        "versions' weights files); empty: none.",
    ),
]
QueueLimit = Annotated[
    int,
    Field(
        gt=0,
        le=MAX_PER_MINUTE,
        description="Most of the tenant's requests queued at once (each choice counts).",
    ),
]
Usd = Annotated[
    float, Field(ge=0, le=MAX_USD, allow_inf_nan=False), AfterValidator(_whole_micro_usd)
]


def micro(usd: float | None) -> int | None:
    return None if usd is None else usd_to_micro_usd(usd)


def usd(micro_usd: int | None) -> float | None:
    return None if micro_usd is None else micro_usd_to_usd(micro_usd)
