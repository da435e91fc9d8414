"""Prefill/decode disaggregation: the KV transfer layer and its control plane.

- ``poll``: ``KVPoll`` states, ``poll_and_all_reduce``
- ``kv_args``: ``KVArgs`` (what a rank registers) and compatibility rules
- ``messages``: typed, versioned decode <-> prefill control messages
- ``bootstrap``: the prefill instance's HTTP registry and its client
- ``metadata``: ``MetadataBuffers`` (first token, logprobs, room) and ``SlotAllocator``
- ``manager`` / ``sender`` / ``receiver``: ``KVManager``, ``KVSender``, ``KVReceiver``,
  ``get_kv_class``, ``buffer_allocator``; ``fake``: the no-protocol variants
- ``transfer``: the data-moving backends (local, fake; mooncake, nixl)
"""


def __getattr__(name):
    # Lazy: importing pdserve.disagg must not start anything or pull optional dependencies.
    if name in ("KVManager", "get_kv_class", "buffer_allocator"):
        from pdserve.disagg import manager

        return getattr(manager, name)
    if name == "KVPoll":
        from pdserve.disagg.poll import KVPoll

        return KVPoll
    raise AttributeError(name)
