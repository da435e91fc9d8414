"""httpx for the tests' calls to local servers, with one SSL context for every client.

httpx builds an SSL context for each client it makes (`httpx.post` and the like make one per
call): it loads certifi's CA bundle, about 38 ms of CPU each time, and the suite makes thousands of
calls, all to plain http:// URLs. These are httpx's own functions and client with the context
built once here (it still verifies, should a test ever reach an https:// URL)."""

from __future__ import annotations

import functools
import ssl

import httpx

CONTEXT = ssl.create_default_context()

Client = functools.partial(httpx.Client, verify=CONTEXT)
get = functools.partial(httpx.get, verify=CONTEXT)
post = functools.partial(httpx.post, verify=CONTEXT)
put = functools.partial(httpx.put, verify=CONTEXT)
delete = functools.partial(httpx.delete, verify=CONTEXT)
request = functools.partial(httpx.request, verify=CONTEXT)
stream = functools.partial(httpx.stream, verify=CONTEXT)
