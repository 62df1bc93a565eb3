"""`neuron-serve buckets suggest`: the bucket set that pads a request-length trace least."""

from __future__ import annotations

import argparse
import json
import math

from neuron_serve import buckets as bk
from neuron_serve.bucket_planner import demand, evaluate, read_trace, suggest
from neuron_serve.cli.engine import SERVE_DEFAULTS, int_list


def add_parser(subparsers) -> None:
    buckets = subparsers.add_parser("buckets", help="plan bucket sets")
    actions = buckets.add_subparsers(dest="action", required=True)
    suggest = actions.add_parser(
        "suggest", help="the bucket set that pads a request-length trace least",
        description="Read a JSONL trace ({\"prompt_tokens\": P, \"output_tokens\": O} per "
                    "line) and propose the bucket set with the fewest padded tokens within "
                    "--max-graphs graphs, next to the default set's waste.")
    suggest.add_argument("--trace", required=True)
    suggest.add_argument("--max-graphs", type=int, required=True)
    suggest.add_argument("--max-num-seqs", type=int, default=SERVE_DEFAULTS["max_num_seqs"])
    suggest.add_argument("--max-num-batched-tokens", type=int,
                         default=SERVE_DEFAULTS["max_num_batched_tokens"])
    suggest.add_argument("--max-model-len", type=int, required=True)
    suggest.add_argument("--block-size", type=int, default=32)
    suggest.add_argument("--request-buckets", type=int_list, default=None)


def run(args: argparse.Namespace) -> int:
    """`neuron-serve buckets suggest`: print the default set's waste, the proposal's, and
    the flag that selects the proposal."""
    max_blocks = math.ceil(args.max_model_len / args.block_size)
    requests = args.request_buckets or bk.default_request_buckets(args.max_num_seqs)
    d = demand(read_trace(args.trace), args.max_num_batched_tokens, args.block_size,
               args.max_model_len)
    default = evaluate(d, bk.default_token_buckets(args.max_num_batched_tokens, args.max_num_seqs), requests,
                       bk.default_block_buckets(max_blocks), args.block_size)
    proposal = suggest(d, requests, args.max_graphs, args.max_num_batched_tokens, max_blocks,
                       args.block_size)
    for name, plan in (("default", default), ("proposal", proposal)):
        print(f"{name:<9} token {plan.token_buckets} request {plan.request_buckets} block "
              f"{plan.block_buckets}: {plan.num_graphs} graphs, {plan.padded_tokens} padded "
              f"tokens, waste {plan.waste_ratio:.1%}")
    section = {"token_buckets": proposal.token_buckets, "request_buckets": proposal.request_buckets,
               "block_buckets": proposal.block_buckets}
    print("use: --additional-config '" + json.dumps({"neuron": section}) + "'")
    return 0
