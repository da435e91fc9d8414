"""LoRA adapters served over one base model (``--enable-lora``), many in one batch.

- ``adapter.py``: a PEFT adapter directory read and checked (its targets, rank, scaling);
- ``layer.py``: the delta a linear layer adds for each adapter's rows of a forward, and the
  forward's rows per adapter;
- ``manager.py``: the adapters a scheduler rank holds, each sharded like the base weights it
  adapts, loaded and unloaded at run time.

A request names its adapter (``lora_path`` in ``/generate``, the adapter's name as the OpenAI
``model``); its KV belongs to the adapter, so the prefix cache keeps each adapter's prefixes in a
namespace of their own, keyed by the adapter's contents (the same adapter on another server, or
loaded again, keys the same)."""
