"""The image helpers without a server: reading URLs within the limits, the prefix-cache keys,
the positions of a chunk, and the refusal to compute again what a server cannot."""

from __future__ import annotations

import base64
import os

import pytest
import torch

from pdserve.engine import images
from pdserve.engine.request import Req, SamplingParams
from pdserve.multimodal.images import ImageLimits, decode_image, load_images, read_image_bytes
from pdserve.multimodal.inputs import ImageInput
from tests.helpers.vision_checkpoints import data_url, png


def test_urls_are_read_within_the_limits(tmp_path):
    limits = ImageLimits(max_images=2, max_bytes=4000, max_pixels=40 * 40)
    good = png(32, 24, 1)
    assert decode_image(read_image_bytes(data_url(good), limits, "x"), limits, "x").size == (32, 24)
    with pytest.raises(ValueError, match="x: image larger than 4000 bytes"):
        read_image_bytes(data_url(png(64, 64, 2)), limits, "x")
    with pytest.raises(ValueError, match="x: 48x48 pixels, more than the 1600 allowed"):
        decode_image(png(48, 48, 3), ImageLimits(max_pixels=1600), "x")
    with pytest.raises(ValueError, match="images: 3 in one request, at most 2"):
        load_images([(data_url(good), "a")] * 3, limits)
    # file URLs only under the allowed folder, without escaping it
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.png").write_bytes(good)
    (tmp_path / "out.png").write_bytes(good)
    inside = ImageLimits(local_path=str(tmp_path / "in"))
    assert read_image_bytes(f"file://{tmp_path}/in/a.png", inside, "f") == good
    with pytest.raises(ValueError, match="outside --allowed-local-media-path"):
        read_image_bytes(f"file://{tmp_path}/in/../out.png", inside, "f")
    os.symlink(tmp_path / "out.png", tmp_path / "in" / "link.png")
    with pytest.raises(ValueError, match="outside --allowed-local-media-path"):
        read_image_bytes(f"file://{tmp_path}/in/link.png", inside, "f")
    with pytest.raises(ValueError, match="file URLs are off"):
        read_image_bytes(f"file://{tmp_path}/in/a.png", ImageLimits(), "f")
    bare = "data:;base64," + base64.b64encode(good).decode()  # /generate's bare base64
    assert read_image_bytes(bare, limits, "g") == good


def _image(offset: int, tokens: int, digest: str, pixels=b"\0" * 4) -> ImageInput:
    return ImageInput(
        offset=offset, tokens=tokens, grid=[1, 2, 2 * tokens], digest=digest, pixels=pixels
    )


def test_cache_keys_stand_for_the_image():
    a, b = _image(1, 2, "ab" * 32), _image(1, 2, "cd" * 32)
    assert a.cache_key < 0 and -(2**31) <= a.cache_key and a.cache_key != b.cache_key
    req = Req(rid="r", input_ids=[5, 9, 9, 6], sampling=SamplingParams(), images=[a])
    assert req.cache_ids == [5, a.cache_key, a.cache_key, 6]
    assert req.input_ids == [5, 9, 9, 6]  # the prompt itself keeps the image token


def test_positions_of_a_chunk_past_and_inside_the_prompt():
    req = Req(rid="r", input_ids=[0] * 6, sampling=SamplingParams(), images=[_image(2, 2, "0")])
    req.rope_positions = torch.tensor([[0, 1, 2, 2, 4, 5], [0, 1, 2, 3, 4, 5], [0, 1, 2, 2, 4, 5]])
    req.rope_delta = -1
    pos, three = images.positions(req, 1, 2)  # covers the image's first token
    assert pos == [1, 2] and three.tolist() == [[1, 2], [1, 2], [1, 2]]
    pos, three = images.positions(req, 4, 4)  # the prompt's end and two generated tokens
    assert pos == [4, 5, 5, 6] and three is None


def test_a_preempted_request_without_a_tower_is_refused_not_crashed():
    class NoTower:
        visual = None

    req = Req(rid="r", input_ids=[0] * 8, sampling=SamplingParams(), images=[_image(2, 4, "0")])
    req.kv_len = 4  # the cached prefix ends inside the image
    assert "cannot compute its images again" in images.unavailable(req, NoTower())
    req.kv_len = 6  # past it: nothing to compute
    assert images.unavailable(req, NoTower()) is None
    req.kv_len, req.image_embeds = 0, {0: torch.zeros(4, 8)}  # an encoder's rows, kept
    assert images.unavailable(req, NoTower()) is None


def test_epd_messages_are_signed_with_the_secret():
    from pdserve.disagg.messages import AuthError, ProtocolError
    from pdserve.multimodal.epd_messages import EncodeDone, EpdCodec

    done = EncodeDone(room=7)
    signed, plain, other = EpdCodec("s"), EpdCodec(None), EpdCodec("t")
    assert signed.read(signed.frames(done)) == done
    assert plain.read(plain.frames(done)) == done
    with pytest.raises(AuthError, match="unsigned"):
        signed.read(plain.frames(done))
    with pytest.raises(AuthError, match="bad HMAC"):
        signed.read(other.frames(done))
    frames = signed.frames(done)
    with pytest.raises(AuthError, match="bad HMAC"):
        signed.read([frames[0][:-1] + b"\x08", frames[1]])  # tampered
    with pytest.raises(ProtocolError, match="malformed"):
        plain.read([b"\xc1"])
