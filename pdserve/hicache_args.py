"""The hierarchical-cache server arguments (SGLang's flags, fields of ``ServerArgs``) and their
check at start-up; the tiers themselves are ``engine/kv_tier``. What needs the model (its cache
kinds) is checked when the tiers are built."""

from __future__ import annotations

from typing import Callable

HICACHE_WRITE_POLICIES = ("write_back", "write_through")
# SGLang's other policies, refused by name
HICACHE_WRITE_POLICIES_NOT_BUILT = ("write_through_selective",)


def check_hicache_args(args, bad: Callable[[str, str], None]) -> None:
    from pdserve.engine.kv_tier.base import registered_backends

    if args.hicache_write_policy in HICACHE_WRITE_POLICIES_NOT_BUILT:
        bad(
            "hicache_write_policy",
            f"{args.hicache_write_policy!r} is not supported in this version; use one of "
            f"{HICACHE_WRITE_POLICIES}",
        )
    if args.hicache_write_policy not in HICACHE_WRITE_POLICIES:
        bad(
            "hicache_write_policy",
            f"must be one of {HICACHE_WRITE_POLICIES}, got {args.hicache_write_policy!r}",
        )
    if not args.hicache_ratio > 0:
        bad(
            "hicache_ratio",
            f"must be > 0 (host tier pages per pool page), got {args.hicache_ratio}",
        )
    if args.hicache_size < 0:
        bad(
            "hicache_size",
            f"must be >= 0 GB (0: sized by --hicache-ratio), got {args.hicache_size}",
        )
    if not args.hicache_file_backend_max_gb >= 0:
        bad(
            "hicache_file_backend_max_gb",
            f"must be >= 0 GB (0: half the free space of its filesystem), got "
            f"{args.hicache_file_backend_max_gb}",
        )
    if args.hicache_storage_write_queue < 1:
        bad("hicache_storage_write_queue", f"must be >= 1, got {args.hicache_storage_write_queue}")
    backend = args.hicache_storage_backend
    if backend is not None and backend not in registered_backends():
        bad(
            "hicache_storage_backend",
            f"unknown {backend!r}; available: {', '.join(registered_backends())}",
        )
    if backend == "mooncake":
        from pdserve.engine.kv_tier.mooncake_config import check_args

        check_args(args, bad)
    if not args.enable_hierarchical_cache:
        if backend is not None:
            bad("hicache_storage_backend", "needs --enable-hierarchical-cache")
        return
    if args.disable_radix_cache:
        bad(
            "enable_hierarchical_cache",
            "the tiers extend the prefix cache: drop --disable-radix-cache",
        )
    if args.disaggregation_mode == "decode" and not args.disaggregation_decode_enable_radix_cache:
        bad(
            "enable_hierarchical_cache",
            "a decode server keeps a prefix cache only with "
            "--disaggregation-decode-enable-radix-cache; add it",
        )
    # TP and DP ranks each keep their own tiers and agree on what they load (KVTier.fill);
    # pipeline stages are not served yet
    if args.pp_size != 1:
        bad(
            "enable_hierarchical_cache",
            f"pipeline stages are not served in this version, got --pp-size {args.pp_size}",
        )
    if args.speculative_algorithm not in (None, "NGRAM"):
        bad(
            "enable_hierarchical_cache",
            f"--speculative-algorithm {args.speculative_algorithm}: the draft model's KV would "
            "not come back from the tiers; use NGRAM or no speculation",
        )
    if args.enable_return_routed_experts:
        bad(
            "enable_hierarchical_cache",
            "--enable-return-routed-experts: the routed expert ids of a page do not go to the "
            "tiers",
        )
