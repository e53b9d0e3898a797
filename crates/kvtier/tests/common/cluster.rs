//! A cluster for tests: real etcd, real `kvtier serve` nodes, a routing
//! client, and the checks every cluster test makes.

use std::path::Path;
use std::time::{Duration, Instant};

use kvtier_client::{Client, ClientError, Cluster, Connect, EtcdConfig};
use tonic::Code;

use super::Server;

/// A node: `kvtier serve` joined to the cluster at `etcd`.
pub fn node(dir: &Path, id: &str, etcd: &str, ttl: u32, grace: u32) -> Server {
    let dir = dir.join(id);
    std::fs::create_dir_all(&dir).unwrap();
    Server::start(
        &dir,
        &[
            "--etcd",
            etcd,
            "--node-id",
            id,
            "--lease-ttl-secs",
            &ttl.to_string(),
            "--grace-secs",
            &grace.to_string(),
        ],
    )
}

pub async fn cluster(etcd: &str, nodes: usize) -> Cluster {
    let cluster = Cluster::connect(&EtcdConfig::new(EtcdConfig::parse_endpoints(etcd)), Connect::default())
        .await
        .unwrap();
    cluster.wait_for_serving(nodes, Duration::from_secs(60)).await.unwrap();
    cluster
}

/// A call's status code; the client's own "no node is serving" is
/// UNAVAILABLE.
pub fn code(e: &ClientError) -> Code {
    match e {
        ClientError::Status(s) => s.code(),
        ClientError::Cluster(_) => Code::Unavailable,
        other => panic!("not a status: {other}"),
    }
}

/// Every page's bytes of a one-layer, one-head sequence.
pub async fn read(mut client: Client, seq: &str) -> Result<Vec<u8>, ClientError> {
    let pages = client.fetch_pages(seq, 0, 0..1, vec![]).await?;
    // Pages are whole K then V; the test compares the concatenation of
    // each page's bytes against the same split of what was written.
    Ok(pages.into_iter().flat_map(|p| p.kv.to_vec()).collect())
}

/// Retries `f` until it returns `Some`, at most `limit`.
pub async fn eventually<T, F, Fut>(limit: Duration, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(t) = f().await {
            return t;
        }
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether `kvtier health` says `service` is serving at `addr`.
pub fn healthy(addr: &str, service: &str) -> bool {
    std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["health", "--addr", addr, "--service", service])
        .output()
        .unwrap()
        .status
        .success()
}
