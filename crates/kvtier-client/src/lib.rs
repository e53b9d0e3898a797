#![warn(missing_docs)]
//! Rust client for kvtier: typed calls for the whole `kvtier.v1` API and
//! helpers to pack and unpack pages from typed slices.
//!
//! ```no_run
//! # async fn demo() -> Result<(), kvtier_client::ClientError> {
//! use kvtier_client::{Client, pack_kv, layout, pb};
//! let mut client = Client::connect("http://127.0.0.1:50051").await?;
//! // 2 layers, 1 KV head, 4 query heads, head_dim 4, f32, 16-token pages.
//! client.create_sequence("req-1", layout(2, 1, 4, 4, pb::DType::DtypeF32, 16), vec![]).await?;
//! let (k, v) = (vec![0.5f32; 20 * 4], vec![1.0f32; 20 * 4]); // [heads][tokens][head_dim]
//! client.put_pages("req-1", 0, 0..1, 0, 20, pack_kv(&k, &v, 1, 20, 4)?).await?;
//! let pages = client.fetch_pages("req-1", 0, 0..1, vec![]).await?;
//! assert_eq!(pages.len(), 2); // a full page and a partial one
//! # Ok(()) }
//! ```

mod client;
#[cfg(feature = "cluster")]
mod cluster;
mod merge;
mod pack;
mod shm;

pub use client::{
    Client, ClientError, Connect, MAX_MESSAGE_BYTES, SelectRequest, SelectResult, Tls, actions, call_status, layout,
    refusal_owner,
};
#[cfg(feature = "cluster")]
pub use cluster::{Cluster, Placed};
#[cfg(feature = "cluster")]
pub use kvtier_cluster::{EtcdConfig, View};
pub use kvtier_proto::v1 as pb;
pub use merge::{Part, Partitioned};
pub use pack::{Element, PackError, pack_kv, unpack_rows};
pub use shm::{DEFAULT_SPIN, ShmError, ShmRegion};

/// The README's client example, compiled as a doctest so it stays true.
#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct ReadmeExample;
