//! Sending one sequence to another node: writes are held (`gate.rs`), the
//! sequence streams lane by lane, the receiver answers once it holds every
//! page, reads are held too while it commits by taking the ownership
//! record over, and this node gives its copy up. A move whose
//! outcome the receiver did not report is settled in etcd
//! (`Node::keep_or_learn`): either the record is this node's again, at a
//! revision no receiver can take over, or it is the receiver's.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use kvtier_cluster::{Kept, Ownership};
use kvtier_core::SequenceKey;
use kvtier_proto::v1 as pb;
use kvtier_proto::v1::move_sequence_request::Part;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::gate::Peer;
use super::{Mover, wire};

/// How long a move waits for writes in flight before it starts.
const WRITES_WAIT: Duration = Duration::from_secs(30);
/// How long a move waits for each of the receiver's answers (all pages
/// in, then taken over).
const ANSWER_WAIT: Duration = Duration::from_secs(60);
/// Page bytes per message.
const CHUNK_BYTES: usize = 4 << 20;

/// What a move carried.
#[derive(Debug, Default)]
pub(crate) struct Carried {
    pub(crate) pages: AtomicU64,
    pub(crate) bytes: AtomicU64,
}

/// `f`, or a refusal after [`ANSWER_WAIT`].
async fn timeout<T>(f: impl std::future::Future<Output = Result<T, String>>) -> Result<T, String> {
    tokio::time::timeout(ANSWER_WAIT, f)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {ANSWER_WAIT:?}")))
}

/// Moves `key` to `to`. `Ok`: `to` owns it now and this node holds no
/// copy. `Err`: it stayed here (or, rarely, is neither here nor there: the
/// message says).
pub(crate) async fn send(m: &Arc<Mover>, key: &SequenceKey, to: &Peer, carried: &Arc<Carried>) -> Result<(), String> {
    let ownership = m
        .node
        .ownership(key)
        .await
        .map_err(|e| format!("etcd: {e}"))?
        .ok_or("it has no ownership record")?;
    if ownership.record.node_id != m.node.id() || m.node.incarnation(key) != Some(ownership.record.incarnation) {
        return Err(format!(
            "it is not this node's (its record names node {})",
            ownership.record.node_id
        ));
    }
    let (gate, k, t) = (Arc::clone(&m.gate), key.clone(), to.clone());
    tokio::task::spawn_blocking(move || gate.begin_send(&k, &t, WRITES_WAIT))
        .await
        .map_err(|e| e.to_string())??;
    let committed = Arc::new(AtomicBool::new(false));
    let streamed = stream(m, key, to, &ownership, &committed, carried).await;
    let error = match streamed {
        Ok(()) => return give_up(m, key).await,
        Err(e) if !committed.load(Ordering::Acquire) => {
            // No commit went out: no receiver can have taken it.
            m.gate.end(key);
            return Err(e);
        }
        Err(e) => e,
    };
    // The commit went out and no answer came: etcd says how it ended.
    loop {
        match m.node.keep_or_learn(key, ownership.revision).await {
            Ok(Kept::Here) => {
                m.gate.end(key);
                return Err(error);
            }
            Ok(Kept::Moved(node)) => {
                tracing::info!(sequence = %key, to = %node, "the move committed although its answer was lost");
                return give_up(m, key).await;
            }
            Ok(Kept::Gone) => {
                m.gate.end(key);
                return Err(format!("{error}; and its ownership record is gone"));
            }
            Err(e) => {
                tracing::warn!(sequence = %key, error = %e, "cannot settle a move in etcd yet; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// The receiver owns the sequence: calls go there, and the copy here goes
/// once the reads that entered before are done.
async fn give_up(m: &Arc<Mover>, key: &SequenceKey) -> Result<(), String> {
    m.node.handed_over(key);
    let (gate, store, k) = (Arc::clone(&m.gate), Arc::clone(&m.store), key.clone());
    let dropped = tokio::task::spawn_blocking(move || {
        gate.moved(&k, WRITES_WAIT);
        store.drop_sequence(&k)
    })
    .await
    .map_err(|e| e.to_string())?;
    if let Err(e) = dropped {
        // It is the receiver's either way; a copy left here is given up
        // when this node next settles with etcd.
        tracing::warn!(sequence = %key, error = %e, "could not drop the copy of a moved sequence");
    }
    Ok(())
}

/// Streams the sequence and its commit; `Ok` once the receiver took over.
async fn stream(
    m: &Arc<Mover>,
    key: &SequenceKey,
    to: &Peer,
    ownership: &Ownership,
    committed: &Arc<AtomicBool>,
    carried: &Arc<Carried>,
) -> Result<(), String> {
    let mut client = m.peers.client(&to.peer_addr)?;
    let store = Arc::clone(&m.store);
    let k = key.clone();
    let export = tokio::task::spawn_blocking(move || store.export_sequence(&k))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    let header = pb::MoveHeader {
        tenant: key.tenant.as_str().to_owned(),
        sequence_id: key.sequence.as_str().to_owned(),
        layout: Some(crate::convert::layout_to_pb(&export.layout)),
        prefix_hashes: export.hashes.iter().map(|h| h.clone().into()).collect(),
        incarnation: ownership.record.incarnation,
        from_node: m.node.id().to_owned(),
        record_revision: ownership.revision,
        durable: export.durable,
        group: ownership.record.group.as_ref().map(|g| pb::PlacementGroup {
            name: g.name.clone(),
            rank: g.rank,
            world: g.world,
        }),
    };
    let (tx, rx) = mpsc::channel(2);
    let part = |p: Part| pb::MoveSequenceRequest { part: Some(p) };
    tx.send(part(Part::Header(header)))
        .await
        .map_err(|_| "the stream closed".to_owned())?;
    let call = tokio::spawn(async move { client.move_sequence(ReceiverStream::new(rx)).await });
    let (store, k, lanes) = (Arc::clone(&m.store), key.clone(), tx.clone());
    let counts = Arc::clone(carried);
    let produced = tokio::task::spawn_blocking(move || -> Result<(), String> {
        for lane in export.lanes {
            let mut next = 0;
            while next < lane.pages {
                let pages = store
                    .export_pages(&k, lane, next, CHUNK_BYTES)
                    .map_err(|e| e.to_string())?;
                let n = pages.len() as u32;
                let bytes: usize = pages.iter().map(|p| p.content.bytes()).sum();
                counts.pages.fetch_add(u64::from(n), Ordering::Relaxed);
                counts.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
                let message = pb::MovedLane {
                    layer: lane.layer,
                    kv_head: lane.kv_head,
                    first_page: next,
                    pages: pages.into_iter().map(wire::page_to_pb).collect(),
                };
                lanes
                    .blocking_send(part(Part::Lane(message)))
                    .map_err(|_| "the receiver ended the stream".to_owned())?;
                next += n;
            }
        }
        lanes
            .blocking_send(part(Part::Prepare(pb::MovePrepare {})))
            .map_err(|_| "the receiver ended the stream before the prepare".to_owned())
    })
    .await
    .map_err(|e| e.to_string())?;
    let refused = |status: tonic::Status| format!("node {}: {}", to.node_id, status.message());
    let answered = async {
        let mut answers = call.await.map_err(|e| e.to_string())?.map_err(refused)?.into_inner();
        let mut stage = async |want: pb::MoveStage| match answers.message().await {
            Ok(Some(a)) if a.stage == want as i32 => Ok(()),
            Ok(Some(a)) => Err(format!(
                "node {} answered stage {} for {}",
                to.node_id,
                a.stage,
                want.as_str_name()
            )),
            Ok(None) => Err(format!(
                "node {} ended the stream before {}",
                to.node_id,
                want.as_str_name()
            )),
            Err(status) => Err(refused(status)),
        };
        timeout(stage(pb::MoveStage::Prepared)).await?;
        // Every page is there: from here on only etcd knows whether the
        // receiver took over, and calls here wait for the outcome.
        m.gate.begin_commit(key);
        committed.store(true, Ordering::Release);
        tx.send(part(Part::Commit(pb::MoveCommit {})))
            .await
            .map_err(|_| "the receiver ended the stream before the commit".to_owned())?;
        timeout(stage(pb::MoveStage::Committed)).await
    };
    let answer = answered.await;
    // A receiver's refusal explains a stream that broke; a producer's
    // failure (a read here) explains a refusal of the short stream.
    match (produced, answer) {
        (_, Ok(())) => Ok(()),
        (Err(mine), Err(theirs)) => Err(format!("{mine} ({theirs})")),
        (Ok(()), Err(theirs)) => Err(theirs),
    }
}
