//! Kill -9 the real server while it writes, many times over one data
//! directory: after every restart, nothing acknowledged as durable is lost,
//! and every byte served is a byte that was written.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvtier_client::{Client, layout, pb};

const HEADS: usize = 2;
const DIM: usize = 64;
const PAGE: usize = 16;
const ROUNDS: u64 = 8;

/// The bytes of token `t` of head `h` of sequence `seq` (K row, V row):
/// any byte served can be checked against this.
fn row(seq: &str, h: usize, t: usize, value: bool) -> Vec<u8> {
    let base = seq
        .bytes()
        .fold(0u32, |a, b| a.wrapping_mul(31).wrapping_add(u32::from(b)));
    (0..DIM)
        .flat_map(|i| {
            let x = (base % 97) as f32
                + h as f32 * 0.5
                + t as f32 * 0.01
                + i as f32 * 0.001
                + if value { 0.3 } else { 0.0 };
            half::f16::from_f32(x).to_le_bytes()
        })
        .collect()
}

fn message(seq: &str, tokens: std::ops::Range<usize>) -> bytes::Bytes {
    let mut out = Vec::new();
    for h in 0..HEADS {
        for value in [false, true] {
            for t in tokens.clone() {
                out.extend(row(seq, h, t, value));
            }
        }
    }
    out.into()
}

fn expected_page(seq: &str, h: usize, page: usize, rows: usize) -> Vec<u8> {
    let tokens = page * PAGE..page * PAGE + rows;
    let k: Vec<u8> = tokens.clone().flat_map(|t| row(seq, h, t, false)).collect();
    let v: Vec<u8> = tokens.flat_map(|t| row(seq, h, t, true)).collect();
    [k, v].concat()
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(dir: &Path) -> (Server, String) {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let child = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--metrics-listen",
            "off",
        ])
        .args([
            "--data-dir",
            dir.to_str().unwrap(),
            "--device-bytes",
            "1MiB",
            "--host-bytes",
            "2MiB",
        ])
        .args(["--nvme-bytes", "64MiB"])
        .env("KVTIER_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    (Server(child), format!("http://127.0.0.1:{port}"))
}

async fn connect(addr: &str) -> Client {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(mut c) = Client::connect(addr.to_owned()).await
            && c.stats().await.is_ok()
        {
            return c.with_persist(true);
        }
        assert!(Instant::now() < deadline, "server did not come up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Tokens acknowledged as durable, per sequence.
type Ledger = Arc<Mutex<BTreeMap<String, usize>>>;

/// Writes until the server dies: a few sequences, then appends to them in
/// turn, recording every acknowledgement.
async fn writer(mut client: Client, round: u64, ledger: Ledger) {
    const SEQUENCES: usize = 6;
    let mut seqs: Vec<(String, usize)> = Vec::new();
    for step in 0.. {
        if seqs.len() < SEQUENCES {
            let seq = format!("r{round}-s{}", seqs.len());
            let shape = layout(
                1,
                HEADS as u32,
                HEADS as u32,
                DIM as u32,
                pb::DType::DtypeF16,
                PAGE as u32,
            );
            if client.create_sequence(&seq, shape, vec![]).await.is_err() {
                return;
            }
            let Ok(r) = client
                .put_pages(&seq, 0, 0..HEADS as u32, 0, 40, message(&seq, 0..40))
                .await
            else {
                return;
            };
            assert_eq!(r.durability(), pb::Durability::Relaxed);
            ledger.lock().unwrap().insert(seq.clone(), 40);
            seqs.push((seq, 40));
            continue;
        }
        let (seq, t) = &mut seqs[step % SEQUENCES];
        match client
            .append_tokens(seq, 0, 0..HEADS as u32, 7, message(seq, *t..*t + 7), Some(*t as u64))
            .await
        {
            Ok(r) => {
                assert_eq!(r.durability(), pb::Durability::Relaxed);
                *t += 7;
                ledger.lock().unwrap().insert(seq.clone(), *t);
            }
            Err(_) => return,
        }
    }
}

async fn verify(client: &mut Client, ledger: &BTreeMap<String, usize>) -> (usize, usize) {
    let (mut pages_checked, mut lost_unacked) = (0, 0);
    for (seq, &acked) in ledger {
        let info = client
            .get_sequence(seq)
            .await
            .unwrap_or_else(|e| panic!("{seq} with {acked} durable tokens is missing: {e}"));
        assert!(
            info.tokens >= acked as u64,
            "{seq}: {acked} tokens acknowledged durable, {} recovered",
            info.tokens
        );
        for p in client.fetch_pages(seq, 0, 0..HEADS as u32, vec![]).await.unwrap() {
            let page = p.page as usize;
            if p.state() == pb::PageState::Gone {
                assert!(
                    page * PAGE >= acked,
                    "{seq} page {page} is gone ({:?}) but tokens up to {acked} were acknowledged durable",
                    p.gone_reason()
                );
                lost_unacked += 1;
                continue;
            }
            assert!(
                p.kv[..] == expected_page(seq, p.kv_head as usize, page, p.tokens as usize)[..],
                "{seq} head {} page {page}: wrong bytes served",
                p.kv_head
            );
            pages_checked += 1;
        }
    }
    (pages_checked, lost_unacked)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_write_loses_nothing_acknowledged_and_serves_nothing_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let ledger: Ledger = Arc::default();
    let mut checked = 0;
    for round in 0..ROUNDS {
        let (mut server, addr) = start(dir.path());
        let mut client = connect(&addr).await;
        let snapshot = ledger.lock().unwrap().clone();
        let (pages, _) = verify(&mut client, &snapshot).await;
        checked += pages;
        let task = tokio::spawn(writer(client.clone(), round, Arc::clone(&ledger)));
        // Kill at a different moment each round, mid-stream.
        tokio::time::sleep(Duration::from_millis(150 + (round * 137) % 400)).await;
        server.0.kill().unwrap();
        server.0.wait().unwrap();
        let _ = task.await;
    }
    let (mut server, addr) = start(dir.path());
    let mut client = connect(&addr).await;
    let snapshot = ledger.lock().unwrap().clone();
    let (pages, _) = verify(&mut client, &snapshot).await;
    checked += pages;
    println!(
        "{} sequences with durable writes, {checked} page reads verified across {ROUNDS} kills",
        snapshot.len()
    );
    assert!(
        snapshot.len() >= ROUNDS as usize,
        "every round acknowledged some durable writes"
    );
    server.0.kill().unwrap();
}
