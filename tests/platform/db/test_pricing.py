"""Pricing: exact integer micro-dollar arithmetic and the price in force at a moment."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from loramux.platform.db.models import Price, Tenant
from loramux.platform.db.pricing import cost_micro_usd, current_price
from tests.platform.db.factories import add_price, add_tenant


def _price(input_rate: int, cached_rate: int, output_rate: int) -> Price:
    return Price(
        input_micro_usd_per_mtok=input_rate,
        cached_input_micro_usd_per_mtok=cached_rate,
        output_micro_usd_per_mtok=output_rate,
    )


def test_cost_of_a_typical_request():
    # $0.50 / $0.25 / $1.50 per million tokens.
    price = _price(500_000, 250_000, 1_500_000)
    # 800 uncached × 0.5 + 200 cached × 0.25 + 100 × 1.5 = 400 + 50 + 150 micro-dollars.
    assert (
        cost_micro_usd(price, prompt_tokens=1000, cached_tokens=200, completion_tokens=100) == 600
    )


def test_cost_is_exact_on_large_numbers():
    price = _price(3_000_001, 1_234_567, 15_000_007)
    prompt, cached, completion = 10**15 + 3, 10**14 + 1, 7 * 10**14 + 9
    expected_millionths = (
        (prompt - cached) * 3_000_001 + cached * 1_234_567 + completion * 15_000_007
    )
    cost = cost_micro_usd(price, prompt, cached, completion)
    assert cost == expected_millionths // 1_000_000
    assert cost * 1_000_000 <= expected_millionths < (cost + 1) * 1_000_000
    assert isinstance(cost, int)


def test_rounding_floors_once_over_the_whole_request():
    price = _price(1, 1, 1)
    # 999_999 millionths of a micro-dollar: not yet one micro-dollar, nothing charged.
    assert cost_micro_usd(price, 999_999, 0, 0) == 0
    assert cost_micro_usd(price, 1_000_000, 0, 0) == 1
    # Each part alone would floor to 0; the sum is floored once, so it costs 1.
    assert cost_micro_usd(price, 500_000, 0, 500_000) == 1
    assert cost_micro_usd(_price(1_999_999, 0, 0), 1, 0, 0) == 1


def test_cached_tokens_bill_at_the_cached_rate():
    price = _price(1_000_000, 0, 0)
    assert cost_micro_usd(price, 10, 10, 0) == 0
    assert cost_micro_usd(price, 10, 4, 0) == 6


@pytest.mark.parametrize("counts", [(-1, 0, 0), (1, -1, 0), (1, 0, -1), (1, 2, 0)])
def test_bad_token_counts_are_refused(counts):
    with pytest.raises(ValueError):
        cost_micro_usd(_price(1, 1, 1), *counts)


def test_current_price_is_the_latest_effective_one(make_session):
    now = datetime.now(UTC)
    with make_session.begin() as session:
        tenant = add_tenant(session)
        other = add_tenant(session)
        add_price(session, tenant, now - timedelta(days=30), input_per_mtok=100)
        add_price(session, tenant, now - timedelta(days=1), input_per_mtok=200)
        add_price(session, tenant, now + timedelta(days=1), input_per_mtok=300)
        add_price(session, other, now - timedelta(hours=1), input_per_mtok=999)
        tenant_id = tenant.id

    with make_session() as session:
        assert current_price(session, tenant_id).input_micro_usd_per_mtok == 200
        assert (
            current_price(session, tenant_id, now + timedelta(days=2)).input_micro_usd_per_mtok
            == 300
        )
        assert (
            current_price(session, tenant_id, now - timedelta(days=10)).input_micro_usd_per_mtok
            == 100
        )
        exactly = current_price(session, tenant_id, now - timedelta(days=1))
        assert exactly.input_micro_usd_per_mtok == 200
        assert current_price(session, tenant_id, now - timedelta(days=31)) is None


def test_a_tenant_without_prices_has_none(make_session):
    with make_session.begin() as session:
        tenant_id = add_tenant(session).id
    with make_session() as session:
        assert session.get(Tenant, tenant_id) is not None
        assert current_price(session, tenant_id) is None


def test_two_prices_cannot_start_at_the_same_moment(make_session):
    from sqlalchemy.exc import IntegrityError

    moment = datetime(2030, 1, 1, tzinfo=UTC)
    with make_session.begin() as session:
        tenant_id = add_price(session, add_tenant(session), moment).tenant_id
    with make_session() as session, pytest.raises(IntegrityError):
        add_price(session, session.get(Tenant, tenant_id), moment)
