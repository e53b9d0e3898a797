//! A call that must wait for its sequence's writer (an append may hold the
//! sequence across NVMe I/O) waits off the runtime's workers: calls on
//! other sequences go on meanwhile, even when more such waiting calls
//! arrive than the runtime has workers.

mod common;

use std::sync::mpsc;
use std::time::Duration;

use bytes::Bytes;
use common::finite_elements;
use kvtier_client::{SelectRequest, pb};
use kvtier_core::SequenceKey;
use kvtier_server::ServerConfig;
use kvtier_store::Store;

const DTYPE: pb::DType = pb::DType::DtypeBf16;
const HEAD_DIM: u32 = 32;
const PAGE: u32 = 8;
/// More readers of the held sequence than the runtime has workers.
const WORKERS: usize = 2;
const WAITING_READERS: usize = 2 * WORKERS;
/// How long the writer holds its sequence at most: a watchdog, so that a
/// regression fails the test instead of hanging it.
const WATCHDOG: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_waiting_for_a_writer_stall_no_other_sequence() {
    let store = Store::new(common::small_store()).unwrap();
    let server = common::TestServer::serving(std::sync::Arc::clone(&store), ServerConfig::default()).await;
    let mut client = server.client().await;
    let layout = kvtier_client::layout(1, 1, 1, HEAD_DIM, DTYPE, PAGE);
    let kv = Bytes::from(finite_elements(DTYPE, (2 * HEAD_DIM * PAGE) as usize, 7));
    for seq in ["held", "free"] {
        client.create_sequence(seq, layout.clone(), vec![]).await.unwrap();
        client.put_pages(seq, 0, 0..1, 0, PAGE, kv.clone()).await.unwrap();
    }
    let before = client.fetch_pages("free", 0, 0..1, vec![0]).await.unwrap();

    // A writer takes "held" on a thread of its own and keeps it until the
    // call on "free" has been answered, or the watchdog gives up.
    let (answered, wait_for_answer) = mpsc::channel::<()>();
    let (locked, wait_for_lock) = tokio::sync::oneshot::channel::<()>();
    let holder = {
        let store = std::sync::Arc::clone(&store);
        std::thread::spawn(move || {
            let key = SequenceKey::parse("", "held").unwrap();
            store
                .with_sequence_held(&key, || {
                    locked.send(()).unwrap();
                    wait_for_answer.recv_timeout(WATCHDOG).is_ok()
                })
                .unwrap()
        })
    };
    wait_for_lock.await.unwrap();
    let readers: Vec<_> = (0..WAITING_READERS)
        .map(|i| {
            let mut client = client.clone();
            tokio::spawn(async move {
                match i % 2 {
                    0 => client.fetch_pages("held", 0, 0..1, vec![0]).await.map(|p| p.len()),
                    _ => {
                        let mut req = SelectRequest::new(0, 0..1, vec![1.0; HEAD_DIM as usize], 1);
                        req.include_data = true;
                        client.select_pages("held", &req).await.map(|s| s.pages.len())
                    }
                }
            })
        })
        .collect();
    // Time for the readers' calls to reach the server and wait there.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let free = client.fetch_pages("free", 0, 0..1, vec![0]).await.unwrap();
    let _ = answered.send(());
    let answered_while_held = holder.join().unwrap();
    assert!(
        answered_while_held,
        "a call on another sequence waited for the writer of \"held\" ({WAITING_READERS} readers of it on {WORKERS} workers)"
    );
    assert_eq!(free, before, "the other sequence's page, bit-exact");
    for reader in readers {
        assert_eq!(
            reader.await.unwrap().unwrap(),
            1,
            "each reader of \"held\" gets its page once the writer is done"
        );
    }
}
