//! A call that must wait for its sequence's writer (an append may hold the
//! sequence across NVMe I/O) waits off the runtime's workers: calls on
//! other sequences go on meanwhile, even when more such waiting calls
//! arrive than the runtime has workers. Both places a call can wait are
//! covered: its plan (the writer is there when it arrives) and a long
//! fetch's later chunks (the writer came after its first).

mod common;

use std::sync::{Arc, mpsc};
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

/// Holds sequence `held` as its writer on a thread of its own until
/// `answered` says so, or the watchdog gives up; its join says which.
fn hold(store: &Arc<Store>, held: &str) -> (std::thread::JoinHandle<bool>, mpsc::Sender<()>) {
    let (answered, wait_for_answer) = mpsc::channel::<()>();
    let (locked, wait_for_lock) = mpsc::channel::<()>();
    let store = Arc::clone(store);
    let key = SequenceKey::parse("", held).unwrap();
    let holder = std::thread::spawn(move || {
        store
            .with_sequence_held(&key, || {
                locked.send(()).unwrap();
                wait_for_answer.recv_timeout(WATCHDOG).is_ok()
            })
            .unwrap()
    });
    wait_for_lock.recv().unwrap();
    (holder, answered)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_waiting_for_a_writer_stall_no_other_sequence() {
    let store = Store::new(common::small_store()).unwrap();
    let server = common::TestServer::serving(Arc::clone(&store), ServerConfig::default()).await;
    let mut client = server.client().await;
    let layout = kvtier_client::layout(1, 1, 1, HEAD_DIM, DTYPE, PAGE);
    let kv = Bytes::from(finite_elements(DTYPE, (2 * HEAD_DIM * PAGE) as usize, 7));
    for seq in ["held", "free"] {
        client.create_sequence(seq, layout.clone(), vec![]).await.unwrap();
        client.put_pages(seq, 0, 0..1, 0, PAGE, kv.clone()).await.unwrap();
    }
    let before = client.fetch_pages("free", 0, 0..1, vec![0]).await.unwrap();

    // A writer takes "held" and keeps it until the call on "free" has been
    // answered, or the watchdog gives up.
    let (holder, answered) = hold(&store, "held");
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
    // Time for the readers' calls to reach the server and wait there; the
    // writer still holds "held", and none of them has been answered.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(store.would_wait(&SequenceKey::parse("", "held").unwrap()));
    assert!(
        readers.iter().all(|r| !r.is_finished()),
        "a reader of \"held\" was answered while it was held"
    );

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_fetches_waiting_for_a_writer_stall_no_other_sequence() {
    let store = Store::new(common::small_store()).unwrap();
    let server = common::TestServer::serving(Arc::clone(&store), ServerConfig::default()).await;
    let mut client = server.client().await;
    let layout = kvtier_client::layout(1, 1, 1, HEAD_DIM, DTYPE, PAGE);
    // 2 MiB of pages: eight chunks of 256 KiB.
    let pages = 2048u32;
    let kv = Bytes::from(finite_elements(DTYPE, (2 * HEAD_DIM * PAGE * pages) as usize, 11));
    client.create_sequence("held", layout.clone(), vec![]).await.unwrap();
    client.put_pages("held", 0, 0..1, 0, PAGE * pages, kv).await.unwrap();
    client.create_sequence("free", layout, vec![]).await.unwrap();
    let one = Bytes::from(finite_elements(DTYPE, (2 * HEAD_DIM * PAGE) as usize, 7));
    client.put_pages("free", 0, 0..1, 0, PAGE, one).await.unwrap();

    // Clients whose HTTP/2 windows take one message at a time: each long
    // fetch stops after its first chunks until its stream is read.
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .initial_stream_window_size(Some(64 << 10))
        .initial_connection_window_size(Some(64 << 10));
    let mut streams = Vec::new();
    for _ in 0..WAITING_READERS {
        let mut slow = kvtier_client::Client::from_channel(endpoint.connect().await.unwrap());
        let req = pb::FetchPagesRequest {
            sequence_id: "held".into(),
            layer: 0,
            kv_head_count: 1,
            ..Default::default()
        };
        let request = slow.request(req);
        streams.push(slow.raw().fetch_pages(request).await.unwrap().into_inner());
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    let (holder, answered) = hold(&store, "held");
    let readers: Vec<_> = streams
        .into_iter()
        .map(|mut stream| {
            tokio::spawn(async move {
                let mut pages = 0;
                while let Some(message) = stream.message().await.unwrap() {
                    pages += message.pages.len();
                }
                pages
            })
        })
        .collect();
    // Time for the streams to want chunks read after the writer came.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        readers.iter().all(|r| !r.is_finished()),
        "a fetch of \"held\" ended while it was held"
    );

    let free = client.fetch_pages("free", 0, 0..1, vec![0]).await.unwrap();
    let _ = answered.send(());
    let answered_while_held = holder.join().unwrap();
    assert!(
        answered_while_held,
        "a call on another sequence waited for the writer of \"held\" ({WAITING_READERS} long fetches of it on {WORKERS} workers)"
    );
    assert_eq!(free.len(), 1);
    for reader in readers {
        assert_eq!(
            reader.await.unwrap(),
            pages as usize,
            "every page of each long fetch, once the writer is done"
        );
    }
}
