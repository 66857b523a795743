"""copy_pieces in the interpreter: pieces of a flat buffer land bit for bit in strided views of
several tensors, nothing else is touched, bad inputs are refused."""

import pytest
import torch

from detlora.ops.copy_pieces import CHUNK, copy_pieces, copy_pieces_ref, piece_table


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pieces_land_in_their_views(dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.full((3, 2, 8, 40), float("nan"), dtype=dtype)  # like lora_a [slots, S, R, in]
    b = torch.full((3, 90, 8), float("nan"), dtype=dtype)  # like lora_b [slots, out, R]
    scale = torch.full((3,), float("nan"), dtype=dtype)
    big = torch.full((CHUNK + 7, 2), float("nan"), dtype=dtype)  # more than one chunk
    views = [a[1, 0, :5], a[1, 1, :3], b[1, 10:70, :5], b[1, 70:90, :3], b[2, :1, :1],
             scale[2:3].view(1, 1), big[:, :1]]
    pieces, at = [], 0
    for v in views:
        pieces.append((at, v))
        at += v.numel()
    src = torch.randn(at + 11, generator=g).to(dtype)
    ref = [t.clone() for t in (a, b, scale, big)]
    ref_views = [ref[0][1, 0, :5], ref[0][1, 1, :3], ref[1][1, 10:70, :5],
                 ref[1][1, 70:90, :3], ref[1][2, :1, :1], ref[2][2:3].view(1, 1),
                 ref[3][:, :1]]
    copy_pieces_ref(src, [(o, v) for (o, _), v in zip(pieces, ref_views, strict=True)])
    table, chunks = piece_table(pieces, src.device)
    assert chunks == 2
    copy_pieces(src, table, chunks, views)
    # Every tensor equals the reference's, the untouched NaNs included (equal_nan).
    for got, want in zip((a, b, scale, big), ref, strict=True):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
        assert torch.equal(got.isnan(), want.isnan())


def test_one_table_serves_every_slot():
    """Views given in slot 0 with their slot strides land in the slot asked for, and nothing
    else changes."""
    g = torch.Generator().manual_seed(1)
    a = torch.full((4, 2, 8, 40), float("nan"))  # [slots, S, R, in]
    b = torch.full((4, 90, 8), float("nan"))  # [slots, out, R]
    views = [a[0, 1, :5], b[0, 10:70, :5]]
    strides = [a.stride(0), b.stride(0)]
    src = torch.randn(5 * 40 + 60 * 5, generator=g)
    table, chunks = piece_table([(0, views[0]), (200, views[1])], src.device, strides)
    for slot in (3, 1):
        want_a, want_b = a.clone(), b.clone()
        copy_pieces_ref(src, [(0, want_a[slot, 1, :5]), (200, want_b[slot, 10:70, :5])])
        copy_pieces(src, table, chunks, views, slot=slot)
        for got, want in ((a, want_a), (b, want_b)):
            assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
            assert torch.equal(got.isnan(), want.isnan())
    assert a[0].isnan().all() and b[2].isnan().all()


def test_bad_inputs():
    dst = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="unit column stride"):
        piece_table([(0, dst[:, ::2])], dst.device)
    with pytest.raises(ValueError, match="2-D"):
        piece_table([(0, dst[0])], dst.device)
    with pytest.raises(ValueError, match="offsets must be >= 0"):
        piece_table([(-1, dst)], dst.device)
    with pytest.raises(ValueError, match="2 slot strides for 1 pieces"):
        piece_table([(0, dst)], dst.device, [0, 0])
    with pytest.raises(ValueError, match="slot strides must be >= 0"):
        piece_table([(0, dst)], dst.device, [-4])
    table, chunks = piece_table([(0, dst)], dst.device)
    with pytest.raises(ValueError, match="slot must be an int >= 0"):
        copy_pieces(torch.zeros(16), table, chunks, slot=-1)
    with pytest.raises(ValueError, match="contiguous 1-D"):
        copy_pieces(torch.zeros(4, 4), table, chunks)
    with pytest.raises(ValueError, match="int64"):
        copy_pieces(torch.zeros(16), table.int(), chunks)
    with pytest.raises(ValueError, match=r"destination is torch\.float16"):
        copy_pieces(torch.zeros(16), table, chunks, [dst.half()])
