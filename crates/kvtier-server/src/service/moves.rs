//! `DrainNode` and `MoveSequence`: admin calls of a cluster node; the work
//! is in `moves/`.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use kvtier_core::wire;
use kvtier_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::{KvTierService, open};
use crate::moves::{self, Mover};
use crate::status::invalid;

/// The progress of a drain, as it happens.
pub(crate) type DrainStream = tokio_stream::adapters::Map<
    ReceiverStream<pb::DrainProgress>,
    fn(pb::DrainProgress) -> Result<pb::DrainProgress, Status>,
>;

const DEFAULT_PARALLEL: u32 = 2;
const MAX_PARALLEL: u32 = 16;

fn mover(svc: &KvTierService) -> Result<&Arc<Mover>, Status> {
    svc.moves
        .as_ref()
        .ok_or_else(|| Status::failed_precondition("this server is not in a cluster (it was started without --etcd)"))
}

pub(super) async fn drain_node(
    svc: &KvTierService,
    request: Request<pb::DrainNodeRequest>,
) -> Result<Response<DrainStream>, Status> {
    let (caller, r) = open(request)?;
    caller.check_admin("DrainNode")?;
    let m = mover(svc)?;
    if !r.node_id.is_empty() && r.node_id != m.node.id() {
        return Err(Status::failed_precondition(format!(
            "{}: is {:?}, but this is node {:?}",
            wire::DRAIN_NODE_ID.path,
            r.node_id,
            m.node.id()
        )));
    }
    let parallel = match r.parallel {
        0 => DEFAULT_PARALLEL,
        p if p <= MAX_PARALLEL => p,
        p => return Err(invalid(wire::DRAIN_PARALLEL, format!("is {p}, at most {MAX_PARALLEL}"))),
    };
    if m.draining.swap(true, Ordering::AcqRel) {
        return Err(Status::failed_precondition(format!(
            "node {} is moving its sequences already; wait for that drain to end",
            m.node.id()
        )));
    }
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(moves::drain(Arc::clone(m), r.stay, parallel as usize, tx));
    let ok: fn(pb::DrainProgress) -> Result<pb::DrainProgress, Status> = Ok;
    Ok(Response::new(ReceiverStream::new(rx).map(ok)))
}

pub(super) async fn move_sequence(
    svc: &KvTierService,
    request: Request<Streaming<pb::MoveSequenceRequest>>,
) -> Result<Response<moves::MoveStream>, Status> {
    let (caller, stream) = open(request)?;
    caller.check_admin("MoveSequence")?;
    let m = mover(svc)?;
    Ok(Response::new(moves::receive(Arc::clone(m), stream)))
}
