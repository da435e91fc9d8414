"""Large transfers and peers dying mid-transfer, through the whole protocol, for every real
backend (``local``, ``mooncake``, ``nixl``). A backend whose library is not installed is skipped
with the reason."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import transfer_suite as suite  # noqa: E402

test_large_transfer_lands_before_its_metadata_row = (
    suite.test_large_transfer_lands_before_its_metadata_row
)
test_prefill_dies_mid_transfer = suite.test_prefill_dies_mid_transfer
test_decode_dies_mid_transfer = suite.test_decode_dies_mid_transfer
