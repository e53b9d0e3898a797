"""A client's round trip into kvtier running in containers, from the host.

    python docker/roundtrip.py server ADDR [--token T --ca FILE]
    python docker/roundtrip.py cluster ADDR [NODES] [--keep]
    python docker/roundtrip.py moved ADDR DRAINED NODE:SEQUENCE...

`server`: create a sequence, put a layer's prefill, fetch it back bit-exact,
select a decode step's pages, drop it. `cluster`: the same through
`kvtier.Cluster` (membership learnt from the node at ADDR), for enough
sequences that each of the NODES members owns at least one (with
`--keep`, one per node stays). `moved`: after DRAINED was drained, each kept
sequence reads back bit-exact from another node. Prints one line per check;
exits non-zero on any difference.
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
    if args.keep:
        # One sequence per node stays, for `moved` after a drain.
        kept = set(owners.values())
        for i in range(64):
            if f"roundtrip-{i}" not in kept:
                try:
                    c.drop(f"roundtrip-{i}")
                except kvtier.errors.NotFound:
                    pass
        print(f"cluster round trip through {args.addr}: each of {sorted(owners)} owns and serves a sequence: ok "
              f"(kept {', '.join(f'{n}:{s}' for n, s in sorted(owners.items()))})")
        return
    for i in range(64):
        try:
            c.drop(f"roundtrip-{i}")
        except kvtier.errors.NotFound:
            pass
    print(f"cluster round trip through {args.addr}: each of {sorted(owners)} owns and serves a sequence: ok")


def moved(args: argparse.Namespace) -> None:
    """After a drain: every kept sequence reads back bit-exact from a node
    other than the drained one."""
    c = kvtier.Cluster([args.addr])
    for i, item in enumerate(sorted(args.kept)):
        node, seq = item.split(":")
        k, v = kv(10 + i, 10), kv(11 + i, 10)
        pages = c.call(seq, lambda client: client.fetch(seq, 1))
        for head in range(2):
            got_k = np.concatenate([p.k for p in pages if p.kv_head == head])
            got_v = np.concatenate([p.v for p in pages if p.kv_head == head])
            if not (np.array_equal(got_k, k[head]) and np.array_equal(got_v, v[head])):
                sys.exit(f"{seq} (was on {node}): rows differ after the drain (kv head {head})")
        owner = c.client(seq).call("GetCluster", {})["node_id"]
        if owner == args.drained:
            sys.exit(f"{seq} is still on the drained node {owner}")
        print(f"docker: {seq} (was on {node}) served bit-exact by {owner} after the drain")


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
    many.add_argument("--keep", action="store_true", help="keep one sequence per node and print them")
    after = sub.add_parser("moved")
    after.add_argument("addr")
    after.add_argument("drained")
    after.add_argument("kept", nargs="+", help="node:sequence, as cluster --keep printed them")
    args = parser.parse_args()
    {"server": server, "cluster": cluster, "moved": moved}[args.mode](args)


if __name__ == "__main__":
    main()
