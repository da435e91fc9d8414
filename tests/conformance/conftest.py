"""The transfer backends every conformance scenario runs against; one whose library is not
installed here is skipped with the reason."""

import pytest

from pdserve.disagg.transfer import get_backend


@pytest.fixture(scope="module", params=["local", "mooncake", "nixl"])
def backend(request):
    try:
        get_backend(request.param)
    except ValueError as e:
        pytest.skip(str(e))
    return request.param
