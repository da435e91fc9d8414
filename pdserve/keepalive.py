"""How long idle HTTP connections live, on both ends.

A client that pools connections (pdserve's router, sglang-router) reuses an idle one for its next
request. If the server closed that connection first, the request races the close and fails with
"Server disconnected" although nothing is wrong. So the server keeps an idle connection open
longer than any client pool keeps it: the client always closes first.
"""

# pdserve's router closes its idle connections to the servers after this
CLIENT_IDLE_S = 30
# pdserve's servers and router close an idle connection after this: above CLIENT_IDLE_S and above
# the 90 s idle timeout of reqwest's pool (sglang-router's HTTP client)
SERVER_IDLE_S = 120
