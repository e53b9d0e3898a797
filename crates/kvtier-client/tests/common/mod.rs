//! A real server on loopback for each test, and deterministic test data.
#![allow(dead_code, unreachable_pub)]

pub mod raw;

use std::net::SocketAddr;

use kvtier_client::{Client, pb};
use kvtier_server::{BoundServer, ServerConfig};
use kvtier_store::{Store, StoreConfig};
use tokio::sync::oneshot;

pub struct TestServer {
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
}

impl TestServer {
    pub async fn start(store: StoreConfig) -> Self {
        Self::start_with(store, ServerConfig::default()).await
    }

    /// A server with `config`, on a free loopback port, without metrics.
    pub async fn start_with(store: StoreConfig, config: ServerConfig) -> Self {
        Self::serving(Store::new(store).unwrap(), config).await
    }

    /// A server of `store`, which the test keeps a handle of.
    pub async fn serving(store: std::sync::Arc<Store>, config: ServerConfig) -> Self {
        let config = ServerConfig {
            listen: ([127, 0, 0, 1], 0).into(),
            metrics_listen: None,
            ..config
        };
        let bound = BoundServer::bind(store, config).await.unwrap();
        let addr = bound.grpc_addr();
        let (stop, stopped) = oneshot::channel();
        tokio::spawn(async move {
            bound
                .serve(async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
        });
        Self { addr, stop: Some(stop) }
    }

    pub async fn default() -> Self {
        Self::start(small_store()).await
    }

    pub async fn client(&self) -> Client {
        Client::connect(format!("http://{}", self.addr)).await.unwrap()
    }
}

/// A small-store server with a region socket in `dir`, a client of it and
/// a 1 MiB region registered.
pub async fn with_region(dir: &std::path::Path) -> (TestServer, Client, kvtier_client::ShmRegion) {
    let socket = dir.join("shm.sock");
    let config = ServerConfig {
        shm_socket: Some(socket.clone()),
        ..ServerConfig::default()
    };
    let server = TestServer::start_with(small_store(), config).await;
    let client = server.client().await;
    let region = kvtier_client::ShmRegion::register(&socket, 1 << 20, "", None)
        .await
        .unwrap();
    (server, client, region)
}

/// The tiers of `TestServer::default`.
pub fn small_store() -> StoreConfig {
    StoreConfig {
        device_bytes: 16 << 20,
        host_bytes: 64 << 20,
        cache_writes_on_device: true,
        ..StoreConfig::default()
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Element bytes of `dtype`.
pub fn size_of(dtype: pb::DType) -> usize {
    match dtype {
        pb::DType::DtypeF32 => 4,
        _ => 2,
    }
}

/// Deterministic bytes of finite `dtype` values with arbitrary bit patterns
/// (subnormals, negative zero, extremes), so round trips are checked bit for
/// bit, not value for value.
pub fn finite_elements(dtype: pb::DType, count: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut out = Vec::with_capacity(count * size_of(dtype));
    for _ in 0..count {
        match dtype {
            pb::DType::DtypeF32 => loop {
                let bits = next() as u32;
                if (bits >> 23) & 0xFF != 0xFF {
                    out.extend_from_slice(&bits.to_le_bytes());
                    break;
                }
            },
            pb::DType::DtypeF16 => loop {
                let bits = next() as u16;
                if (bits >> 10) & 0x1F != 0x1F {
                    out.extend_from_slice(&bits.to_le_bytes());
                    break;
                }
            },
            _ => loop {
                let bits = next() as u16;
                if (bits >> 7) & 0xFF != 0xFF {
                    out.extend_from_slice(&bits.to_le_bytes());
                    break;
                }
            },
        }
    }
    out
}

/// Element `i` of `bytes` as f32 (exact for every dtype).
pub fn value(dtype: pb::DType, bytes: &[u8], i: usize) -> f32 {
    match dtype {
        pb::DType::DtypeF32 => f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap()),
        pb::DType::DtypeF16 => half::f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
        _ => half::bf16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
    }
}

/// The K/V a test wrote for one lane, as the server must return it: per
/// token, a K row and a V row of `row` bytes each.
#[derive(Debug, Clone, Default)]
pub struct LaneData {
    pub keys: Vec<u8>,
    pub values: Vec<u8>,
}

impl LaneData {
    /// Expected `kv` of page `page`: its K rows, then its V rows.
    pub fn page(&self, page: usize, page_size: usize, row: usize) -> Vec<u8> {
        let tokens = self.keys.len() / row;
        let (a, b) = (page * page_size, ((page + 1) * page_size).min(tokens));
        [&self.keys[a * row..b * row], &self.values[a * row..b * row]].concat()
    }
}

/// Builds one `kv` message for `heads` heads and `tokens` tokens from random
/// data, recording each head's K/V into `lanes[head]`.
pub fn random_kv(
    dtype: pb::DType,
    head_dim: usize,
    heads: &mut [&mut LaneData],
    tokens: usize,
    seed: u64,
) -> bytes::Bytes {
    let row = head_dim * size_of(dtype);
    let mut kv = Vec::with_capacity(heads.len() * 2 * tokens * row);
    for (h, lane) in heads.iter_mut().enumerate() {
        let k = finite_elements(dtype, tokens * head_dim, seed * 1000 + 2 * h as u64);
        let v = finite_elements(dtype, tokens * head_dim, seed * 1000 + 2 * h as u64 + 1);
        kv.extend_from_slice(&k);
        kv.extend_from_slice(&v);
        lane.keys.extend_from_slice(&k);
        lane.values.extend_from_slice(&v);
    }
    kv.into()
}
