//! A real etcd (Debian's `etcd-server`) on loopback: one member or three,
//! started, killed and restarted over its data directory.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One etcd member.
pub struct Etcd {
    child: Option<Child>,
    name: String,
    dir: PathBuf,
    pub client_url: String,
    peer_url: String,
    initial_cluster: String,
    /// Certificate and key (PEM) its client port serves TLS with.
    tls: Option<(PathBuf, PathBuf)>,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl Etcd {
    /// A one-member etcd under `dir`, answering before this returns.
    pub fn start(dir: &Path) -> Self {
        Self::members(dir, 1).pop().unwrap()
    }

    /// A one-member etcd whose client port speaks only TLS with `cert` and
    /// `key` (`https://` URL), answering before this returns.
    pub fn start_tls(dir: &Path, cert: &Path, key: &Path) -> Self {
        let (client, peer) = (free_port(), free_port());
        let mut etcd = Self {
            child: None,
            name: "e0".to_owned(),
            dir: dir.join("etcd-e0"),
            client_url: format!("https://127.0.0.1:{client}"),
            peer_url: format!("http://127.0.0.1:{peer}"),
            initial_cluster: format!("e0=http://127.0.0.1:{peer}"),
            tls: Some((cert.to_owned(), key.to_owned())),
        };
        etcd.spawn();
        etcd.wait_ready();
        etcd
    }

    /// A cluster of `n` members, all answering before this returns.
    pub fn members(dir: &Path, n: usize) -> Vec<Self> {
        let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
        let initial_cluster = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("e{i}=http://127.0.0.1:{peer}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut members: Vec<Self> = ports
            .iter()
            .enumerate()
            .map(|(i, (client, peer))| Self {
                child: None,
                name: format!("e{i}"),
                dir: dir.join(format!("etcd-e{i}")),
                client_url: format!("http://127.0.0.1:{client}"),
                peer_url: format!("http://127.0.0.1:{peer}"),
                initial_cluster: initial_cluster.clone(),
                tls: None,
            })
            .collect();
        for m in &mut members {
            m.spawn();
        }
        for m in &members {
            m.wait_ready();
        }
        members
    }

    fn spawn(&mut self) {
        let log = std::fs::File::create(self.dir.with_extension("log")).unwrap();
        let mut command = Command::new("etcd");
        if let Some((cert, key)) = &self.tls {
            command.arg("--cert-file").arg(cert).arg("--key-file").arg(key);
        }
        let child = command
            .args(["--name", &self.name])
            .args(["--data-dir", self.dir.to_str().unwrap()])
            .args(["--listen-client-urls", &self.client_url])
            .args(["--advertise-client-urls", &self.client_url])
            .args(["--listen-peer-urls", &self.peer_url])
            .args(["--initial-advertise-peer-urls", &self.peer_url])
            .args(["--initial-cluster", &self.initial_cluster])
            .args(["--initial-cluster-state", "new"])
            // Quick elections: a lost leader is replaced within a second.
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run etcd ({e}): install Debian's etcd-server"));
        self.child = Some(child);
    }

    /// Waits until the member answers `/health`'s TCP port.
    fn wait_ready(&self) {
        let addr = self.client_url.split_once("://").map_or("", |(_, a)| a).to_owned();
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(&addr).is_err() {
            assert!(
                Instant::now() < deadline,
                "etcd {} did not come up: {}",
                self.name,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.with_extension("log")).unwrap_or_default()
    }

    /// SIGKILL.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the member again over its data directory, on its ports.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
        self.wait_ready();
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A TCP proxy in front of etcd for one node: cutting it partitions that
/// node from etcd (its connections reset, new ones refused) while every
/// other node still reaches etcd.
pub struct Proxy {
    pub url: String,
    open: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Bumped on every cut: connections from before it end.
    cuts: tokio::sync::watch::Sender<u64>,
}

impl Proxy {
    /// Forwards a loopback port to `target` (`http://127.0.0.1:port`).
    pub async fn start(target: &str) -> Self {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, Ordering};
        let upstream = target.trim_start_matches("http://").to_owned();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let open = Arc::new(AtomicBool::new(true));
        let (cuts, _) = tokio::sync::watch::channel(0u64);
        let (accepting, cut) = (Arc::clone(&open), cuts.clone());
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if !accepting.load(Ordering::SeqCst) {
                    continue; // dropped: the connection is reset
                }
                let upstream = upstream.clone();
                let mut cut = cut.subscribe();
                tokio::spawn(async move {
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(&upstream).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = cut.changed() => {}
                    }
                });
            }
        });
        Self { url, open, cuts }
    }

    /// Partitions: ends every connection and refuses new ones.
    pub fn cut(&self) {
        self.open.store(false, std::sync::atomic::Ordering::SeqCst);
        self.cuts.send_modify(|n| *n += 1);
    }

    pub fn heal(&self) {
        self.open.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}
