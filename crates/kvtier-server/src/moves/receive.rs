//! Receiving a sequence another node sends (`MoveSequence`): checked, then
//! staged in the store while calls for it still go to the sender, made
//! durable as journalled at the prepare (answered PREPARED), then taken
//! over in etcd at the commit (answered COMMITTED). A stream that fails or
//! ends before its commit leaves nothing: the staged copy is dropped, also
//! when the call goes away mid-stream.

use std::sync::Arc;

use kvtier_cluster::{Group, placement};
use kvtier_core::{SequenceKey, wire};
use kvtier_proto::v1 as pb;
use kvtier_proto::v1::move_sequence_request::Part;
use kvtier_store::LaneAt;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use super::gate::Peer;
use super::{Mover, wire as moved};
use crate::blocking::blocking;
use crate::convert;
use crate::status::{invalid, refused};

/// The answers of a move: PREPARED, then COMMITTED, or the refusal.
pub(crate) type MoveStream = ReceiverStream<Result<pb::MoveSequenceResponse, Status>>;

/// Receives one sequence (an admin's call), answering as it goes.
pub(crate) fn receive(m: Arc<Mover>, stream: Streaming<pb::MoveSequenceRequest>) -> MoveStream {
    let (tx, rx) = mpsc::channel(2);
    tokio::spawn(async move {
        if let Err(status) = run(&m, stream, &tx).await {
            let _ = tx.send(Err(status)).await;
        }
    });
    ReceiverStream::new(rx)
}

/// The next message's part, refused as `what` (`"the commit"`) when it is
/// another or the stream ends.
async fn next(stream: &mut Streaming<pb::MoveSequenceRequest>, what: &str) -> Result<Part, Status> {
    match stream.message().await? {
        Some(pb::MoveSequenceRequest { part: Some(part) }) => Ok(part),
        Some(_) => Err(invalid(wire::MOVE_PART, format!("is required: {what}"))),
        None => Err(invalid(wire::MOVE_PART, format!("the stream ended before {what}"))),
    }
}

async fn run(
    m: &Arc<Mover>,
    mut stream: Streaming<pb::MoveSequenceRequest>,
    answer: &mpsc::Sender<Result<pb::MoveSequenceResponse, Status>>,
) -> Result<(), Status> {
    let Part::Header(header) = next(&mut stream, "the header").await? else {
        return Err(invalid(wire::MOVE_HEADER, "must be the stream's first message"));
    };
    let under = |e: Status| Status::new(e.code(), format!("{}: {}", wire::MOVE_HEADER.path, e.message()));
    let key = convert::key(&header.tenant, &header.sequence_id).map_err(under)?;
    let layout = convert::layout(header.layout).map_err(under)?;
    let group = convert::group(header.group).map_err(under)?;
    let hashes: Vec<Vec<u8>> = header.prefix_hashes.iter().map(|h| h.to_vec()).collect();
    let from = check(m, &key, &hashes, group.as_ref(), &header.from_node, header.durable)?;
    m.gate
        .begin_receive(&key, &from)
        .map_err(|why| Status::failed_precondition(format!("{}: sequence {key}: {why}", wire::MOVE_HEADER.path)))?;
    let staged = Staged {
        mover: Arc::clone(m),
        key: key.clone(),
        kept: false,
    };
    let store = Arc::clone(&m.store);
    let k = key.clone();
    blocking(store, move |s| {
        if s.holds(&k) {
            // A copy not this node's: what a receive cut short left.
            s.drop_sequence(&k)?;
        }
        s.create_moved(k, layout, hashes)
    })
    .await
    .map_err(under)?;
    let mut received = pb::MoveSequenceResponse::default();
    loop {
        let lane = match next(&mut stream, "the prepare").await? {
            Part::Lane(lane) => lane,
            Part::Prepare(_) => break,
            _ => {
                return Err(invalid(
                    wire::MOVE_PART,
                    "must be a lane or the prepare after the header",
                ));
            }
        };
        let under = |e: Status| Status::new(e.code(), format!("{}: {}", wire::MOVE_LANE.path, e.message()));
        let pages = lane
            .pages
            .into_iter()
            .enumerate()
            .map(|(i, p)| moved::page_from_pb(i, p))
            .collect::<Result<Vec<_>, _>>()?;
        received.bytes += pages.iter().map(|p| p.content.bytes() as u64).sum::<u64>();
        let at = LaneAt {
            layer: lane.layer,
            kv_head: lane.kv_head,
            pages: 0,
        };
        let k = key.clone();
        received.pages += blocking(Arc::clone(&m.store), move |s| {
            s.import_pages(&k, at, lane.first_page, pages)
        })
        .await
        .map_err(under)?;
    }
    let k = key.clone();
    blocking(Arc::clone(&m.store), move |s| s.commit_moved(&k)).await?;
    let stage = |stage: pb::MoveStage| pb::MoveSequenceResponse {
        stage: stage as i32,
        ..received
    };
    if answer.send(Ok(stage(pb::MoveStage::Prepared))).await.is_err() {
        return Ok(()); // the sender went away: the staged copy goes
    }
    let Part::Commit(_) = next(&mut stream, "the commit").await? else {
        return Err(invalid(wire::MOVE_PART, "must be the commit after the prepare"));
    };
    m.node
        .take_over(&key, &from.node_id, header.record_revision, header.incarnation)
        .await
        .map_err(refused)?;
    staged.keep();
    tracing::info!(sequence = %key, from = %from.node_id, pages = received.pages, bytes = received.bytes, "received a moved sequence");
    let _ = answer.send(Ok(stage(pb::MoveStage::Committed))).await;
    Ok(())
}

/// Whether this node may receive the sequence: it serves, placement gives
/// the sequence to it, it can persist durable rows, and it does not own
/// the id already. The sender, as a peer.
fn check(
    m: &Mover,
    key: &SequenceKey,
    hashes: &[Vec<u8>],
    group: Option<&Group>,
    from: &str,
    durable: bool,
) -> Result<Peer, Status> {
    m.node.check_serving().map_err(refused)?;
    let view = m.node.view();
    let Some(sender) = view.member(from) else {
        return Err(Status::failed_precondition(format!(
            "header.from_node: {from:?} is not a member of the cluster"
        )));
    };
    let from = Peer::of(sender);
    let placed = view.placed(placement(key.tenant.as_str(), key.sequence.as_str(), hashes, group));
    match placed {
        Some(n) if n.node_id == m.node.id() => {}
        Some(n) => {
            return Err(refused(kvtier_cluster::Refusal::Elsewhere {
                sequence: key.sequence.as_str().to_owned(),
                why: "placed on",
                owner: n.node_id.clone(),
                addr: n.addr.clone(),
                this: m.node.id().to_owned(),
            }));
        }
        None => return Err(Status::unavailable("no node is serving in this node's view")),
    }
    if durable && m.store.config().nvme.is_none() {
        return Err(Status::failed_precondition(format!(
            "header.durable: sequence {key} has durable rows, and node {} has no NVMe tier to keep them",
            m.node.id()
        )));
    }
    if m.node.incarnation(key).is_some() {
        return Err(Status::already_exists(format!(
            "header.sequence_id: node {} owns a sequence {key} already",
            m.node.id()
        )));
    }
    Ok(from)
}

/// A received copy not yet taken over: dropped unless kept.
struct Staged {
    mover: Arc<Mover>,
    key: SequenceKey,
    kept: bool,
}

impl Staged {
    fn keep(mut self) {
        self.kept = true;
        self.mover.gate.end(&self.key);
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if self.kept {
            return;
        }
        let (m, key) = (Arc::clone(&self.mover), self.key.clone());
        // Dropped mid-stream (the call failed or went away): off the
        // runtime, since the drop journals.
        let cleanup = move || {
            if m.node.incarnation(&key).is_none()
                && let Err(e) = m.store.drop_sequence(&key)
            {
                tracing::debug!(sequence = %key, error = %e, "no staged copy to drop");
            }
            m.gate.end(&key);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn_blocking(cleanup)),
            Err(_) => cleanup(),
        }
    }
}
