"""Tiers below the KV pool (SGLang's hierarchical cache): host memory, then disk or a store."""
