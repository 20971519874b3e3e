"""Fixtures of the integration tier: ``connect`` runs a client test on both libraries."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from clientkit import CLIENT_KINDS, AnyClient, connect


@pytest.fixture(params=CLIENT_KINDS)
def client_kind(request: pytest.FixtureRequest) -> str:
    """``"sync"`` (``broker.client.Client``) or ``"async"`` (``AsyncClient``, driven by
    ``clientkit.BlockingAsyncClient``)."""
    kind: str = request.param
    return kind


@pytest.fixture
def connect_client(client_kind: Any) -> Callable[..., AnyClient]:
    """``connect_client(endpoint, **kwargs)``: a client of this test's kind."""

    def factory(endpoint: str, **kwargs: Any) -> AnyClient:
        return connect(client_kind, endpoint, **kwargs)

    return factory
