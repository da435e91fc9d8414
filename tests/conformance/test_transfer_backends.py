"""The full-protocol transfer scenarios (transfer_suite.py) against every backend: local, mooncake
and nixl (the ``backend`` fixture in conftest.py). The rest of the conformance suite:
test_backend_api.py (the backend contract in one process), test_transfer_scenarios.py (a 4096-page
transfer, peers dying mid-transfer), test_bench_transfer.py.

Each backend is skipped (with the reason) when its module or library is not installed.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import transfer_suite as suite  # noqa: E402

protocol_run = suite.protocol_run
test_pages_and_aux_byte_exact = suite.test_pages_and_aux_byte_exact
test_32_rooms_in_flight = suite.test_32_rooms_in_flight
test_decode_shared_memory_released = suite.test_decode_shared_memory_released
test_two_cache_groups_byte_exact = suite.test_two_cache_groups_byte_exact
test_incompatible_page_size_fails_with_both_values = (
    suite.test_incompatible_page_size_fails_with_both_values
)
test_prefill_failures_and_aborts = suite.test_prefill_failures_and_aborts
test_dead_prefill_detected_by_heartbeat = suite.test_dead_prefill_detected_by_heartbeat
test_head_window_and_replicated_regions_byte_exact = (
    suite.test_head_window_and_replicated_regions_byte_exact
)
test_compressed_entries_on_every_other_page_byte_exact = (
    suite.test_compressed_entries_on_every_other_page_byte_exact
)
