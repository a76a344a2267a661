"""Every route, fuzzed from the server's own OpenAPI schema: no request gets a server error.

schemathesis draws requests (valid and invalid bodies, parameters and headers) for each
operation of `/openapi.json`; each is sent to a running server, which must answer below 500.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.server.conftest import RunningServer

pytestmark = pytest.mark.slow  # a few hundred requests


@pytest.mark.parametrize("served", ["toy_server", "llama_server"])
def test_no_request_gets_a_server_error(served: str, request: pytest.FixtureRequest) -> None:
    server: RunningServer = request.getfixturevalue(served)
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {
        "/v1/chat/completions",
        "/generate",
        "/v1/audio/speech",
    }
    statuses: dict[int, int] = {}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        def fuzz(case: schemathesis.Case) -> None:
            response = case.call(timeout=60)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, (
                case.method,
                case.path,
                response.status_code,
                response.text[:300],
            )

        fuzz()
    # Requests reached the routes: some were served, many refused as the client's fault.
    assert (
        statuses.get(200, 0) > 0 and sum(n for code, n in statuses.items() if 400 <= code < 500) > 0
    ), statuses
