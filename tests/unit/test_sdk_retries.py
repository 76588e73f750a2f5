"""Every refusal that carries Retry-After, judged by both SDKs' own retry rules (their `_should_retry` and
`_calculate_retry_timeout`, default settings): each either raises at once or is retried after a bounded sleep.

The gateway process end to end, with the SDKs' sleeps observed: tests/integration/test_sdk_refusals.py.
"""

from __future__ import annotations

import inspect

import anthropic
import httpx2
import openai
import pytest
from anthropic._models import FinalRequestOptions as AnthropicOptions
from openai._models import FinalRequestOptions as OpenAIOptions

from gateway import errors
from gateway.errors import GatewayError, RateLimitError, ServiceUnavailableError
from gateway.settings import Settings

pytestmark = pytest.mark.timeout(60)

SETTINGS = Settings()
# The longest sleep before a retry that is still worth it: a per-minute window's refill.
BOUND = SETTINGS.limits.window
# The longest Retry-After each refusal sends under the default settings, and whether a retry can cure it soon.
LONGEST: dict[str, tuple[float, bool]] = {
    "RateLimitError": (SETTINGS.limits.window, True),  # requests, tokens or concurrency per minute
    "QuotaExceededError": (31 * 24 * 3600, False),  # a monthly budget refills at the month's end
    "AddressBlockedError": (SETTINGS.auth.failed_auth_block, False),
    "RequestOverLimitError": (SETTINGS.limits.window, False),  # no window lets it pass
    "EngineQueueFullError": (SETTINGS.admission.max_retry_after, True),
    "ServiceUnavailableError": (SETTINGS.relay.retry_after, True),  # the stream ended by a shutdown
    "EngineBusyError": (SETTINGS.admission.max_retry_after, True),
    "EngineUnavailableError": (SETTINGS.relay.retry_after, True),
    "EngineRefusedError": (SETTINGS.relay.retry_after, True),
    "EngineConnectionLostError": (SETTINGS.relay.retry_after, True),
    "KeyStoreUnavailableError": (1, True),
    "OverloadedError": (1, True),
    "EngineProtocolError": (SETTINGS.relay.retry_after, True),
    "EngineCredentialsError": (SETTINGS.relay.retry_after, False),  # the operator's engine key
    "EngineTimeoutError": (SETTINGS.relay.retry_after, True),
}


def _refusals() -> list[type[GatewayError]]:
    return [
        cls
        for name, cls in vars(errors).items()
        if inspect.isclass(cls) and issubclass(cls, RateLimitError | ServiceUnavailableError) and name[0] != "_"
    ]


def test_every_refusal_with_retry_after_has_a_decision() -> None:
    assert {cls.__name__ for cls in _refusals()} == set(LONGEST)


@pytest.mark.parametrize("cls", _refusals(), ids=lambda c: c.__name__)
def test_both_sdks_raise_at_once_or_retry_within_the_bound(cls: type[GatewayError]) -> None:
    seconds, cured = LONGEST[cls.__name__]
    error = cls("refused", retry_after=seconds)  # type: ignore[call-arg]
    response = httpx2.Response(error.status_code, headers=error.headers)
    clients = (
        (openai.OpenAI(api_key="k", base_url="http://127.0.0.1:9"), OpenAIOptions.construct(method="post", url="/x")),
        (
            anthropic.Anthropic(api_key="k", base_url="http://127.0.0.1:9"),
            AnthropicOptions.construct(method="post", url="/x"),
        ),
    )
    for client, options in clients:
        with client:
            retried = client._should_retry(response)
            assert retried is cured, (type(client).__name__, dict(response.headers))
            if retried:
                for remaining in range(client.max_retries, 0, -1):
                    sleep = client._calculate_retry_timeout(remaining, options, response.headers)  # type: ignore[arg-type]
                    assert 0 < sleep <= BOUND, (type(client).__name__, sleep)
