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
use kvtier_client::{Client, SelectRequest, pb};
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

/// Sequence "held", held by a writer on a thread of its own until a call
/// on "free" has been answered, or the watchdog gives up.
struct Held {
    store: Arc<Store>,
    holder: std::thread::JoinHandle<bool>,
    answered: mpsc::Sender<()>,
}

impl Held {
    fn take(store: &Arc<Store>) -> Self {
        let (answered, wait_for_answer) = mpsc::channel::<()>();
        let (locked, wait_for_lock) = mpsc::channel::<()>();
        let holder = {
            let store = Arc::clone(store);
            std::thread::spawn(move || {
                store
                    .with_sequence_held(&held(), || {
                        locked.send(()).unwrap();
                        wait_for_answer.recv_timeout(WATCHDOG).is_ok()
                    })
                    .unwrap()
            })
        };
        wait_for_lock.recv().unwrap();
        Self {
            store: Arc::clone(store),
            holder,
            answered,
        }
    }

    /// Once `readers` of "held" have had time to wait for the writer (and
    /// are still waiting), page 0 of "free", which must come while "held"
    /// is still held; then the writer lets go.
    async fn free_page<T>(
        self,
        client: &mut Client,
        readers: &[tokio::task::JoinHandle<T>],
        what: &str,
    ) -> Vec<pb::Page> {
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(self.store.would_wait(&held()), "the writer holds \"held\"");
        assert!(
            readers.iter().all(|r| !r.is_finished()),
            "{what} of \"held\" ended while it was held"
        );
        let free = client.fetch_pages("free", 0, 0..1, vec![0]).await.unwrap();
        let _ = self.answered.send(());
        assert!(
            self.holder.join().unwrap(),
            "a call on another sequence waited for the writer of \"held\" ({WAITING_READERS} {what}s of it on {WORKERS} workers)"
        );
        free
    }
}

fn held() -> SequenceKey {
    SequenceKey::parse("", "held").unwrap()
}

/// A server of a store kept here, with sequence "held" of `pages` pages and
/// "free" of one (one layer, one KV head), and a client of it.
async fn serving(pages: u32) -> (Arc<Store>, common::TestServer, Client) {
    let store = Store::new(common::small_store()).unwrap();
    let server = common::TestServer::serving(Arc::clone(&store), ServerConfig::default()).await;
    let mut client = server.client().await;
    let layout = kvtier_client::layout(1, 1, 1, HEAD_DIM, DTYPE, PAGE);
    for (seq, pages, seed) in [("held", pages, 11), ("free", 1, 7)] {
        let kv = Bytes::from(finite_elements(DTYPE, (2 * HEAD_DIM * PAGE * pages) as usize, seed));
        client.create_sequence(seq, layout.clone(), vec![]).await.unwrap();
        client.put_pages(seq, 0, 0..1, 0, PAGE * pages, kv).await.unwrap();
    }
    (store, server, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_waiting_for_a_writer_stall_no_other_sequence() {
    let (store, _server, mut client) = serving(1).await;
    let before = client.fetch_pages("free", 0, 0..1, vec![0]).await.unwrap();

    let held = Held::take(&store);
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
    let free = held.free_page(&mut client, &readers, "reader").await;
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
    // 2 MiB of pages: eight chunks of 256 KiB.
    let pages = 2048u32;
    let (store, server, mut client) = serving(pages).await;

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

    let held = Held::take(&store);
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
    let free = held.free_page(&mut client, &readers, "long fetch").await;
    assert_eq!(free.len(), 1);
    for reader in readers {
        assert_eq!(
            reader.await.unwrap(),
            pages as usize,
            "every page of each long fetch, once the writer is done"
        );
    }
}
