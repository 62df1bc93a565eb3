"""Packing a mixed step's tokens into query tiles for attention.

Attending token by token gathers a request's context once per query token; a tile of
`query_tile` consecutive tokens of one request gathers it once and attends with two
matmuls. A tiled bucket has t / query_tile tiles and r single-token slots:

    tokens       | r0: chunk of 70       | r1 | r2 | r3: chunk of 40 |
    tiles        | r0[0:32] | r0[32:64]  |         | r3[0:32]  | r3[32:40] + padding |
    single slots |                 r0[64:70]  r1  r2                                 |

Each request's whole tiles come first; the leftover tokens of the requests with the
longest leftovers fill the remaining tiles, and the rest attend as single tokens. A step
that needs more single slots than the bucket has does not fit it (`fits`).

Outputs are gathered back into token order through `token_slot`, an index into the
concatenation [single-token outputs ; tile outputs (tile-major)].
"""

from __future__ import annotations

import numpy as np

from neuron_serve.buckets import Bucket


def _leftover_in_tiles(num_scheduled: np.ndarray, query_tile: int, num_tiles: int) -> np.ndarray | None:
    """Per request: True if its leftover tokens get a tile; None if even the whole tiles
    do not fit."""
    free = num_tiles - int((num_scheduled // query_tile).sum())
    if free < 0:
        return None
    leftover = num_scheduled % query_tile
    longest_first = np.argsort(-leftover, kind="stable")[:free]
    in_tiles = np.zeros(len(num_scheduled), dtype=bool)
    in_tiles[longest_first] = leftover[longest_first] > 0
    return in_tiles


def fits(num_scheduled: np.ndarray, bucket: Bucket) -> bool:
    in_tiles = _leftover_in_tiles(num_scheduled, bucket.query_tile, bucket.num_tiles)
    if in_tiles is None:
        return False
    singles = int((num_scheduled % bucket.query_tile)[~in_tiles].sum())
    return singles <= bucket.single_token_slots


def pack(num_scheduled: np.ndarray, bucket: Bucket) -> dict[str, np.ndarray]:
    """Unpadded tile arrays of a step that `fits` the bucket: tile_token [tiles, query_tile]
    (token indices, 0 in padding rows), tile_req [tiles], single_token [singles] and
    token_slot [tokens]."""
    q = bucket.query_tile
    in_tiles = _leftover_in_tiles(num_scheduled, q, bucket.num_tiles)
    tiles_per_req = num_scheduled // q + in_tiles
    ends = np.cumsum(num_scheduled)
    starts = ends - num_scheduled
    tile_req = np.repeat(np.arange(len(num_scheduled)), tiles_per_req)
    first_tile = np.cumsum(tiles_per_req) - tiles_per_req
    tile_token = (starts[tile_req] + (np.arange(len(tile_req)) - first_tile[tile_req]) * q)[:, None] \
        + np.arange(q)
    in_request = tile_token < ends[tile_req][:, None]

    num_tokens = int(ends[-1]) if len(ends) else 0
    token_req = np.repeat(np.arange(len(num_scheduled)), num_scheduled)
    single = np.arange(num_tokens) - starts[token_req] >= tiles_per_req[token_req] * q
    single_token = np.flatnonzero(single)
    token_slot = np.empty(num_tokens, dtype=np.int64)
    token_slot[single_token] = np.arange(len(single_token))
    token_slot[tile_token[in_request]] = bucket.single_token_slots + np.flatnonzero(in_request)
    return {"tile_token": np.where(in_request, tile_token, 0), "tile_req": tile_req,
            "single_token": single_token, "token_slot": token_slot}
