//! The real `kvtier serve` binary as a child process over one data
//! directory: started, connected to, stopped with SIGTERM or killed.
#![allow(dead_code, unreachable_pub)]

pub mod cluster;
pub mod etcd;
pub mod model;
pub mod ops;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use kvtier_client::Client;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

/// Runs the `kvtier` binary with `args` to success; its stdout.
pub fn kvtier(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier")).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "kvtier {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A running server. Dropping it kills it.
pub struct Server {
    child: Child,
    pub addr: String,
    /// Where its stderr goes.
    pub log: PathBuf,
}

/// Tiny host and device tiers (a model page is 64 bytes: a few dozen fit),
/// so that pages migrate to NVMe all the time, and a checkpoint whenever
/// the manifest has doubled.
pub const FLAGS: [&str; 6] = [
    "--host-bytes",
    "4KiB",
    "--device-bytes",
    "2KiB",
    "--checkpoint-bytes",
    "1",
];

/// Small tiers, so that pages move between them (what every server starts
/// with unless its flags say otherwise).
pub const SMALL_TIERS: [&str; 6] = [
    "--device-bytes",
    "1MiB",
    "--host-bytes",
    "2MiB",
    "--nvme-bytes",
    "64MiB",
];

impl Server {
    /// Starts `kvtier serve` over `dir` on a free port (not waiting for it);
    /// `extra` adds flags or overrides those of [`SMALL_TIERS`].
    pub fn start(dir: &Path, extra: &[&str]) -> Self {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let log = dir.join(format!("serve-{port}.log"));
        let child = Command::new(env!("CARGO_BIN_EXE_kvtier"))
            .args([
                "serve",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--metrics-listen",
                "off",
            ])
            .args(["--data-dir", dir.to_str().unwrap()])
            .args(SMALL_TIERS.chunks(2).filter(|pair| !extra.contains(&pair[0])).flatten())
            .args(extra)
            .env("KVTIER_LOG", "info,kvtier_store::durability=debug")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Self {
            child,
            addr: format!("http://127.0.0.1:{port}"),
            log,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A client, once the server answers (it recovers before it listens).
    pub async fn client(&mut self) -> Client {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(mut c) = Client::connect(self.addr.clone()).await
                && c.stats().await.is_ok()
            {
                return c;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("the server exited ({status}) before answering:\n{}", self.stderr());
            }
            assert!(
                Instant::now() < deadline,
                "the server did not come up:\n{}",
                self.stderr()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, and waits for a clean exit.
    pub fn terminate(mut self) {
        // SAFETY: kill(2) only reads the pid and the signal number; the child
        // has not been waited for, so the pid is still this child's.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        assert_eq!(rc, 0, "SIGTERM could not be sent");
        let status = self.wait(Duration::from_secs(60));
        assert!(
            status.success(),
            "the server did not stop cleanly ({status}):\n{}",
            self.stderr()
        );
    }

    /// SIGKILL, mid-whatever (what dropping it does).
    pub fn kill(self) {}

    /// Killed or stopped cleanly.
    pub fn stop(self, kill: bool) {
        if kill { self.kill() } else { self.terminate() }
    }

    /// Waits for the process to exit by itself.
    pub fn wait(&mut self, limit: Duration) -> ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "the server did not exit:\n{}", self.stderr());
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// A whole-number environment variable, when it is set.
pub fn env(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// A proptest runner drawing from `seed`; each `stream` is independent.
pub fn seeded(config: Config, seed: u64, stream: u8) -> TestRunner {
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    bytes[8] = stream;
    TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &bytes))
}

/// Flips the bits `mask` of byte `at` of the NVMe data file in `dir` (a
/// disk that corrupted a block).
pub fn corrupt_nvme(dir: &Path, at: u64, mask: u8) {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join("nvme.data"))
        .unwrap();
    let mut byte = [0u8];
    file.read_exact_at(&mut byte, at).unwrap();
    file.write_all_at(&[byte[0] ^ mask], at).unwrap();
    file.sync_all().unwrap();
}

/// What the logs of every server started over `dir` say: checkpoints
/// written, and servers killed while one was being written.
pub fn checkpoints(dir: &Path) -> (usize, usize) {
    let (mut written, mut killed_during) = (0, 0);
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        if !entry.file_name().to_string_lossy().starts_with("serve-") {
            continue;
        }
        let log = std::fs::read_to_string(entry.path()).unwrap_or_default();
        let done = log.matches("manifest checkpoint written").count();
        written += done;
        killed_during += usize::from(log.matches("manifest checkpoint started").count() > done);
    }
    (written, killed_during)
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
