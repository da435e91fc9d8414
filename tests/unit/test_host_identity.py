"""The ``local`` transfer backend pairs only processes on one host (one kernel boot, one network
namespace), and ``pdserve launch`` picks a network backend when its servers listen beyond
loopback. Across real namespaces: tests/e2e/test_netns.py."""

from __future__ import annotations

import pytest
import torch

from pdserve.disagg.transfer import get_backend
from pdserve.disagg.transfer.base import TransferError
from pdserve.disagg.transfer.local import LocalBackend, shm_allocator
from pdserve.host import host_identity
from pdserve.server.cluster import transfer_backend_for


def _decode_and_prefill() -> tuple[LocalBackend, LocalBackend, torch.Tensor]:
    buf = shm_allocator(4096, torch.device("cpu"))
    region = [(buf.data_ptr(), buf.numel())]
    decode = LocalBackend("decode")
    decode.register_regions(region)
    prefill = LocalBackend("prefill")
    return decode, prefill, buf


def test_host_identity_is_boot_id_and_network_namespace():
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    assert host_identity().split("/")[0] == boot
    assert host_identity() == host_identity()


def test_local_backend_attaches_on_one_host():
    decode, prefill, buf = _decode_and_prefill()
    try:
        info = decode.describe()
        assert info["host"] == host_identity()
        prefill.connect("d", info, [(buf.data_ptr(), buf.numel())])
        prefill.disconnect("d")
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("other", ["another-boot/4026531840", None])
def test_local_backend_refuses_a_decode_on_another_host_naming_the_backend_to_use(other):
    decode, prefill, buf = _decode_and_prefill()
    try:
        info = {**decode.describe(), "host": other}
        with pytest.raises(TransferError) as e:
            prefill.connect("d", info, [(buf.data_ptr(), buf.numel())])
        msg = str(e.value)
        assert (
            "one host" in msg
            and "--disaggregation-transfer-backend mooncake" in msg
            and "nixl" in msg
        ), msg
    finally:
        prefill.close()
        decode.close()


def test_launch_backend_rule():
    assert transfer_backend_for("127.0.0.1", None) == "local"
    assert transfer_backend_for("localhost", None) == "local"
    assert transfer_backend_for("::1", None) == "local"
    assert transfer_backend_for("10.0.0.5", "local") == "local"  # an explicit choice wins
    usable = []
    for name in ("mooncake", "nixl"):
        try:
            get_backend(name)
            usable.append(name)
        except ValueError:
            pass
    want = usable[0] if usable else "local"
    assert transfer_backend_for("10.0.0.5", None) == want
    assert transfer_backend_for("0.0.0.0", None) == want
