#![warn(missing_docs)]
//! Generated gRPC types and stubs for `kvtier.v1` (see `proto/kvtier/v1/kvtier.proto`).

pub mod codec;

/// The `kvtier.v1` API: every message, enum and the `KvTier` and `Cluster`
/// services, documented by the proto's own comments.
#[allow(missing_debug_implementations, unreachable_pub, clippy::all, clippy::pedantic)]
pub mod v1 {
    tonic::include_proto!("kvtier.v1");

    /// The `KvTier` service's methods, in the proto's order (checked
    /// against the descriptor by a test in `kvtier-server`).
    pub const METHODS: [&str; 18] = [
        "CreateSequence",
        "GetSequence",
        "DropSequence",
        "PutPages",
        "AppendTokens",
        "FetchPages",
        "SelectPages",
        "Prefetch",
        "ReleaseLease",
        "SetPageState",
        "ApplyPolicy",
        "ReportAttention",
        "GetStats",
        "SetAccessTrace",
        "LookupPrefix",
        "GetCluster",
        "DrainNode",
        "MoveSequence",
    ];
}

/// The bare unary echo `kvtier bench fetch` measures kvtier's fixed cost
/// against (`proto/kvtier/bench/v1/echo.proto`).
#[allow(missing_debug_implementations, unreachable_pub, clippy::all, clippy::pedantic)]
pub mod bench {
    tonic::include_proto!("kvtier.bench.v1");
}

/// The encoded file descriptor set of `kvtier.v1`, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kvtier_descriptor.bin"));
