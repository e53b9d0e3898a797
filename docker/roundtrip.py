"""A client's round trip into kvtier running in containers, from the host.

    python docker/roundtrip.py server ADDR [--token T --ca FILE]
    python docker/roundtrip.py cluster ADDR [NODES]

`server`: create a sequence, put a layer's prefill, fetch it back bit-exact,
select a decode step's pages, drop it. `cluster`: the same through
`kvtier.Cluster` (membership learnt from the node at ADDR), for enough
sequences that each of the NODES members owns at least one. Prints one line
per check; exits non-zero on any difference.
"""

import argparse
import sys

import numpy as np

import kvtier

LAYOUT = kvtier.Layout(num_layers=2, num_kv_heads=2, num_query_heads=4, head_dim=8, dtype="f32", page_size=4)


def kv(seed: int, tokens: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, tokens, 8)).astype(np.float32)


def check(client: kvtier.Client, seq: str, seed: int) -> None:
    k, v = kv(seed, 10), kv(seed + 1, 10)
    client.put(seq, 1, k, v)
    pages = client.fetch(seq, 1)
    for head in range(2):
        got_k = np.concatenate([p.k for p in pages if p.kv_head == head])
        got_v = np.concatenate([p.v for p in pages if p.kv_head == head])
        if not (np.array_equal(got_k, k[head]) and np.array_equal(got_v, v[head])):
            sys.exit(f"{seq}: fetched rows differ from the rows put (kv head {head})")
    q = np.random.default_rng(seed).standard_normal((4, 8)).astype(np.float32)
    sel = client.select(seq, 1, q, budget_pages=2, sink_pages=1, window_pages=1)
    if not sel.pages:
        sys.exit(f"{seq}: a selection returned no pages")


def server(args: argparse.Namespace) -> None:
    ca = open(args.ca, "rb").read() if args.ca else None
    client = kvtier.Client(args.addr, token=args.token, tls_ca=ca, tenant="a" if args.token else "")
    client.create("roundtrip", LAYOUT)
    check(client, "roundtrip", 1)
    client.drop("roundtrip")
    print(f"round trip into {args.addr}: create, put, fetch (bit-exact), select, drop: ok")


def cluster(args: argparse.Namespace) -> None:
    c = kvtier.Cluster([args.addr])
    owners = {}
    for i in range(64):
        seq = f"roundtrip-{i}"
        placed = c.create(seq, LAYOUT)
        owners.setdefault(placed["node_id"], seq)
        if len(owners) == args.nodes:
            break
    if len(owners) != args.nodes:
        sys.exit(f"sequences landed on {sorted(owners)} only, {args.nodes} nodes expected")
    for i, (node, seq) in enumerate(sorted(owners.items())):
        check(c.client(seq), seq, 10 + i)
    for i in range(64):
        try:
            c.drop(f"roundtrip-{i}")
        except kvtier.errors.NotFound:
            pass
    print(f"cluster round trip through {args.addr}: each of {sorted(owners)} owns and serves a sequence: ok")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    one = sub.add_parser("server")
    one.add_argument("addr")
    one.add_argument("--token")
    one.add_argument("--ca")
    many = sub.add_parser("cluster")
    many.add_argument("addr")
    many.add_argument("nodes", type=int, nargs="?", default=3)
    args = parser.parse_args()
    server(args) if args.mode == "server" else cluster(args)


if __name__ == "__main__":
    main()
