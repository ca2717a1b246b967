"""The arithmetic of the int4 and topk codecs (engine/codecs.py, docs/protocol.md "Tensors").

int4: blockwise absmax like int8, with codes -7..7 (scale = absmax / 7) stored as code + 8, two to a byte,
the first element of a pair in the low nibble (a padding nibble is 8, a zero).

topk: per block of `block_size` elements of the flattened tensor, the `keep` largest magnitudes (ties to the
lower index; a partial last block keeps min(keep, its length)), their offsets within the block as int16 in
increasing order, and their values as int8 with one absmax scale per block (int8's quantisation over the
kept values, `keep` of them a block). Per block rather than per tensor so that indices take two bytes and
every part of a tensor is represented; what is dropped is carried forward by error feedback.
"""

from __future__ import annotations

import torch
from torch import Tensor

INT4_LEVEL = 7
NIBBLE_ZERO = 8
MAX_TOPK_BLOCK = 1 << 15  # offsets within a block travel as int16


def pack_nibbles(codes: Tensor) -> Tensor:
    """int8 codes in -8..7 (any shape) as uint8 bytes of two codes each, padded with a zero code."""
    flat = (codes.reshape(-1).to(torch.int16) + NIBBLE_ZERO).to(torch.uint8)
    if flat.numel() % 2:
        flat = torch.cat([flat, torch.tensor([NIBBLE_ZERO], dtype=torch.uint8)])
    return flat[0::2] | (flat[1::2] << 4)


def unpack_nibbles_into(packed: Tensor, out: Tensor) -> Tensor:
    """`out` (float32, 2 * len(packed) elements, contiguous) filled with the codes of `packed`."""
    pairs, flat = out.view(-1, 2), packed.reshape(-1)
    pairs[:, 0].copy_(flat & 15)
    pairs[:, 1].copy_(flat >> 4)
    return out.sub_(NIBBLE_ZERO)


def topk_select(x: Tensor, block_size: int, keep: int) -> tuple[Tensor, Tensor]:
    """(int16 offsets within their blocks, float32 values) of the `keep` largest magnitudes per block,
    block after block, offsets increasing within each."""
    flat = x.detach().float().reshape(-1)
    full = flat.numel() // block_size
    parts = [_select_rows(flat[: full * block_size].view(full, block_size), keep)]
    rest = flat[full * block_size :]
    if rest.numel():
        parts.append(_select_rows(rest.view(1, -1), min(keep, rest.numel())))
    offsets = torch.cat([offset.reshape(-1) for offset, _ in parts])
    return offsets.to(torch.int16), torch.cat([values.reshape(-1) for _, values in parts])


def _select_rows(rows: Tensor, keep: int) -> tuple[Tensor, Tensor]:
    # A stable descending sort keeps equal magnitudes in index order: the same choice codecs.js makes.
    order = torch.sort(rows.abs(), dim=1, descending=True, stable=True).indices[:, :keep]
    offsets = order.sort(dim=1).values
    return offsets, rows.gather(1, offsets)


def topk_positions(offsets: Tensor, block_size: int, keep: int) -> Tensor:
    """Flat positions (int64) of a topk tensor's values, from their offsets within the blocks."""
    blocks = torch.arange(offsets.numel()) // keep
    return blocks * block_size + offsets.to(torch.int64)


def topk_count(elements: int, block_size: int, keep: int) -> int:
    """How many values a tensor of `elements` keeps."""
    full, rest = divmod(elements, block_size)
    return full * keep + min(keep, rest)


def topk_offsets_valid(offsets: Tensor, elements: int, block_size: int, keep: int) -> bool:
    """Every offset within its block and strictly increasing there (so no position twice)."""
    full, rest = divmod(elements, block_size)
    local = offsets.to(torch.int32)
    head, tail = local[: full * keep].view(full, keep), local[full * keep :]
    return _increasing_below(head, block_size) and _increasing_below(tail.view(1, -1), rest)


def _increasing_below(rows: Tensor, bound: int) -> bool:
    if not rows.numel():
        return True
    if bool((rows < 0).any()) or bool((rows >= bound).any()):
        return False
    return rows.shape[1] < 2 or bool((rows.diff(dim=1) > 0).all())
